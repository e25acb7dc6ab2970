"""Which cores the server's front process and its engine process run on (`--cpu-placement`).

pin: the front (HTTP, tokenizing, detokenizing) on the first usable core, the engine process, its
stage threads and torch's threads on the rest, so a burst of HTTP work never takes a core from
the engine's OpenMP team mid-step. float: both over every usable core, as the kernel schedules
them; with few cores that is better than leaving one to a front that is idle most of the time.
auto: pin with MIN_CORES_TO_PIN usable cores or more, else float.

The placement is planned once, in the front, from the cores it may use before anyone is pinned,
and the engine's cores are sent to the engine process: a child that worked its cores out from a
mask it inherited from an already pinned front would find one core and leave itself none.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from graphrt.errors import GraphrtError

CPU_PLACEMENTS = ("auto", "pin", "float")
MIN_CORES_TO_PIN = 4  # auto pins from here on; below, a core for the front is too much of the machine
PROC_SELF_TASKS = Path("/proc/self/task")


@dataclass(frozen=True)
class CpuPlacement:
    """Where the front and the engine run; `mode` is what was done ("pin" or "float"), `reason` why,
    in the start-up banner's words."""

    mode: str
    front_cores: tuple[int, ...]
    engine_cores: tuple[int, ...]
    reason: str

    @property
    def pinned(self) -> bool:
        return self.mode == "pin"

    def describe(self) -> str:
        return f"cpu placement: {self.mode} ({self.reason})"


def usable_cores() -> list[int]:
    """The cores this process may run on, in order."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def core_list(cores: Iterable[int]) -> str:
    """"core 3", "cores 1-15" or "cores 2,5,7-9": a core set as `taskset -c` writes it."""
    ordered = sorted(set(cores))
    if not ordered:
        return "no cores"
    runs: list[list[int]] = []
    for core in ordered:
        if runs and core == runs[-1][-1] + 1:
            runs[-1].append(core)
        else:
            runs.append([core])
    text = ",".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)
    return f"core {text}" if len(ordered) == 1 else f"cores {text}"


def plan_cpu_placement(requested: str, cores: Iterable[int], engine_process: bool = True) -> CpuPlacement:
    """The placement `requested` ("auto", "pin" or "float") comes to on the usable `cores`;
    `engine_process`: whether the engine runs in a process of its own (without one there is a
    single process to place, so pin is refused and auto floats). A ValueError says what to pass
    instead where the request cannot be met."""
    if requested not in CPU_PLACEMENTS:
        raise ValueError(f"--cpu-placement {requested!r} is not one of {', '.join(CPU_PLACEMENTS)}")
    ordered = tuple(sorted(set(cores)))
    if not ordered:
        raise ValueError("no usable cores: this process may run on none; check its affinity with `taskset -cp <pid>`")
    every = core_list(ordered)

    def floating(reason: str) -> CpuPlacement:
        return CpuPlacement("float", ordered, ordered, reason)

    if not engine_process:
        if requested == "pin":
            raise ValueError("--cpu-placement pin places the front and the engine process apart, and --no-engine-process "
                             "runs the engine in the front's process; drop one of the two")
        return floating(f"the engine runs on a thread of the server's process, over {every}; pinning needs the engine process")
    if requested == "float":
        return floating(f"--cpu-placement float: front and engine share {every}")
    if requested == "auto" and len(ordered) < MIN_CORES_TO_PIN:
        return floating(f"{len(ordered)} usable {'core' if len(ordered) == 1 else 'cores'}; "
                        f"pinning needs {MIN_CORES_TO_PIN}, or --cpu-placement pin")
    if len(ordered) < 2:
        raise ValueError(f"--cpu-placement pin needs 2 usable cores, one for the front and one for the engine, and this "
                         f"process may run on {every} only; pass --cpu-placement float, or allow more cores (taskset -c)")
    front, engine = ordered[:1], ordered[1:]
    layout = f"front on {core_list(front)}, engine on {core_list(engine)}"
    if requested == "auto":
        layout = f"{len(ordered)} usable cores: {layout}"
    return CpuPlacement("pin", front, engine, layout)


def pin_process(cores: Iterable[int], who: str) -> None:
    """Restrict every thread of this process to `cores` (threads started later inherit it from their
    creator); `who` names the process in the error. os.sched_setaffinity(0, ...) alone would move
    only the calling thread and leave the threads already running (ZMQ's I/O threads) where they were."""
    cores = set(cores)
    try:
        tasks = [int(task.name) for task in PROC_SELF_TASKS.iterdir()]
        for task in tasks:
            try:
                os.sched_setaffinity(task, cores)
            except ProcessLookupError:
                pass  # the thread ended since the listing
    except (OSError, AttributeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else f"{type(exc).__name__}: {exc}"
        raise GraphrtError(f"cannot pin {who} to {core_list(cores)} ({reason}); pass --cpu-placement float") from None
