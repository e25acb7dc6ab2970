"""`graphrt profile`: run a workload with the timeline on, at one ring depth or several, and write
trace JSON, timeline PNGs, report.md and (for a sweep) depth.png into one folder."""

from __future__ import annotations

import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from graphrt.distributed.transport import STATS_INTERVAL_S
from graphrt.errors import GraphrtError
from graphrt.frontend.output_processor import OutputProcessor
from graphrt.llm import LLM
from graphrt.profiling.plots import plot_depth_sweep, plot_timeline
from graphrt.profiling.report import REPORT_HEADING, RunSummary, render_report, summarize
from graphrt.profiling.trace import write_trace
from graphrt.sampling_params import SamplingParams
from graphrt.tools.bench import make_workload
from graphrt.tools.synthetic import make_synthetic, make_tiny_model

SYNTHETIC_VARIANT = "llama-gqa-tied"


@dataclass(frozen=True)
class ProfileOptions:
    engine_kwargs: dict  # LLM(...) keyword arguments, depth aside
    depths: list[int]
    sweep: bool  # several depths: files are suffixed -depth{d} and depth.png is drawn
    out: Path
    num_requests: int = 16
    input_range: tuple[int, int] = (8, 32)
    output_range: tuple[int, int] = (32, 32)
    synthetic_ms: float | None = None  # each stage takes this long, on a tiny random model
    host_ms: float = 0.0  # host time per micro-batch read back
    seed: int = 0
    command: str = "graphrt profile"

    def __post_init__(self) -> None:
        if not self.depths or min(self.depths) < 0:
            raise ValueError(f"depths must be non-negative integers, got {self.depths}")
        if self.synthetic_ms is not None and self.synthetic_ms < 0:
            raise ValueError(f"--synthetic takes a stage time in ms >= 0, got {self.synthetic_ms}")
        if self.host_ms < 0:
            raise ValueError(f"--host-ms must be >= 0, got {self.host_ms}")
        if self.output_range[0] < 2:
            raise ValueError("--output-len must be at least 2, or there is no decode to profile")
        if self.engine_kwargs.get("procs") and self.engine_kwargs.get("speculative_config") is not None:
            # a worker receives a verify step as a decode step, its drafts as rows: its slices would misreport both
            raise ValueError("graphrt profile cannot tell the workers' verify steps from decode steps yet; drop --procs or --speculative-config")


def profile_once(options: ProfileOptions, depth: int, model_dir: Path | None) -> tuple[RunSummary, list[str], list[str]]:
    """One engine at one depth, run to completion; writes its trace and timeline PNG. Returns the
    summary, the files written and, under --ep, a line per expert rank."""
    kwargs = {**options.engine_kwargs, "depth": depth, "timeline": True}
    if model_dir is not None:
        kwargs["model"] = model_dir
    llm = LLM(**kwargs)
    engine = llm.engine
    try:
        if options.synthetic_ms is not None or options.host_ms:
            make_synthetic(engine, stage_ms=options.synthetic_ms or 0.0, host_ms=options.host_ms)
        workload = make_workload(
            options.num_requests, options.input_range, options.output_range, engine.model_config.vocab_size, options.seed
        )
        processor = OutputProcessor(llm.tokenizer)
        for request in workload:
            params = SamplingParams(max_tokens=request.output_len, temperature=0, ignore_eos=True)
            processor.add(engine.add_request(request.prompt, params).request_id, params)
        while engine.has_work():
            processor.process(engine.step())
        timeline = engine.timeline
        timeline.resolve()
        if engine.cluster is not None:
            time.sleep(3 * STATS_INTERVAL_S)  # a worker publishes its slices and figures, rank 0 reads them, each every STATS_INTERVAL_S
            engine.gather_rank_timelines()
        pp = engine.config.pp  # with --procs this process holds stage 0 only; the rest came from the workers
        summary = summarize(timeline, pp, depth)
        suffix = f"-depth{depth}" if options.sweep else ""
        title = f"pp={pp}, depth={depth}: {options.num_requests} requests" + (
            f", synthetic {options.synthetic_ms:g} ms stages" if options.synthetic_ms is not None else ""
        ) + (f", host {options.host_ms:g} ms per micro-batch" if options.host_ms else "")
        trace = write_trace(timeline, pp, options.out / f"trace{suffix}.json", title=title)
        picture = plot_timeline(timeline, pp, options.out / f"timeline{suffix}.png", title, window=summary.window)
        return summary, [trace.name, picture.name], expert_load_lines(engine) + expert_expert_lines(engine)
    finally:
        engine.close()


def expert_load_lines(engine) -> list[str]:
    """For a mixture of experts, a line per sparse stage: how evenly its layers' routing spread the
    tokens over the experts (what /metrics' graphrt_moe_expert_tokens_total counts); expert
    parallelism waits on the busiest expert's rank."""
    lines = []
    for stage, counts in enumerate(engine.ring.stage_expert_tokens):
        if not counts or not sum(counts):
            continue
        mean = sum(counts) / len(counts)
        busiest, idlest = max(range(len(counts)), key=counts.__getitem__), min(range(len(counts)), key=counts.__getitem__)
        lines.append(
            f"stage {stage}: {sum(counts)} tokens to {len(counts)} experts (a token once per sparse layer and choice); "
            f"busiest expert {busiest}: {counts[busiest]} ({counts[busiest] / mean:.2f}x the mean), "
            f"idlest expert {idlest}: {counts[idlest]} ({counts[idlest] / mean:.2f}x)"
        )
    return lines


def expert_expert_lines(engine) -> list[str]:
    """Under --ep, each rank's busy time, its share in the sparse layers' all-reduces and the tokens
    its experts served, as the workers last published them (profile_once waits for that)."""
    if engine.config.ep == 1:
        return []
    lines = []
    for stage, expert_rank, stats in engine.expert_rank_stats():
        share = stats.combine_s / stats.busy_s if stats.busy_s else 0.0
        lines.append(
            f"stage {stage} expert rank {expert_rank}: busy {stats.busy_s:.2f} s, {stats.combine_s:.2f} s ({share:.0%}) in the "
            f"experts' all-reduces, {stats.expert_tokens} tokens to its experts"
        )
    return lines


# What a profile writes into --out; clear_earlier_profile removes these names only.
PROFILE_FILES = re.compile(r"(trace|timeline)(-depth\d+)?\.(json|png)|depth\.png|report\.md")


def run_profile(options: ProfileOptions, echo: Callable[[str], None] = print) -> list[RunSummary]:
    options.out.mkdir(parents=True, exist_ok=True)
    earlier = clear_earlier_profile(options.out)
    if earlier:
        files = f"{len(earlier)} file{'s' if len(earlier) != 1 else ''}"
        echo(f"[graphrt] removed {files} of an earlier profile from {options.out}: {', '.join(earlier)}")
    summaries, files, expert_lines = [], [], []
    try:
        with tempfile.TemporaryDirectory(prefix="graphrt-synthetic-") as tmp:
            model_dir = None
            if options.synthetic_ms is not None:
                # One layer per stage, so each stage's own compute is small beside its known sleep.
                model_dir = make_tiny_model(Path(tmp) / "tiny", SYNTHETIC_VARIANT, num_layers=options.engine_kwargs.get("pp") or 1)
            for depth in options.depths:
                requests = f"{options.num_requests} request{'s' if options.num_requests != 1 else ''}"
                echo(f"[graphrt] depth {depth}: starting the engine, then {requests}")
                summary, names, expert_lines = profile_once(options, depth, model_dir)
                busy = ", ".join(f"{100 * s.busy:.0f}%" for s in summary.stages)
                echo(f"[graphrt] depth {depth}: stage busy {busy}; {summary.tokens_per_s:.1f} tok/s; wrote {', '.join(names)}")
                for line in expert_lines:
                    echo(f"[graphrt]   {line}")
                summaries.append(summary)
                files.append(names)
    except KeyboardInterrupt:
        if summaries:  # what finished stays readable
            done = ", ".join(str(s.depth) for s in summaries)
            report = write_report(options, summaries, files, expert_lines, f"Interrupted: this report covers depth {done} only.")
            echo(f"[graphrt] interrupted; wrote {report} for depth {done}")
        raise
    if options.sweep:
        plot_depth_sweep(summaries, options.out / "depth.png", f"pp={summaries[0].pp}: utilization and throughput against ring depth")
        files[0] = files[0] + ["depth.png"]
    report = write_report(options, summaries, files, expert_lines)
    echo(f"[graphrt] wrote {report}")
    return summaries


def clear_earlier_profile(out: Path) -> list[str]:
    """Remove the files an earlier profile wrote to `out`: left beside a new run's (a sweep's
    per-depth files after a single run, a report from another model), nothing would say which run
    they came from. Only where the folder's report.md is a profile's: a folder holding files of
    those names that no profile wrote (`--out .`, someone's notes) is refused, not emptied."""
    earlier = sorted(p.name for p in out.iterdir() if p.is_file() and PROFILE_FILES.fullmatch(p.name))
    if not earlier:
        return []
    report = out / "report.md"
    if not (report.is_file() and report.read_text(errors="replace").split("\n", 1)[0] == REPORT_HEADING):
        raise GraphrtError(
            f"{out} holds {', '.join(earlier)}, which a profile would overwrite, and no profile's report.md; "
            "choose another --out folder (or remove them)"
        )
    for name in earlier:
        (out / name).unlink()
    return earlier


def write_report(
    options: ProfileOptions, summaries: list[RunSummary], files: list[list[str]], expert_lines: list[str], note: str = ""
) -> Path:
    workload = (
        f"{options.num_requests} requests, prompts of {span(options.input_range)} random tokens, "
        f"{span(options.output_range)} output tokens each (greedy, EOS ignored), all submitted at once"
        + (f"; synthetic stages of {options.synthetic_ms:g} ms on a tiny random Llama, one layer per stage" if options.synthetic_ms is not None else "")
        + (f"; {options.host_ms:g} ms host time per micro-batch read back" if options.host_ms else "")
    )
    report = options.out / "report.md"
    ranks = "".join(f"\n- {line}" for line in expert_lines)
    ranks = f"\n## Experts (the last run)\n{ranks}\n" if ranks else ""
    note = f"\n{note}\n" if note else ""
    report.write_text(render_report(summaries, files, options.command, workload) + ranks + note)
    return report


def span(bounds: tuple[int, int]) -> str:
    """`4` for (4, 4), `4-16` for (4, 16)."""
    return str(bounds[0]) if bounds[0] == bounds[1] else f"{bounds[0]}-{bounds[1]}"
