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
from graphrt.openmp import _libgomp, release_thread_pool

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
        before = thread_ids()
        parallel_work()
        assert thread_ids() - before, "the host thread still had its OpenMP workers after the engine was built"
    finally:
        llm.engine.close()
