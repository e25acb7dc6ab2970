"""Per-stage utilization from a timeline, and report.md for one run or a depth sweep.

Busy and bubble shares, throughput and micro-batches in flight are measured over the steady-state
window: the middle 50% of the decode span (first decode slice start to last decode slice end), so
the ring filling up at the start and draining at the end don't count. Stage times use every slice
of the run: decode and verify times are medians per bucket, so the first replays (which warm caches
and, on CPUs, may still be timing kernels) do not pull them; prefill times are means, their chunks
being of every length.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from dataclasses import dataclass
from statistics import mean, median

from graphrt.profiling.timeline import Timeline

STEADY_SHARE = 0.5  # the middle half of the decode span
REPORT_HEADING = "# graphrt profile"  # report.md's first line: what marks a folder as a profile's


@dataclass(frozen=True)
class StageUse:
    stage: int
    busy: float  # share of the steady-state window
    decode_ms: dict[int, float]  # bucket -> median stage time
    decode_counts: dict[int, int]
    prefill_ms: float | None
    num_prefill: int
    verify_ms: float | None = None  # speculative decoding's verify micro-batches (decode graphs, a row per token)
    num_verify: int = 0

    @property
    def bubble(self) -> float:
        return 1.0 - self.busy


@dataclass(frozen=True)
class RunSummary:
    pp: int
    depth: int
    window: tuple[float, float]
    stages: list[StageUse]
    in_flight: float  # mean micro-batches on the device during the window
    tokens_per_s: float  # decode tokens sampled per second during the window
    host_ms_per_tick: float  # mean, waits for micro-batches left out
    host_ms_per_tick_median: float
    num_ticks: int
    host_busy: float  # share of the window the host spent in ticks, not waiting
    rows_per_micro_batch: float  # mean decode rows of the micro-batches the last stage finished in the window

    @property
    def min_busy(self) -> float:
        return min(s.busy for s in self.stages)


def steady_window(timeline: Timeline) -> tuple[float, float]:
    decode = [s for s in timeline.slices if s.kind == "decode"]
    if not decode:
        raise ValueError("the timeline holds no decode micro-batches; give requests at least 2 output tokens")
    start, end = min(s.start for s in decode), max(s.end for s in decode)
    cut = (1 - STEADY_SHARE) / 2 * (end - start)
    return start + cut, end - cut


def _overlap(start: float, end: float, window: tuple[float, float]) -> float:
    return max(0.0, min(end, window[1]) - max(start, window[0]))


def mean_in_flight(timeline: Timeline, window: tuple[float, float]) -> float:
    """Time-average of how many micro-batches are between their first stage's start and their last
    stage's end, over the window."""
    spans: dict[int, list[float]] = {}
    for piece in timeline.slices:
        span = spans.setdefault(piece.micro_batch, [piece.start, piece.end])
        span[0], span[1] = min(span[0], piece.start), max(span[1], piece.end)
    return sum(_overlap(start, end, window) for start, end in spans.values()) / (window[1] - window[0])


def host_work_per_tick(timeline: Timeline, window: tuple[float, float]) -> list[float]:
    """Seconds of each tick that starts in the window, less the waits for micro-batches inside it."""
    waits = sorted(timeline.host_waits)
    starts = [start for start, _ in waits]
    work = []
    for start, end in timeline.host_ticks:
        if not window[0] <= start < window[1]:
            continue
        waited, k = 0.0, bisect_left(starts, start)
        while k < len(waits) and waits[k][0] < end:
            waited += _overlap(*waits[k], (start, end))
            k += 1
        work.append(end - start - waited)
    return work


def host_busy_fraction(timeline: Timeline, window: tuple[float, float]) -> float:
    ticks = sum(_overlap(start, end, window) for start, end in timeline.host_ticks)
    waits = sum(_overlap(start, end, window) for start, end in timeline.host_waits)
    return (ticks - waits) / (window[1] - window[0])


def stage_use(timeline: Timeline, stage: int, window: tuple[float, float]) -> StageUse:
    times: dict[int, list[float]] = defaultdict(list)
    prefill: list[float] = []
    verify: list[float] = []
    for piece in timeline.slices:
        if piece.stage != stage:
            continue
        ms = (piece.end - piece.start) * 1000
        if piece.kind == "decode":
            times[piece.bucket].append(ms)
        elif piece.kind == "verify":
            verify.append(ms)
        else:
            prefill.append(ms)
    return StageUse(
        stage=stage,
        busy=timeline.busy_fraction(stage, window),
        decode_ms={bucket: median(values) for bucket, values in sorted(times.items())},
        decode_counts={bucket: len(values) for bucket, values in sorted(times.items())},
        prefill_ms=mean(prefill) if prefill else None,
        num_prefill=len(prefill),
        verify_ms=median(verify) if verify else None,
        num_verify=len(verify),
    )


def summarize(timeline: Timeline, pp: int, depth: int) -> RunSummary:
    window = steady_window(timeline)
    last = pp - 1
    # A decode micro-batch yields one token per row when its last stage finishes.
    finished = [s for s in timeline.slices if s.stage == last and s.kind == "decode" and window[0] <= s.end < window[1]]
    tokens = sum(s.rows for s in finished)
    ticks = [seconds * 1000 for seconds in host_work_per_tick(timeline, window)] or [0.0]
    return RunSummary(
        pp=pp,
        depth=depth,
        window=window,
        stages=[stage_use(timeline, s, window) for s in range(pp)],
        in_flight=mean_in_flight(timeline, window),
        tokens_per_s=tokens / (window[1] - window[0]),
        host_ms_per_tick=mean(ticks),
        host_ms_per_tick_median=median(ticks),
        num_ticks=len(ticks),
        host_busy=host_busy_fraction(timeline, window),
        rows_per_micro_batch=tokens / len(finished) if finished else 0.0,
    )


def _pct(share: float) -> str:
    return f"{100 * share:.1f}%"


def stage_table(summary: RunSummary) -> list[str]:
    buckets = sorted({b for s in summary.stages for b in s.decode_ms})
    verifies = any(s.num_verify for s in summary.stages)
    header = ["stage", "busy", "bubble"] + [f"decode bs{b} (ms)" for b in buckets] + ["prefill (ms)"] + ["verify (ms)"] * verifies
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for use in summary.stages:
        cells = [str(use.stage), _pct(use.busy), _pct(use.bubble)]
        cells += [f"{use.decode_ms[b]:.2f} (x{use.decode_counts[b]})" if b in use.decode_ms else "-" for b in buckets]
        cells.append(f"{use.prefill_ms:.2f} (x{use.num_prefill})" if use.prefill_ms is not None else "-")
        if verifies:
            cells.append(f"{use.verify_ms:.2f} (x{use.num_verify})" if use.verify_ms is not None else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def run_section(summary: RunSummary, files: list[str]) -> list[str]:
    lo, hi = summary.window
    return [
        f"## pp={summary.pp}, depth={summary.depth} (ring of {summary.pp + summary.depth} slot{'s' if summary.pp + summary.depth != 1 else ''})",
        "",
        f"Steady-state window: {lo:.3f} s to {hi:.3f} s after the timeline started ({(hi - lo) * 1000:.0f} ms), "
        "the middle 50% of the decode span.",
        "",
        *stage_table(summary),
        "",
        f"- micro-batches in flight (mean over the window, each from its first stage start to its last stage end): {summary.in_flight:.2f}",
        f"- output tokens/s (decode, over the window): {summary.tokens_per_s:.1f}, from micro-batches of "
        f"{summary.rows_per_micro_batch:.1f} rows on average (the rows in flight split over the ring's slots)",
        f"- host time per scheduler tick: mean {summary.host_ms_per_tick:.3f} ms, median "
        f"{summary.host_ms_per_tick_median:.3f} ms over {summary.num_ticks} ticks in the window (waits for the "
        f"oldest micro-batch left out); host busy {_pct(summary.host_busy)} of the window",
        f"- files: {', '.join(files)}",
        "",
    ]


def depth_table(summaries: list[RunSummary]) -> list[str]:
    pp = summaries[0].pp
    header = ["depth", "ring slots"] + [f"stage {s} busy" for s in range(pp)] + [
        "min busy", "host busy", "in flight", "rows per micro-batch", "output tok/s"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for run in summaries:
        cells = [str(run.depth), str(run.pp + run.depth)] + [_pct(s.busy) for s in run.stages]
        cells += [_pct(run.min_busy), _pct(run.host_busy), f"{run.in_flight:.2f}", f"{run.rows_per_micro_batch:.1f}", f"{run.tokens_per_s:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    rows = [run.rows_per_micro_batch for run in summaries]
    if rows[-1] < rows[0] * 0.9:
        lines += ["", "More slots split the same rows into smaller micro-batches: where a step costs about the same "
                  "at any size, tokens/s falls with depth as busy rises (docs/profiling.md, \"What the depth sweep shows\")."]
    return lines


def render_report(summaries: list[RunSummary], files: list[list[str]], command: str, workload: str) -> str:
    """report.md: the depth table (for a sweep), then one section per run."""
    lines = [
        REPORT_HEADING,
        "",
        f"- command: `{command}`",
        f"- workload: {workload}",
        "- busy: share of the steady-state window (the middle 50% of the decode span) in which the stage "
        "was running a micro-batch; bubble = 100% - busy. Decode and verify stage times are medians over every "
        "slice of the run, prefill times means.",
        "",
    ]
    if len(summaries) > 1:
        lines += ["## Utilization against ring depth", "", *depth_table(summaries), ""]
    for summary, names in zip(summaries, files):
        lines += run_section(summary, names)
    return "\n".join(lines)
