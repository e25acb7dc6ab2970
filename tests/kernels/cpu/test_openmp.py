"""The host thread gives its OpenMP workers back once the engine is built (graphrt.kernels.cpu.openmp).

libgomp starts a thread's workers at its first parallel region and keeps them; a team given back
is started afresh by the next region, with new threads. So "new threads appear when the host runs
a parallel op" is what tells, without a clock, that the host held no team.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from graphrt.kernels.cpu.openmp import (
    LoadWatch,
    TeamSizer,
    busy_ticks,
    cpu_seconds,
    openmp_available,
    own_ticks,
    release_thread_pool,
    set_team_size,
    team_size,
)
from graphrt.llm import LLM
from graphrt.runtime.streams import CpuStream

needs_libgomp = pytest.mark.skipif(
    not Path("/proc/self/task").is_dir() or not openmp_available(), reason="needs Linux and torch on libgomp"
)


@pytest.fixture
def two_threads():
    """Teams of two (an in-process cluster earlier in the suite may have left torch at one thread);
    threads started from here on take it too."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def thread_ids() -> set[int]:
    return {int(tid) for tid in os.listdir("/proc/self/task")}


def parallel_work() -> None:
    """An op torch splits over its threads (4M elements: far above its grain)."""
    torch.ones(1 << 22).mul_(3).sum()


def gone(tids: set[int], wait_s: float = 30.0) -> bool:
    """Whether every thread in `tids` has exited (they leave right after libgomp frees them)."""
    deadline = time.monotonic() + wait_s
    while tids & thread_ids():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def on_new_thread(fn):
    """What `fn()` returns when run on a thread of its own (which has no OpenMP team yet)."""
    box = {}
    thread = threading.Thread(target=lambda: box.update(result=fn()))
    thread.start()
    thread.join()
    return box["result"]


@needs_libgomp
@pytest.mark.usefixtures("two_threads")
def test_release_frees_the_calling_threads_workers_only():
    def on_a_thread():
        before = thread_ids()
        parallel_work()
        workers = thread_ids() - before
        outcome = {"workers": workers, "released": release_thread_pool(), "gone": gone(workers)}
        parallel_work()  # the team comes back on demand
        return outcome | {"again": thread_ids() - before - workers}

    parallel_work()  # the main thread's team, which must survive the other thread's release
    outcome = on_new_thread(on_a_thread)
    assert len(outcome["workers"]) == torch.get_num_threads() - 1, "a parallel op on a new thread started no OpenMP workers"
    assert outcome["released"] and outcome["gone"]
    assert outcome["again"], "the next parallel op on that thread started no workers"
    before = thread_ids()
    parallel_work()
    assert thread_ids() - before == set(), "the main thread's team went with the other thread's"


@needs_libgomp
@pytest.mark.usefixtures("two_threads")
def test_engine_host_thread_holds_no_team_once_built(tiny_model_factory):
    parallel_work()  # the host thread's team exists before the engine is built
    llm = LLM(tiny_model_factory(), dtype="float32")
    try:
        assert len(llm.generate([1, 2, 3])[0].token_ids) > 0  # the stage thread's team runs the model
        assert llm.engine.ring.streams[0].hooks.max_threads == 2  # sized on the stage thread before its first micro-batch
        before = thread_ids()
        parallel_work()
        assert thread_ids() - before, "the host thread still had its OpenMP workers after the engine was built"
    finally:
        llm.engine.close()


@needs_libgomp
@pytest.mark.usefixtures("two_threads")
def test_a_team_the_caller_makes_between_steps_goes_at_the_next_step(tiny_model_factory):
    """Torch work on the calling thread between generate calls (its own model, say: moe_bench.py ran
    transformers there) brings that thread's team back; while it idles, libgomp manages more threads
    than there are cores and throttles the stage threads' spin (a 32-row MoE decode fell from about
    950 to 315 tok/s on 2 cores). The engine's next step lets those workers go."""
    llm = LLM(tiny_model_factory(), dtype="float32")
    try:
        llm.generate([1, 2, 3])
        before = thread_ids()
        parallel_work()
        workers = thread_ids() - before
        assert workers, "a parallel op on the calling thread started no OpenMP workers"
        llm.generate([4, 5, 6])
        assert gone(workers, wait_s=10.0), "the calling thread's OpenMP workers outlived the engine's steps"
    finally:
        llm.engine.close()


@needs_libgomp
@pytest.mark.usefixtures("two_threads")
def test_an_idle_engine_lets_its_stage_threads_workers_go(tiny_model_factory, monkeypatch):
    """The other way round: while nothing runs, the stage thread's idle team would throttle the
    caller's own torch work (transformers ran about a fifth slower beside an idle engine)."""
    monkeypatch.setattr(CpuStream, "IDLE_S", 2.0)  # long enough to see the workers before they go
    # Torch's whole team, whatever else runs: beside a busy neighbour (the suite's other worker) the
    # sizer rightly shrinks it to one thread, which has no workers to go or come back (one CI run).
    monkeypatch.setattr("graphrt.kernels.cpu.openmp.TeamSizer.fit", lambda self: None)
    llm = LLM(tiny_model_factory(), dtype="float32")
    try:
        before = thread_ids()
        llm.generate([1, 2, 3])
        workers = thread_ids() - before
        assert workers, "the stage thread's parallel ops started no OpenMP workers"
        assert gone(workers, wait_s=10.0), "the stage thread kept its OpenMP workers while the engine idled"
        before = thread_ids()
        assert len(llm.generate([4, 5, 6])[0].token_ids) > 0
        assert thread_ids() - before, "the next work started no OpenMP workers again"
    finally:
        llm.engine.close()


def test_team_size_gives_back_a_thread_per_core_others_take():
    assert [team_size(2, 2, others) for others in (0.0, 0.6, 0.74, 0.75, 1.0, 1.9, 5.0)] == [2, 2, 2, 1, 1, 1, 1]
    assert [team_size(16, 16, others) for others in (0.0, 3.8, 20.0)] == [16, 12, 1]
    # Two stage processes with 8 threads each on 16 cores: the other's 8 leave this team whole.
    assert [team_size(8, 16, others) for others in (8.0, 9.0, 12.0)] == [8, 7, 4]
    assert team_size(1, 2, 0.0) == 1


PROC_STAT_TEXT = """cpu  900 50 300 8000 10 5 5 7 0 0
cpu0 100 10 50 4000 5 1 2 3 0 0
cpu1 200 40 70 4000 5 2 3 4 0 0
cpu2 600 0 180 0 0 2 0 0 0 0
intr 12345 1 2 3
ctxt 999
"""


def test_busy_ticks_counts_the_given_cpus_without_nice_idle_or_steal():
    assert busy_ticks(PROC_STAT_TEXT, {0, 1}) == (100 + 50 + 1 + 2) + (200 + 70 + 2 + 3)
    assert busy_ticks(PROC_STAT_TEXT, {2}) == 600 + 180 + 2
    assert busy_ticks(PROC_STAT_TEXT, {7}) == 0


def test_own_ticks_reads_utime_and_stime_past_a_command_with_parentheses():
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime ...
    text = "4242 (python (x) y) R 1 4242 4242 0 -1 4194304 100 0 0 0 1234 56 0 0 20 0 5 0"
    assert own_ticks(text) == 1234 + 56


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="needs Linux /proc")
def test_cpu_seconds_counts_colleagues_as_own_and_skips_those_gone():
    import subprocess
    import sys

    burner = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nwhile time.process_time() < 0.3: pass\nprint('done', flush=True)\nsys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert burner.stdout.readline().strip() == "done"
        alone, with_burner = cpu_seconds(), cpu_seconds([burner.pid, 2**22 + 1])  # the second pid: no such process
        assert with_burner[1] - alone[1] >= 0.25  # the burner's 0.3 s of CPU, give or take a clock tick
    finally:
        burner.stdin.close()
        burner.wait()


class FakeMachine:
    """A clock and /proc's CPU seconds that a test moves by hand."""

    def __init__(self):
        self.now = 100.0
        self.busy = self.own = 0.0
        self.applied: list[int] = []

    def run(self, seconds: float, own_cores: float, other_cores: float) -> None:
        self.now += seconds
        self.own += own_cores * seconds
        self.busy += (own_cores + other_cores) * seconds

    def sizer(self) -> TeamSizer:
        sizer = TeamSizer(clock=lambda: self.now, usage=lambda: (self.busy, self.own),
                          apply=lambda n: self.applied.append(n) or True, num_cores=2)
        sizer.fit()  # the first reading: nothing to compare with yet
        sizer.max_threads = sizer.num_threads = 2  # whatever torch's count is in this process
        return sizer


def test_team_sizer_follows_what_other_processes_leave():
    machine = FakeMachine()
    sizer = machine.sizer()
    machine.run(0.2, own_cores=2.0, other_cores=1.0)
    sizer.fit()  # within the half second: not measured again
    assert machine.applied == []
    machine.run(0.4, own_cores=1.0, other_cores=1.0)
    sizer.fit()
    assert machine.applied == [1] and sizer.num_threads == 1 and sizer.others == pytest.approx(1.0)
    machine.run(0.6, own_cores=1.0, other_cores=1.3)
    sizer.fit()
    assert machine.applied == [1]  # still one: nothing applied again
    machine.run(0.6, own_cores=1.0, other_cores=0.4)
    sizer.fit()
    assert machine.applied == [1]  # 0.4 of a core: within half a core of the line, so no growing yet
    machine.run(0.6, own_cores=1.0, other_cores=0.1)
    sizer.fit()
    assert machine.applied == [1, 2] and sizer.num_threads == 2


def test_team_sizer_starts_afresh_after_an_idle_gap():
    machine = FakeMachine()
    sizer = machine.sizer()
    machine.run(60.0, own_cores=0.0, other_cores=1.0)  # the engine idle a minute, a neighbour busy
    sizer.fit()
    assert machine.applied == []  # too old to say what the neighbours do now
    machine.run(0.5, own_cores=2.0, other_cores=0.0)
    sizer.fit()
    assert machine.applied == [] and sizer.others == 0.0


def test_team_sizer_without_proc_changes_nothing():
    applied = []
    sizer = TeamSizer(clock=iter(range(0, 100, 10)).__next__, usage=lambda: None, apply=applied.append, num_cores=2)
    for _ in range(3):
        sizer.fit()
    assert applied == [] and sizer.num_threads is None


def watch_on(machine: FakeMachine) -> LoadWatch:
    return LoadWatch(clock=lambda: machine.now, usage=lambda: (machine.busy, machine.own),
                     apply=lambda n: machine.applied.append(n) or True, num_cores=2)


@pytest.mark.usefixtures("two_threads")
def test_load_watch_times_on_the_team_a_stage_would_size_to_beside_busy_neighbours():
    machine = FakeMachine()
    watch = watch_on(machine)
    machine.run(3.0, own_cores=1.0, other_cores=1.1)  # two busy loops beside the load
    assert watch.others() == pytest.approx(1.1)
    with watch.timing_team() as note:
        assert machine.applied == [1]
    assert machine.applied == [1, 2]  # torch's whole team again for whatever follows
    assert note == "timed on 1 of 2 threads (other processes used 1.10 cores while loading)"


@pytest.mark.usefixtures("two_threads")
def test_load_watch_keeps_the_whole_team_when_neighbours_leave_enough_or_cannot_tell():
    machine = FakeMachine()
    watch = watch_on(machine)
    machine.run(3.0, own_cores=1.5, other_cores=0.5)  # an HTTP front starting beside the engine
    with watch.timing_team() as note:
        pass
    assert machine.applied == [] and note is None
    machine = FakeMachine()
    watch = watch_on(machine)
    machine.run(0.01, own_cores=1.0, other_cores=1.0)  # a tiny model: too short a load to tell
    assert watch.others() is None
    with watch.timing_team() as note:
        pass
    assert machine.applied == [] and note is None
    no_proc = LoadWatch(clock=lambda: machine.now, usage=lambda: None, apply=machine.applied.append, num_cores=2)
    machine.run(3.0, own_cores=0.0, other_cores=2.0)
    assert no_proc.others() is None


@needs_libgomp
@pytest.mark.usefixtures("two_threads")
def test_engine_times_its_kernels_on_the_sized_team_and_says_so(tiny_model_factory, monkeypatch):
    import graphrt.engine.engine
    import graphrt.runtime.pipeline

    machine = FakeMachine()

    def watch_beside_busy_loops(colleagues=()) -> LoadWatch:
        watch = LoadWatch(clock=lambda: machine.now, usage=lambda: (machine.busy, machine.own))
        machine.run(2.0, own_cores=1.0, other_cores=1.0)  # what /proc says once the load is done
        return watch

    monkeypatch.setattr(graphrt.engine.engine, "LoadWatch", watch_beside_busy_loops)
    timed_on = []
    choose = graphrt.runtime.pipeline.Pipeline.choose_kernels
    monkeypatch.setattr(graphrt.runtime.pipeline.Pipeline, "choose_kernels",
                        lambda self, *args, **kwargs: timed_on.append(torch.get_num_threads()) or choose(self, *args, **kwargs))
    model = tiny_model_factory()

    def build():
        llm = LLM(model, dtype="float32")
        llm.engine.close()
        return llm.engine.kernel_summary(), torch.get_num_threads()

    summary, threads_after = on_new_thread(build)
    assert timed_on == [1] and threads_after == 2
    assert summary.endswith("; timed on 1 of 2 threads (other processes used 1.00 cores while loading)")


@needs_libgomp
@pytest.mark.usefixtures("two_threads")
def test_set_team_size_changes_the_calling_thread_only():
    def on_a_thread():
        before = thread_ids()
        outcome = {"set": set_team_size(1), "threads": torch.get_num_threads()}
        parallel_work()
        return outcome | {"workers": thread_ids() - before}

    assert on_new_thread(on_a_thread) == {"set": True, "threads": 1, "workers": set()}
    assert torch.get_num_threads() == 2  # this thread, and torch's default for new ones, keep theirs
    assert on_new_thread(torch.get_num_threads) == 2


def test_a_load_watch_counts_the_processes_it_is_given_as_its_own(monkeypatch):
    """The engine process watches with its front as a colleague (the front loads its tokenizer
    meanwhile); the processes are the watch's argument, not state another module fills."""
    import graphrt.kernels.cpu.openmp as openmp

    asked = []
    monkeypatch.setattr(openmp, "cpu_seconds", lambda colleagues=(): asked.append(tuple(colleagues)) or (0.0, 0.0))
    LoadWatch(colleagues=(os.getppid(),)).others()
    LoadWatch().others()
    assert asked == [(os.getppid(),)] * 2 + [()] * 2
