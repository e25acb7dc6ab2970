"""The timeline as a Chrome / Perfetto trace (open it at ui.perfetto.dev or chrome://tracing).

One process, one track for the host scheduler and one per pipeline stage; under --ep one per
expert rank, each stage's leader first. Each stage's track holds one complete ("X") event per
micro-batch it ran, named `mb{id} decode bs{bucket}` or `mb{id} prefill` (an expert rank's event
says in its args how long it waited in the sparse layers' all-reduces); each host tick is an event
on the host track, with the host's waits for a micro-batch nested inside. Times are microseconds
since the timeline started, as the trace format wants.
"""

from __future__ import annotations

import json
from pathlib import Path

from graphrt.profiling.timeline import Slice, Timeline

PID = 1
HOST_TID = 0  # the host scheduler's track; the stages' tracks follow, numbered from 1


def lanes(timeline: Timeline, num_stages: int) -> dict[tuple[int, int], str]:
    """(stage, expert rank) -> track name, stage-major: a track per stage, under --ep one per rank."""
    if not timeline.rank_slices:
        return {(stage, 0): f"stage {stage}" for stage in range(num_stages)}
    ranks = {(p.stage, p.expert_rank): p.rank for p in timeline.slices + timeline.rank_slices}
    keys = sorted({*ranks, *((stage, 0) for stage in range(num_stages))})
    return {key: f"stage {key[0]} expert rank {key[1]}" + (f" (rank {ranks[key]})" if key in ranks else "") for key in keys}


def slice_name(piece: Slice) -> str:
    if piece.kind == "decode":
        return f"mb{piece.micro_batch} decode bs{piece.bucket}"
    return f"mb{piece.micro_batch} {piece.kind}"  # prefill, or a speculative verify step


def _metadata(name: str, tid: int, value, key: str = "name") -> dict:
    return {"name": name, "ph": "M", "pid": PID, "tid": tid, "ts": 0, "args": {key: value}}


def chrome_trace(timeline: Timeline, num_stages: int, title: str = "graphrt") -> dict:
    """The trace as a JSON-ready dict: {"traceEvents": [...], "displayTimeUnit": "ms"}."""
    events = [_metadata("process_name", HOST_TID, title)]
    names = lanes(timeline, num_stages)
    tids = {key: order for order, key in enumerate(names, start=1)}
    for tid, name in [(HOST_TID, "host scheduler"), *((tids[key], name) for key, name in names.items())]:
        events.append(_metadata("thread_name", tid, name))
        events.append(_metadata("thread_sort_index", tid, tid, key="sort_index"))
    for piece in sorted(timeline.slices + timeline.rank_slices, key=lambda p: (p.stage, p.expert_rank, p.start)):
        args = {
            "stage": piece.stage, "slot": piece.slot, "micro_batch": piece.micro_batch,
            "kind": piece.kind, "rows": piece.rows, "bucket": piece.bucket,
        }
        if len(names) > num_stages:
            args |= {"rank": piece.rank, "expert_rank": piece.expert_rank, "all_reduce_ms": round(piece.combine_s * 1000, 3)}
        events.append({
            "name": slice_name(piece),
            "cat": piece.kind,
            "ph": "X",
            "ts": piece.start * 1e6,
            "dur": (piece.end - piece.start) * 1e6,
            "pid": PID,
            "tid": tids[piece.stage, piece.expert_rank],
            "args": args,
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
