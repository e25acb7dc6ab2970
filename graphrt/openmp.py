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
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

OMP_PAUSE_HARD = 2  # omp_pause_resource_t: free the threads, not just park them
PROC_MAPS = Path("/proc/self/maps")


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
