"""The built-in timeline: when each stage worked on which micro-batch.

On a CPU the stage worker reads the clock around its work. On CUDA two events bracket the work on
the stage's stream and are read only after the micro-batch is done, never with an unsynchronised
host clock. Times are seconds since the timeline started.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass

import torch


def mark(device: torch.device):
    """A point in a stage's work: a CUDA event recorded on the current stream (read only after the
    work is done), or on a CPU the clock, read in the worker that does the work."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


@dataclass(frozen=True)
class Slice:
    stage: int
    slot: int
    micro_batch: int
    kind: str  # "prefill" | "decode" | "verify" (speculative decoding)
    rows: int
    bucket: int | None  # decode only
    start: float
    end: float
    rank: int = 0  # the process that ran it (with --procs; rank 0 is the engine's)
    expert_rank: int = 0  # under --ep, which of its stage's ranks (0: the leader, which passes it on)
    combine_s: float = 0.0  # under --ep on gloo, its seconds in the sparse layers' all-reduces


class Timeline:
    """Slices of stage work, host ticks and host waits. With --procs each worker keeps one of its
    own and rank 0 gathers them (`add_remote`): the stages' leaders' slices join `slices`, the other
    expert ranks' go to `rank_slices`, so that every figure of a stage counts its work once."""

    def __init__(self, devices: list[torch.device]):
        self.origin = time.perf_counter()
        self.origin_wall = time.time()  # the same moment on the wall clock, which other processes share
        self.slices: list[Slice] = []
        self.rank_slices: list[Slice] = []  # under --ep, the work of every stage's other expert ranks
        self.host_ticks: list[tuple[float, float]] = []  # (start, end) of each scheduler tick
        self.host_waits: list[tuple[float, float]] = []  # (start, end) of each wait for a micro-batch, inside ticks
        self._lock = threading.Lock()
        self._pending: list[tuple[dict, torch.cuda.Event, torch.cuda.Event]] = []
        self._cuda_origin: dict[torch.device, tuple[torch.cuda.Event, float]] = {}
        for device in {d for d in devices if d.type == "cuda"}:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(device))
            event.synchronize()
            self._cuda_origin[device] = (event, time.perf_counter() - self.origin)

    def now(self) -> float:
        return time.perf_counter() - self.origin

    def begin(self, device: torch.device):
        """Called on the stage's stream (inside the CPU worker, or with the CUDA stream current)."""
        return mark(device)

    def end(self, device: torch.device, started, **fields) -> None:
        finished = mark(device)
        with self._lock:
            if device.type == "cuda":
                self._pending.append(({**fields, "device": device}, started, finished))
            else:
                self.slices.append(Slice(start=started - self.origin, end=finished - self.origin, **fields))

    def resolve(self) -> None:
        """Turn the CUDA events of finished work into slices (call after the work is done)."""
        with self._lock:
            pending, self._pending = self._pending, []
        for fields, started, finished in pending:
            if not finished.query():
                with self._lock:
                    self._pending.append((fields, started, finished))
                continue
            origin_event, origin_s = self._cuda_origin[fields.pop("device")]
            start = origin_s + origin_event.elapsed_time(started) / 1000
            end = origin_s + origin_event.elapsed_time(finished) / 1000
            with self._lock:
                self.slices.append(Slice(start=start, end=end, **fields))

    def wall_slices(self, since: int = 0) -> list[dict]:
        """The finished slices from the `since`-th on, with wall-clock times, for another process's
        timeline (`add_remote`). Finished slices are only ever appended, so a caller that remembers
        how many it has taken converts each one once."""
        self.resolve()
        with self._lock:
            slices = self.slices[since:]
        return [{**dataclasses.asdict(s), "start": s.start + self.origin_wall, "end": s.end + self.origin_wall} for s in slices]

    def add_remote(self, wall_slices: list[dict]) -> None:
        """Another process's `wall_slices`, on this timeline's clock. Across hosts the times are as
        close as the hosts' clocks are."""
        for fields in wall_slices:
            piece = Slice(**{**fields, "start": fields["start"] - self.origin_wall, "end": fields["end"] - self.origin_wall})
            with self._lock:
                (self.slices if piece.expert_rank == 0 else self.rank_slices).append(piece)

    def record_tick(self, start: float, end: float) -> None:
        self.host_ticks.append((start, end))

    def record_wait(self, start: float, end: float) -> None:
        self.host_waits.append((start, end))

    def busy_fraction(self, stage: int, window: tuple[float, float]) -> float:
        """Share of the window in which the stage was working (its slices never overlap)."""
        lo, hi = window
        busy = sum(max(0.0, min(s.end, hi) - max(s.start, lo)) for s in self.slices if s.stage == stage)
        return busy / (hi - lo)
