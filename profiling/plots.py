"""PNG pictures of a timeline (a Gantt chart) and of a depth sweep (utilization and tok/s).

matplotlib's Agg backend, so they draw on machines without a display.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from graphrt.profiling.report import RunSummary  # noqa: E402
from graphrt.profiling.timeline import Timeline  # noqa: E402

HOST_COLOR = "0.35"
HOST_WAIT_COLOR = "0.85"


ZOOM_ROUNDS = 4  # the zoomed panel shows about this many trips of every slot around the ring


def plot_timeline(timeline: Timeline, num_stages: int, path: Path, title: str, window: tuple[float, float] | None = None) -> Path:
    """A Gantt chart: one row per stage (top: stage 0) plus the host at the bottom. Decode
    micro-batches are coloured by ring slot, so a slot's walk down the stages is one colour;
    prefill is hatched; the host row is dark where the host works and light where it waits for a
    micro-batch. Top panel: the whole run, the steady-state window shaded. Bottom: a few ring
    rounds from the start of the steady state, where single slices can be told apart."""
    fig, (whole, zoom) = plt.subplots(2, 1, figsize=(12, 2.0 + 1.1 * (num_stages + 1)), dpi=110)
    _draw_gantt(whole, timeline, num_stages)
    if window is not None:
        whole.axvspan(window[0] * 1000, window[1] * 1000, color="gold", alpha=0.15, zorder=0)
    whole.set_title(title)
    _draw_gantt(zoom, timeline, num_stages)
    decode = [p for p in timeline.slices if p.kind == "decode"]
    if decode:
        round_s = len({p.slot for p in decode}) * sum(p.end - p.start for p in decode) / len(decode)
        zoom_start = window[0] if window is not None else min(p.start for p in decode)
        zoom.set_xlim(zoom_start * 1000, (zoom_start + ZOOM_ROUNDS * round_s) * 1000)
        zoom.set_title(f"zoom: about {ZOOM_ROUNDS} ring rounds" + (" from the start of the steady state" if window else ""), fontsize=9)
    colors = plt.get_cmap("tab10").colors
    legend = [Patch(facecolor=colors[k % len(colors)], label=f"slot {k}") for k in sorted({p.slot for p in timeline.slices})]
    legend += [
        Patch(facecolor="white", edgecolor="black", hatch="///", label="prefill"),
        Patch(facecolor=HOST_COLOR, label="host works"),
        Patch(facecolor=HOST_WAIT_COLOR, label="host waits"),
    ]
    if window is not None:
        legend.append(Patch(facecolor="gold", alpha=0.3, label="steady state"))
    whole.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def _draw_gantt(ax, timeline: Timeline, num_stages: int) -> None:
    colors = plt.get_cmap("tab10").colors
    for stage in range(num_stages):
        y = num_stages - stage  # stage 0 on top, the host at 0
        for piece in (p for p in timeline.slices if p.stage == stage):
            ax.broken_barh(
                [(piece.start * 1000, (piece.end - piece.start) * 1000)], (y - 0.4, 0.8),
                facecolors=colors[piece.slot % len(colors)], edgecolor="black", linewidth=0.3,
                hatch="///" if piece.kind == "prefill" else None,
            )
    ms = lambda spans: [(start * 1000, (end - start) * 1000) for start, end in spans]  # noqa: E731
    ax.broken_barh(ms(timeline.host_ticks), (-0.4, 0.8), facecolors=HOST_COLOR, edgecolor="none")
    ax.broken_barh(ms(timeline.host_waits), (-0.4, 0.8), facecolors=HOST_WAIT_COLOR, edgecolor="none")
    ax.set_yticks(range(num_stages, -1, -1), [f"stage {s}" for s in range(num_stages)] + ["host"])
    ax.set_ylim(-0.7, num_stages + 0.7)
    ax.set_xlabel("time since the timeline started (ms)")
    ax.grid(axis="x", alpha=0.3)


def plot_depth_sweep(summaries: list[RunSummary], path: Path, title: str) -> Path:
    """Left: each stage's busy % against depth. Right: output tok/s against depth."""
    depths = [s.depth for s in summaries]
    fig, (busy_ax, rate_ax) = plt.subplots(1, 2, figsize=(11, 4), dpi=110)
    for stage in range(summaries[0].pp):
        busy_ax.plot(depths, [100 * s.stages[stage].busy for s in summaries], marker="o", label=f"stage {stage}")
    busy_ax.set_ylim(0, 105)
    busy_ax.set_xlabel("depth (ring slots = pp + depth)")
    busy_ax.set_ylabel("busy % (steady state)")
    busy_ax.legend(fontsize=8)
    rate_ax.plot(depths, [s.tokens_per_s for s in summaries], marker="o", color="black")
    rate_ax.set_ylim(bottom=0)
    rate_ax.set_xlabel("depth (ring slots = pp + depth)")
    rate_ax.set_ylabel("output tok/s (steady state)")
    for ax in (busy_ax, rate_ax):
        ax.set_xticks(depths)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)
