"""One OpenMP thread team at a time: the host hands its workers back once the stages take over.

torch's CPU ops run their parallel loops on GNU OpenMP (libgomp), which gives every thread that
opens a parallel region a team of worker threads of its own, kept for that thread's next region.
Between two regions the workers spin for a while, then sleep on a futex. As soon as libgomp
manages more threads than the process has CPUs, it cuts that spin to about a hundred rounds for
every team, so each op then pays for waking its workers from the kernel.

The engine loads its weights and times its kernels on the host thread and then runs the model on
the stage threads (graphrt.streams): the host's idle team alone tips a 2-core machine over that
limit, and a 32-row bfloat16 decode step of the default model took 38 ms on the stage thread
instead of the 27 it takes with one team (2-core AMD EPYC, benchmarks/results.md).
`release_thread_pool` gives the calling thread's workers back (OpenMP 5.0's
omp_pause_resource_all); they come back by themselves if that thread opens a parallel region again.

Spinning is right while the team has its cores to itself and ruinous when other processes want
them: a worker spinning at a barrier burns the slice its partner needed, and with two busy loops
beside it on 2 cores `graphrt bench` ran 2-3x slower than with libgomp's short spin. So each CPU
stage thread sizes its team to the cores other processes leave (`TeamSizer`, measured from
/proc/stat every half second): the full team on a quiet machine, fewer threads beside busy
neighbours, one thread (no barriers at all) when they take a whole core of two.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable

import torch

logger = logging.getLogger(__name__)

OMP_PAUSE_HARD = 2  # omp_pause_resource_t: free the threads, not just park them
PROC_MAPS = Path("/proc/self/maps")
PROC_STAT = Path("/proc/stat")
PROC_SELF_STAT = Path("/proc/self/stat")


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp this process already loaded (torch's own copy on Linux wheels), or None: not
    Linux, or torch runs on another OpenMP runtime or thread pool."""
    try:
        maps = PROC_MAPS.read_text()
    except OSError:
        return None
    paths = {line.split(maxsplit=5)[-1] for line in maps.splitlines() if "/libgomp" in line}
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)  # already loaded: the same handle, no second runtime
        except OSError:
            continue
        if hasattr(lib, "omp_pause_resource_all"):  # libgomp from GCC 9 on
            lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
            lib.omp_pause_resource_all.restype = ctypes.c_int
            lib.omp_set_num_threads.argtypes = [ctypes.c_int]
            return lib
    return None


def release_thread_pool() -> bool:
    """Free the OpenMP worker threads of the calling thread's team (other threads' teams are not
    touched). Returns whether libgomp freed them; False where there is no libgomp to ask."""
    lib = _libgomp()
    if lib is None:
        return False
    code = lib.omp_pause_resource_all(OMP_PAUSE_HARD)
    if code != 0:  # inside a parallel region, which the host thread never is
        logger.debug("omp_pause_resource_all returned %d; the calling thread keeps its OpenMP workers", code)
    return code == 0


def set_team_size(threads: int) -> bool:
    """Run the calling thread's later parallel regions on `threads` threads; other threads and
    torch's default for new threads keep theirs (torch.set_num_threads would change both).
    Returns False where there is no libgomp to ask."""
    lib = _libgomp()
    if lib is None:
        return False
    torch.get_num_threads()  # torch sets a thread's team size at its first parallel op: do that first
    lib.omp_set_num_threads(threads)
    return True


def cpu_seconds() -> tuple[float, float] | None:
    """(CPU seconds the CPUs this process may run on have been busy, CPU seconds this process has
    used), both since boot; None where /proc does not say (not Linux)."""
    try:
        cpus = {f"cpu{index}" for index in os.sched_getaffinity(0)}
        busy_ticks = 0
        for line in PROC_STAT.read_text().splitlines():
            fields = line.split()
            if fields and fields[0] in cpus:  # user nice system idle iowait irq softirq steal ...
                user, nice, system, _idle, _iowait, irq, softirq = map(int, fields[1:8])
                busy_ticks += user + nice + system + irq + softirq
        own = PROC_SELF_STAT.read_text().rsplit(")", 1)[1].split()
        own_ticks = int(own[11]) + int(own[12])  # utime, stime: every thread of this process
    except (OSError, AttributeError, ValueError, IndexError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    return busy_ticks / tick, own_ticks / tick


def team_size(full: int, others: float) -> int:
    """Threads for a team of at most `full` when other processes keep `others` cores busy: one
    fewer for each whole core they take, three quarters of a core counting as one (so the bursts
    of an HTTP front and its clients, up to 0.6 of a core while serving 32 streams on 2 cores,
    leave the team whole), and at least one."""
    return max(1, min(full, full - int(others + 0.25)))


class TeamSizer:
    """Sizes the OpenMP team of the thread that calls `fit` (a CPU stage thread, before each
    micro-batch) to what other processes leave of the cores, measured over the last half second."""

    INTERVAL_S = 0.5

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        usage: Callable[[], tuple[float, float] | None] = cpu_seconds,
        apply: Callable[[int], bool] = set_team_size,
    ):
        self.clock, self.usage, self.apply = clock, usage, apply
        self.full: int | None = None  # the team torch gives the thread: the most it gets back
        self.size: int | None = None
        self.others = 0.0  # cores other processes used in the last interval
        self._last: tuple[float, float, float] | None = None  # (time, busy s, own s)

    def fit(self) -> None:
        now = self.clock()
        if self._last is not None and now - self._last[0] < self.INTERVAL_S:
            return
        usage = self.usage()
        if usage is None:
            return
        if self.full is None:
            self.full = self.size = torch.get_num_threads()
        if self._last is not None:
            then, busy, own = self._last
            self.others = max(0.0, (usage[0] - busy) - (usage[1] - own)) / (now - then)
            size = team_size(self.full, self.others)
            if size != self.size and self.apply(size):
                logger.info("OpenMP team of %s: %d -> %d threads (other processes used %.2f cores)",
                            threading.current_thread().name, self.size, size, self.others)
                self.size = size
        self._last = (now, *usage)
