"""One OpenMP thread team at a time: the host hands its workers back once the stages take over.

torch's CPU ops run their parallel loops on GNU OpenMP (libgomp), which gives every thread that
opens a parallel region a team of worker threads of its own, kept for that thread's next region.
Between two regions the workers spin for a while, then sleep on a futex. As soon as libgomp
manages more threads than the process has CPUs, it cuts that spin to about a hundred rounds for
every team, so each op then pays for waking its workers from the kernel.

The engine loads its weights and times its kernels on the host thread and then runs the model on
the stage threads (graphrt.runtime.streams): the host's idle team alone tips a 2-core machine over that
limit, and a 32-row bfloat16 decode step of the default model took 38 ms on the stage thread
instead of the 27 it takes with one team (2-core AMD EPYC, benchmarks/results.md).
`release_thread_pool` gives the calling thread's workers back (OpenMP 5.0's
omp_pause_resource_all); they come back by themselves if that thread opens a parallel region again,
as a caller's own torch work between `generate` calls does, so the engine releases them again at
every step (under a microsecond when there are none): after a parallel op of the caller's, a 32-row
MoE decode ran at about 315 tok/s instead of 950 until it did. The other way round, a CPU stage
thread lets its own workers go once its stream has had no work for 0.1 s (`TeamSizer.when_idle`),
so torch work the caller runs between `generate` calls (transformers ran about a fifth slower
beside an idle engine) keeps its full spin.

Spinning is right while the team has its cores to itself and ruinous when other processes want
them: a worker spinning at a barrier burns the slice its partner needed, and with two busy loops
beside it on 2 cores `graphrt bench` ran 2-3x slower than with libgomp's short spin. So each CPU
stage thread of the engine sizes its team to the cores other processes leave (`TeamSizer`,
measured from /proc/stat every half second): torch's whole team on a quiet machine, fewer threads
beside busy neighbours, one thread (no barriers at all) when they take a whole core of two. It
covers graphrt's compiled kernels, torch's own ops and oneDNN (the packed matmuls); MKL (the dense
`F.linear` path) keeps torch's thread count. Not covered: the stage processes of `--procs` (rank 0
is), and several CPU stages in one process (each keeps torch's team, so libgomp throttles them).
Splitting the cores between them did not pay on 2 cores (`LLM(pp=2)`, float32, 3 generates per
start, two starts each way): at 16 rows 181-216 tok/s with whole teams, 180-211 with a core each,
189-214 sized by how many stages had work (all inside the noise); at one row 34-41, 19-21 and 29-36.

The host times the kernels at load (kernels/cpu/matmul_choice.py, kernels/cpu/kernel_choice.py) on
the team a stage thread would size to beside what other processes did while the engine loaded
(`LoadWatch`): beside two busy loops on 2 cores torch's whole team took 7.8 ms over a 32-row
rms_norm that takes 0.011 alone, and the choices came out at random.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

from graphrt.kernels.cpu.placement import usable_cores

logger = logging.getLogger(__name__)

OMP_PAUSE_HARD = 2  # omp_pause_resource_t: free the threads, not just park them
PROC_MAPS = Path("/proc/self/maps")
PROC_STAT = Path("/proc/stat")
PROC_SELF_STAT = Path("/proc/self/stat")


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp torch loaded (its own copy on Linux wheels; another package's copy is only a
    fallback), or None: not Linux, or torch runs on another OpenMP runtime or thread pool."""
    try:
        maps = PROC_MAPS.read_text()
    except OSError:
        return None
    torch_dir = str(Path(torch.__file__).parent)
    paths = {line.split(maxsplit=5)[-1] for line in maps.splitlines() if "/libgomp" in line}
    for path in sorted(paths, key=lambda path: (not path.startswith(torch_dir), path)):
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


def openmp_available() -> bool:
    """Whether graphrt can free and size this process's OpenMP teams."""
    return _libgomp() is not None


def release_thread_pool() -> bool:
    """Free the OpenMP worker threads of the calling thread's team, if it has one (other threads'
    teams are not touched). False where there is no libgomp to ask, or it refused (the caller is
    inside a parallel region, which the host thread never is)."""
    lib = _libgomp()
    if lib is None:
        return False
    code = lib.omp_pause_resource_all(OMP_PAUSE_HARD)
    if code != 0:
        logger.debug("omp_pause_resource_all returned %d; the calling thread keeps its OpenMP workers", code)
    return code == 0


def set_team_size(num_threads: int) -> bool:
    """Run the calling thread's later parallel regions on `num_threads` threads; other threads and
    torch's default for new threads keep theirs (torch.set_num_threads would change both).
    Returns False where there is no libgomp to ask."""
    lib = _libgomp()
    if lib is None:
        return False
    torch.get_num_threads()  # torch sets a thread's team size at its first parallel op: do that first
    lib.omp_set_num_threads(num_threads)
    return True


def busy_ticks(proc_stat: str, cpus: set[int]) -> int:
    """Clock ticks the given CPUs have spent busy since boot, from /proc/stat's text: user,
    system, irq and softirq time. Niced time is left out: a niced neighbour yields to the team."""
    total = 0
    for line in proc_stat.splitlines():
        name, *fields = line.split() or [""]
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            user, _nice, system, _idle, _iowait, irq, softirq = map(int, fields[:7])
            total += user + system + irq + softirq
    return total


def own_ticks(proc_self_stat: str) -> int:
    """Clock ticks this process (every thread) has used, from /proc/self/stat's text; the command
    name, in parentheses, may hold spaces and parentheses itself."""
    fields = proc_self_stat.rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime


def cpu_seconds(colleagues: Iterable[int] = ()) -> tuple[float, float] | None:
    """(CPU seconds the CPUs this process may run on have been busy, CPU seconds this process and
    the `colleagues` processes still alive have used), both since boot; None where /proc does not
    say (not Linux)."""
    try:
        busy = busy_ticks(PROC_STAT.read_text(), os.sched_getaffinity(0))
        own = own_ticks(PROC_SELF_STAT.read_text())
    except (OSError, AttributeError, ValueError, IndexError):
        return None
    for pid in colleagues:
        with contextlib.suppress(OSError, ValueError, IndexError):  # gone since: its seconds are lost
            own += own_ticks(Path(f"/proc/{pid}/stat").read_text())
    tick = os.sysconf("SC_CLK_TCK")
    return busy / tick, own / tick


def others_cores(before: tuple[float, float], after: tuple[float, float], seconds: float) -> float:
    """Cores other processes kept busy between two `cpu_seconds` readings `seconds` apart."""
    (busy0, own0), (busy1, own1) = before, after
    return max(0.0, (busy1 - busy0) - (own1 - own0)) / seconds


def affinity_cores() -> int:
    """CPUs this process may run on."""
    return len(usable_cores())


def team_size(max_threads: int, num_cores: int, others: float) -> int:
    """Threads for a team of at most `max_threads` on `num_cores` CPUs when other processes keep
    `others` of them busy: the cores they leave, three quarters of a core counting as a whole one
    (so the bursts of an HTTP front and its clients, up to 0.6 of a core while serving 32 streams
    on 2 cores, leave the team whole), and at least one. At rank 0 of a `--procs` pipeline the
    other stage processes, `num_cores / pp` threads each, leave its team whole."""
    return max(1, min(max_threads, num_cores - int(others + 0.25)))


class TeamSizer:
    """Sizes the OpenMP team of the thread that calls `fit` (a CPU stage thread, before each
    micro-batch) to what other processes left of the cores since the last measurement, at most
    every half second. A team grows back only once others leave half a core more than it needs,
    so a neighbour hovering at the line does not flip it at every measurement."""

    INTERVAL_S = 0.5
    STALE_S = 4 * INTERVAL_S  # a longer gap (an idle engine) starts a fresh measurement

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        usage: Callable[[], tuple[float, float] | None] = cpu_seconds,
        apply: Callable[[int], bool] = set_team_size,
        num_cores: int | None = None,
    ):
        self.clock, self.usage, self.apply = clock, usage, apply
        self.num_cores = num_cores or affinity_cores()
        self.max_threads: int | None = None  # the team torch gives the thread: the most it gets back
        self.num_threads: int | None = None
        self.others = 0.0  # cores other processes used in the last measurement
        self._last: tuple[float, float, float] | None = None  # (time, busy s, own s)

    def before_work(self) -> None:  # graphrt.runtime.streams.ThreadHooks, made by KernelSet.stream_hook
        self.fit()

    def when_idle(self) -> None:
        """The stream has no work: its workers go (a parallel op brings them back), so an idle engine
        leaves the process's other threads' teams their full spin (see the module's docstring)."""
        release_thread_pool()

    def fit(self) -> None:
        now = self.clock()
        if self._last is not None and now - self._last[0] < self.INTERVAL_S:
            return
        usage = self.usage()
        if usage is None:
            return
        if self.max_threads is None:
            self.max_threads = self.num_threads = torch.get_num_threads()
        if self._last is not None and now - self._last[0] <= self.STALE_S:
            then, busy, own = self._last
            self.others = others_cores((busy, own), usage, now - then)
            self._resize(team_size(self.max_threads, self.num_cores, self.others))
        self._last = (now, *usage)

    def _resize(self, num_threads: int) -> None:
        if num_threads > self.num_threads:  # grow only with half a core to spare
            num_threads = max(self.num_threads, team_size(self.max_threads, self.num_cores, self.others + 0.5))
        if num_threads != self.num_threads and self.apply(num_threads):
            logger.info("OpenMP team of %s: %d -> %d threads (other processes used %.2f cores)",
                        threading.current_thread().name, self.num_threads, num_threads, self.others)
            self.num_threads = num_threads


class LoadWatch:
    """What other processes do with the cores while the engine loads, from the moment it is made
    (the processes in `colleagues` count as this one: the server's front, which loads its tokenizer
    while its engine process loads the weights); `timing_team` then sizes the calling thread's team
    for timing the kernels as `TeamSizer` would size a stage thread's."""

    MIN_WINDOW_S = 0.05  # shorter (a tiny model loads in milliseconds): too few clock ticks to tell

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        usage: Callable[[], tuple[float, float] | None] | None = None,
        apply: Callable[[int], bool] = set_team_size,
        num_cores: int | None = None,
        window: str = "while loading",
        colleagues: tuple[int, ...] = (),
    ):
        """`window`: how the banner's note names the time watched."""
        self.clock, self.apply, self.window = clock, apply, window
        self.usage = usage or (lambda: cpu_seconds(colleagues))
        self.num_cores = num_cores or affinity_cores()
        self.started, self.start_usage = clock(), self.usage()

    def others(self) -> float | None:
        """Cores other processes kept busy since the watch began; None where /proc does not say or
        the window is too short to tell."""
        now, usage = self.clock(), self.usage()
        if usage is None or self.start_usage is None or now - self.started < self.MIN_WINDOW_S:
            return None
        return others_cores(self.start_usage, usage, now - self.started)

    @contextlib.contextmanager
    def timing_team(self) -> Iterator[str | None]:
        """Within: the calling thread's team sized to the cores others left during the load (torch's
        whole team where they left enough); torch's team again after. Yields a note for the start-up
        banner where the team was made smaller, else None."""
        others = self.others()
        max_threads = torch.get_num_threads()
        num_threads = max_threads if others is None else team_size(max_threads, self.num_cores, others)
        if num_threads == max_threads or not self.apply(num_threads):
            yield None
            return
        note = f"timed on {num_threads} of {max_threads} threads (other processes used {others:.2f} cores {self.window})"
        logger.info("kernels %s", note)
        try:
            yield note
        finally:
            self.apply(max_threads)
