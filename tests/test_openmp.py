"""The host thread gives its OpenMP workers back once the engine is built (graphrt.openmp).

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

from graphrt.llm import LLM
from graphrt.openmp import TeamSizer, _libgomp, release_thread_pool, set_team_size, team_size

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/task").is_dir() or _libgomp() is None, reason="needs Linux and torch on libgomp"
)


@pytest.fixture(autouse=True)
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


def test_release_frees_the_calling_threads_workers_only():
    outcome = {}

    def on_a_thread():
        before = thread_ids()
        parallel_work()
        workers = thread_ids() - before
        outcome["workers"] = workers
        outcome["released"] = release_thread_pool()
        outcome["gone"] = gone(workers)
        parallel_work()  # the team comes back on demand
        outcome["again"] = thread_ids() - before - workers

    parallel_work()  # the main thread's team, which must survive the other thread's release
    main_team = thread_ids()
    thread = threading.Thread(target=on_a_thread)
    thread.start()
    thread.join()
    assert outcome["workers"], "a parallel op on a new thread started no OpenMP workers"
    assert outcome["released"] and outcome["gone"]
    assert outcome["again"], "the next parallel op on that thread started no workers"
    assert main_team - {thread.native_id} <= thread_ids()


def test_engine_host_thread_holds_no_team_once_built(tiny_model_factory):
    parallel_work()  # the host thread's team exists before the engine is built
    llm = LLM(tiny_model_factory(), dtype="float32")
    try:
        assert len(llm.generate([1, 2, 3])[0].token_ids) > 0  # the stage thread's team runs the model
        assert llm.engine.ring.teams[0].full == 2  # sized on the stage thread before its first micro-batch
        before = thread_ids()
        parallel_work()
        assert thread_ids() - before, "the host thread still had its OpenMP workers after the engine was built"
    finally:
        llm.engine.close()


def test_team_size_gives_back_a_thread_per_core_others_take():
    assert [team_size(2, others) for others in (0.0, 0.6, 0.74, 0.75, 1.0, 1.9, 5.0)] == [2, 2, 2, 1, 1, 1, 1]
    assert [team_size(16, others) for others in (0.0, 3.8, 20.0)] == [16, 12, 1]
    assert team_size(1, 0.0) == 1


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


def test_team_sizer_follows_what_other_processes_leave():
    machine = FakeMachine()
    sizer = TeamSizer(clock=lambda: machine.now, usage=lambda: (machine.busy, machine.own),
                      apply=lambda n: machine.applied.append(n) or True)
    sizer.fit()  # the first reading: nothing to compare with yet
    assert sizer.full == sizer.size == torch.get_num_threads() == 2 and machine.applied == []
    machine.run(0.2, own_cores=2.0, other_cores=1.0)
    sizer.fit()  # within the half second: not measured again
    assert machine.applied == []
    machine.run(0.4, own_cores=1.0, other_cores=1.0)
    sizer.fit()
    assert machine.applied == [1] and sizer.size == 1 and sizer.others == pytest.approx(1.0)
    machine.run(0.6, own_cores=1.0, other_cores=1.3)
    sizer.fit()
    assert machine.applied == [1]  # still one: nothing applied again
    machine.run(0.6, own_cores=1.0, other_cores=0.1)
    sizer.fit()
    assert machine.applied == [1, 2] and sizer.size == 2


def test_team_sizer_without_proc_changes_nothing():
    applied = []
    sizer = TeamSizer(clock=iter(range(0, 100, 10)).__next__, usage=lambda: None, apply=applied.append)
    for _ in range(3):
        sizer.fit()
    assert applied == [] and sizer.size is None


def test_set_team_size_changes_the_calling_thread_only():
    outcome = {}

    def on_a_thread():
        before = thread_ids()
        outcome["set"] = set_team_size(1)
        outcome["threads"] = torch.get_num_threads()
        parallel_work()
        outcome["workers"] = thread_ids() - before

    thread = threading.Thread(target=on_a_thread)
    thread.start()
    thread.join()
    assert outcome == {"set": True, "threads": 1, "workers": set()}
    assert torch.get_num_threads() == 2  # this thread, and torch's default for new ones, keep theirs
    other = {}
    thread = threading.Thread(target=lambda: other.update(threads=torch.get_num_threads()))
    thread.start()
    thread.join()
    assert other["threads"] == 2
