"""The engine's side of serving: jobs admitted, aborted and stepped, as plain results.

An `EngineCore` is driven by exactly one thread, the only one that calls the engine: the engine
thread of an in-process server (`AsyncEngine`), or the main thread of the engine process
(`graphrt.engine.process`). A job is known by a key the caller chooses (the job itself,
or a number sent over the wire) and owns one sequence per choice.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from graphrt.engine.sequence import FinishReason, Sequence, SequenceOutput
from graphrt.errors import RequestError, StageError
from graphrt.sampling_params import SamplingParams

if TYPE_CHECKING:
    from graphrt.engine.engine import Engine

logger = logging.getLogger("graphrt.server")

SHUTTING_DOWN = "the server is shutting down; retry on another server"


# -- what a job hears from the engine ------------------------------------------------------------


@dataclass(frozen=True)
class Admitted:
    prompt_tokens: int


@dataclass(frozen=True)
class Rejected:
    """The engine refused the request (prompt too long, can never fit the KV cache...): a 400."""

    message: str
    code: str | None = None  # RequestError.code: context_length_exceeded for a request longer than the context


@dataclass(frozen=True)
class Failed:
    """The request was cut short: its grammar failed to compile (400), the server is shutting down
    (503) or the engine failed (500)."""

    status: int
    message: str


@dataclass(frozen=True)
class EngineSnapshot:
    """What /metrics shows of the engine, taken after every step."""

    num_free_blocks: int
    num_blocks: int
    num_running: int  # requests that have produced a token and are not finished
    num_waiting: int  # requests admitted to the engine that have not produced a token yet
    num_eager_fallbacks: int
    num_preemptions: int = 0  # sequences that gave their KV blocks back to be recomputed later
    stage_busy_s: tuple[float, ...] = ()  # seconds each stage has worked (stage processes: as of their last reply)
    num_cached_blocks: int = 0  # of the free blocks, those the prefix cache keeps
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    spec_num_drafts: int = 0  # speculative decoding (graphrt.engine.stats.SpecStats)
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
    # A mixture of experts: per stage, the tokens its sparse layers routed to each expert (() for a
    # dense stage; stage processes: as of their last reply)
    stage_expert_tokens: tuple[tuple[int, ...], ...] = ()
    # Expert parallelism (--ep): per rank, (stage, expert rank, busy s, s in its all-reduces, tokens
    # its experts served); the other ranks' as they last published them
    expert_ranks: tuple[tuple[int, int, float, float, int], ...] = ()
    # Structured outputs (graphrt.engine.grammar): requests added with a grammar, how long grammars
    # took to compile (counts per graphrt.engine.grammar.COMPILE_SECONDS_BUCKETS bucket, then +Inf),
    # and the constrained rows that waited on their newest token for their next mask at the last schedule.
    num_constrained: int = 0
    grammar_compile_counts: tuple[int, ...] = ()
    grammar_compile_seconds: float = 0.0
    num_waiting_on_mask: int = 0


def prompt_of(choice: int, num_prompts: int, num_choices: int) -> int:
    """Which prompt a choice continues: the choices go prompt by prompt, as OpenAI numbers them."""
    return choice * num_prompts // num_choices


class EngineCore:
    def __init__(self, engine: Engine):
        self.engine = engine
        engine.grammars.prepare()  # a server: xgrammar loads now, not on its first constrained request
        self.jobs: dict[Hashable, list[Sequence]] = {}  # key -> one sequence per choice
        self.owners: dict[int, tuple[Hashable, int]] = {}  # request id -> (key, choice)
        self._started: set[Hashable] = set()  # jobs that have produced a token

    def add(self, key: Hashable, prompt_ids: list[list[int]], params: list[SamplingParams]) -> Admitted | Rejected | Failed:
        """Admit a job: one sequence per choice, each on its prompt (`prompt_of`)."""
        seqs: list[Sequence] = []
        try:
            for choice, choice_params in enumerate(params):
                seqs.append(self.engine.add_request(prompt_ids[prompt_of(choice, len(prompt_ids), len(params))], choice_params))
        except Exception as exc:
            for seq in seqs:
                self.engine.abort(seq)
            if isinstance(exc, (RequestError, ValueError)):
                return Rejected(str(exc), exc.code if isinstance(exc, RequestError) else None)
            logger.exception("admitting a request failed")
            return Failed(500, "internal error while admitting the request; see the server log")
        self.jobs[key] = seqs
        for choice, seq in enumerate(seqs):
            self.owners[seq.request_id] = (key, choice)
        return Admitted(sum(map(len, prompt_ids)))

    def abort(self, key: Hashable) -> list[Sequence]:
        """End a job's sequences in the engine (blocks freed before the next step); its sequences,
        or none if it had already ended."""
        seqs = self.jobs.get(key, [])
        for seq in seqs:
            self.engine.abort(seq)
        self.forget(key)
        return seqs

    def finish(self, key: Hashable, choice: int, reason: FinishReason) -> None:
        """End one choice for a reason the engine can't see (a stop string in its text)."""
        seqs = self.jobs.get(key)
        if seqs is not None and not seqs[choice].finished:
            self.engine.finish(seqs[choice], reason)

    def forget(self, key: Hashable) -> None:
        for seq in self.jobs.pop(key, []):
            self.owners.pop(seq.request_id, None)
        self._started.discard(key)

    def forget_finished(self, keys) -> None:
        for key in keys:
            if all(seq.finished for seq in self.jobs.get(key, [])):
                self.forget(key)

    def step(self) -> tuple[list[tuple[Hashable, int, SequenceOutput]], list[tuple[Hashable, Failed]]]:
        """One engine step: the (key, choice, delta) of every sequence that got a token, and the
        jobs a failure ended (aborted here, each with what to answer: a choice's grammar that did
        not compile fails its whole job, as a stage failure does)."""
        try:
            outputs = self.engine.step()
        except Exception as exc:
            return [], self._failed_by(exc)
        updated, failed = [], {}
        for output in outputs:
            if output.request_id not in self.owners:
                continue  # its job ended while the delta waited (a stage failure ended it)
            key, choice = self.owners[output.request_id]
            if output.failure is not None:  # ended before it ran (its grammar failed to compile): the job fails
                failed[key] = Failed(400 if output.failure.request_fault else 500, output.failure.message)
                continue
            self._started.add(key)
            updated.append((key, choice, output))
        for key in failed:
            self.abort(key)  # its other choices too
        return [update for update in updated if update[0] not in failed], list(failed.items())

    def _failed_by(self, exc: Exception) -> list[tuple[Hashable, Failed]]:
        failure = self.engine.failure
        if failure is not None:
            # A stage process died or went silent (--procs): nothing in flight can finish; the server stops.
            logger.error("%s; failing %d requests in flight", failure, len(self.jobs))
            hit, answer = list(self.jobs), Failed(503, str(failure))
        elif isinstance(exc, StageError):
            # A stage failed and the engine recovered: only the requests it was carrying end.
            hit = [key for key, seqs in self.jobs.items() if any(s.finish_reason is FinishReason.ERROR for s in seqs)]
            logger.error("%s; failing %d requests", exc, len(hit))
            answer = Failed(500, "a pipeline stage failed while running this request; retry it")
        else:
            # A bug in the engine: fail what is in flight rather than leave clients hanging.
            logger.error("engine step failed; failing %d requests in flight", len(self.jobs), exc_info=exc)
            hit, answer = list(self.jobs), Failed(500, "internal error in the engine; see the server log")
        for key in hit:
            self.abort(key)
        return [(key, answer) for key in hit]

    def stop(self) -> list[tuple[Hashable, Failed]]:
        """Abort every job; each is answered with a 503."""
        keys = list(self.jobs)
        for key in keys:
            self.abort(key)
        return [(key, Failed(503, SHUTTING_DOWN)) for key in keys]

    def snapshot(self) -> EngineSnapshot:
        engine = self.engine
        num_running = len(self._started)
        return EngineSnapshot(
            num_free_blocks=engine.allocator.num_free,
            num_blocks=engine.allocator.num_blocks,
            num_running=num_running,
            num_waiting=len(self.jobs) - num_running,
            num_eager_fallbacks=engine.num_eager_fallbacks,
            num_preemptions=engine.scheduler.num_preemptions,
            stage_busy_s=tuple(engine.ring.stage_busy_s),
            num_cached_blocks=engine.allocator.num_cached,
            prefix_queried_tokens=engine.allocator.num_queried_tokens,
            prefix_hit_tokens=engine.allocator.num_hit_tokens,
            spec_num_drafts=engine.stats.spec.num_drafts,
            spec_num_draft_tokens=engine.stats.spec.num_draft_tokens,
            spec_num_accepted_tokens=engine.stats.spec.num_accepted_tokens,
            spec_accepted_per_position=tuple(engine.stats.spec.accepted_per_position),
            stage_expert_tokens=tuple(map(tuple, engine.ring.stage_expert_tokens)),
            expert_ranks=tuple((stage, rank, s.busy_s, s.combine_s, s.expert_tokens) for stage, rank, s in engine.expert_rank_stats()),
            num_constrained=engine.grammars.num_constrained,
            grammar_compile_counts=tuple(engine.grammars.compile_counts),
            grammar_compile_seconds=engine.grammars.compile_seconds_sum,
            num_waiting_on_mask=engine.scheduler.num_waiting_on_mask,
        )


def heap_trimmer():
    """glibc's malloc_trim(0), which returns the heap's free pages to the system; a no-op elsewhere."""
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return lambda: None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)
