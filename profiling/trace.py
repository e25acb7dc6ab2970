"""The timeline as a Chrome / Perfetto trace (open it at ui.perfetto.dev or chrome://tracing).

One process, one track per pipeline stage and one for the host scheduler. Each stage's track
holds one complete ("X") event per micro-batch it ran, named `mb{id} decode bs{bucket}` or
`mb{id} prefill`; each host tick is an event on the host track, with the host's waits for a
micro-batch nested inside. Times are microseconds since the
timeline started, as the trace format wants.
"""

from __future__ import annotations

import json
from pathlib import Path

from graphrt.profiling.timeline import Slice, Timeline

PID = 1
HOST_TID = 0  # the host scheduler's track; stage s is track s + 1


def stage_tid(stage: int) -> int:
    return stage + 1


def slice_name(piece: Slice) -> str:
    if piece.kind == "decode":
        return f"mb{piece.micro_batch} decode bs{piece.bucket}"
    return f"mb{piece.micro_batch} {piece.kind}"  # prefill, or a speculative verify step


def _metadata(name: str, tid: int, value, key: str = "name") -> dict:
    return {"name": name, "ph": "M", "pid": PID, "tid": tid, "ts": 0, "args": {key: value}}


def chrome_trace(timeline: Timeline, num_stages: int, title: str = "graphrt") -> dict:
    """The trace as a JSON-ready dict: {"traceEvents": [...], "displayTimeUnit": "ms"}."""
    events = [_metadata("process_name", HOST_TID, title)]
    tracks = [(HOST_TID, "host scheduler")] + [(stage_tid(s), f"stage {s}") for s in range(num_stages)]
    for order, (tid, name) in enumerate(tracks):
        events.append(_metadata("thread_name", tid, name))
        events.append(_metadata("thread_sort_index", tid, order, key="sort_index"))
    for piece in sorted(timeline.slices, key=lambda p: (p.stage, p.start)):
        events.append({
            "name": slice_name(piece),
            "cat": piece.kind,
            "ph": "X",
            "ts": piece.start * 1e6,
            "dur": (piece.end - piece.start) * 1e6,
            "pid": PID,
            "tid": stage_tid(piece.stage),
            "args": {
                "stage": piece.stage, "slot": piece.slot, "micro_batch": piece.micro_batch,
                "kind": piece.kind, "rows": piece.rows, "bucket": piece.bucket,
            },
        })
    for number, (start, end) in enumerate(timeline.host_ticks):
        events.append({
            "name": "scheduler tick", "cat": "host", "ph": "X", "ts": start * 1e6, "dur": (end - start) * 1e6,
            "pid": PID, "tid": HOST_TID, "args": {"tick": number},
        })
    for start, end in timeline.host_waits:  # nested inside their tick
        events.append({
            "name": "wait for micro-batch", "cat": "host", "ph": "X", "ts": start * 1e6, "dur": (end - start) * 1e6,
            "pid": PID, "tid": HOST_TID, "args": {},
        })
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(timeline: Timeline, num_stages: int, path: Path, title: str = "graphrt") -> Path:
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(timeline, num_stages, title)))
    return path
