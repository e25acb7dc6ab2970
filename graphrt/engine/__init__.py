"""The engine: the scheduler (the one owner of every request's state), its sequences and KV blocks,
and the loop that schedules a step, launches it on the runtime, polls and updates."""
