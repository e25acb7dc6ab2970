"""`graphrt profile`: the report adds up from its trace; trace and PNGs are sound."""

from __future__ import annotations

import json
import statistics
import time

import pytest
import torch
from click.testing import CliRunner

from graphrt.cli import main
from graphrt.profiling.timeline import Timeline
from graphrt.profiling.trace import chrome_trace
from graphrt.tools.profile import ProfileOptions, run_profile

STAGE_MS, HOST_MS, PP = 20.0, 10.0, 4


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """pp=4 synthetic stages of 20 ms, 10 ms of host time per micro-batch, at depth 0 and 1, with the
    host in the loop (no async scheduling), so depth has something to hide."""
    out = tmp_path_factory.mktemp("profile")
    options = ProfileOptions(
        engine_kwargs=dict(pp=PP, buckets=[1, 2, 4], async_scheduling=False), depths=[0, 1], sweep=True, out=out,
        num_requests=8, input_range=(4, 8), output_range=(20, 20), synthetic_ms=STAGE_MS, host_ms=HOST_MS,
    )
    lines = []
    return run_profile(options, echo=lines.append), out, lines


def test_the_report_adds_up_from_the_trace(sweep):
    """Busy shares, bubbles and median stage times are what the written trace says over the named
    window. (How close they come to the pipeline formula depends on the machine's load:
    benchmarks/ring_utilization.py measures that.)"""
    summaries, out, _ = sweep
    for summary in summaries:
        trace = json.loads((out / f"trace-depth{summary.depth}.json").read_text())
        slices = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] >= 1]
        lo, hi = (t * 1e6 for t in summary.window)
        for use in summary.stages:
            track = [e for e in slices if e["args"]["stage"] == use.stage]
            busy = sum(max(0.0, min(e["ts"] + e["dur"], hi) - max(e["ts"], lo)) for e in track) / (hi - lo)
            assert use.busy == pytest.approx(busy, abs=1e-6)
            assert use.bubble == pytest.approx(1 - busy, abs=1e-6)
            for bucket, count in use.decode_counts.items():
                durations = [e["dur"] / 1000 for e in track if e["args"]["kind"] == "decode" and e["args"]["bucket"] == bucket]
                assert len(durations) == count
                assert use.decode_ms[bucket] == pytest.approx(statistics.median(durations), rel=1e-6)
                assert use.decode_ms[bucket] >= STAGE_MS * 0.95  # a sleep never ends early
        last = [e for e in slices if e["args"]["stage"] == PP - 1 and e["args"]["kind"] == "decode" and lo <= e["ts"] + e["dur"] < hi]
        assert summary.rows_per_micro_batch == pytest.approx(sum(e["args"]["rows"] for e in last) / len(last))


def test_micro_batches_in_flight_never_exceed_the_ring(sweep):
    """Without async scheduling a ring of pp + depth slots holds at most that many micro-batches,
    and the host's 10 ms per read-back shows in its ticks (load only lengthens them). At depth 0
    ticks alternate between a launch (under 1 ms) and a read-back (10 ms), so their median sits
    between the two and falls to the short kind when the window takes one more of those: the mean,
    about 5 ms with the read-back's time and under 1 ms without it, is what tells."""
    summaries, _, _ = sweep
    for summary in summaries:
        assert 0 < summary.in_flight <= PP + summary.depth
    assert summaries[0].host_ms_per_tick >= HOST_MS * 0.4


def test_a_sweep_writes_every_file_and_a_report_that_names_its_window(sweep):
    summaries, out, lines = sweep
    names = {p.name for p in out.iterdir()}
    assert names == {"report.md", "depth.png", "trace-depth0.json", "trace-depth1.json", "timeline-depth0.png", "timeline-depth1.png"}
    for png in ("depth.png", "timeline-depth0.png", "timeline-depth1.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (out / "report.md").read_text()
    assert "middle 50% of the decode span" in report
    assert "| depth | ring slots | stage 0 busy" in report and "| in flight | rows per micro-batch | output tok/s |" in report
    row0 = next(line for line in report.splitlines() if line.startswith("| 0 | 4 |"))
    assert f"{100 * summaries[0].stages[0].busy:.1f}%" in row0 and f"| {summaries[0].rows_per_micro_batch:.1f} |" in row0
    assert lines[0] == "[graphrt] depth 0: starting the engine, then 8 requests" and "depth 0: stage busy" in lines[1]
    assert "depth 1: stage busy" in lines[3] and lines[4] == f"[graphrt] wrote {out / 'report.md'}" and len(lines) == 5


def test_the_trace_is_chrome_json_with_one_track_per_stage_and_no_overlap(sweep):
    _, out, _ = sweep
    trace = json.loads((out / "trace-depth1.json").read_text())
    events = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {0: "host scheduler", 1: "stage 0", 2: "stage 1", 3: "stage 2", 4: "stage 3"}
    slices = [e for e in events if e["ph"] == "X"]
    assert all({"name", "ph", "ts", "dur", "pid", "tid"} <= e.keys() for e in slices)
    for tid in range(1, PP + 1):
        track = sorted((e for e in slices if e["tid"] == tid), key=lambda e: e["ts"])
        assert len(track) >= 20
        assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-3 for a, b in zip(track, track[1:]))  # never overlap
        decode = [e for e in track if e["args"]["kind"] == "decode"]
        assert all(e["name"] == f"mb{e['args']['micro_batch']} decode bs{e['args']['bucket']}" for e in decode)
        durations = sorted(e["dur"] for e in decode)  # microseconds
        assert durations[0] >= STAGE_MS * 1000 * 0.95  # a sleep never ends early
    assert any(e["name"].endswith(" prefill") for e in slices)
    assert sum(e["name"] == "scheduler tick" for e in slices if e["tid"] == 0) >= 20


def test_the_command_writes_trace_report_and_timeline(tmp_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(main, [
        "profile", "--synthetic", "1", "--pp", "2", "--depth", "1", "--requests", "2", "--output-len", "4", "--out", str(out),
    ])
    assert result.exit_code == 0, result.output
    assert {p.name for p in out.iterdir()} == {"report.md", "trace.json", "timeline.png"}
    assert "pp=2, depth=1 (ring of 3 slots)" in (out / "report.md").read_text()


def test_a_mixture_of_experts_reports_how_evenly_its_experts_were_loaded(tiny_model_factory, tmp_path):
    """Two requests of 4 prompt tokens and 4 output tokens feed 7 tokens each through every sparse
    layer, each reaching top-k experts: the report counts them all, busiest and idlest named."""
    from graphrt.model.config import ModelConfig

    model = tiny_model_factory("mixtral")
    moe_cfg = ModelConfig.from_dir(model)
    routed = 2 * (4 + 3) * moe_cfg.moe.num_experts_per_tok * sum(map(moe_cfg.moe.is_sparse, range(moe_cfg.num_layers)))
    options = ProfileOptions(engine_kwargs=dict(model=model, dtype="float32"), depths=[0], sweep=False, out=tmp_path,
                             num_requests=2, input_range=(4, 4), output_range=(4, 4))
    lines = []
    run_profile(options, echo=lines.append)
    [line] = [line for line in lines if "experts (a token once per sparse layer and choice)" in line]
    assert line.startswith(f"[graphrt]   stage 0: {routed} tokens to {moe_cfg.moe.num_experts} experts") and "busiest expert" in line
    assert "## Experts (the last run)" in (tmp_path / "report.md").read_text()


def test_a_reused_out_folder_keeps_no_file_of_the_earlier_profile(tmp_path):
    """A single run after a sweep left the sweep's per-depth traces and depth.png beside its own."""
    out = tmp_path / "run"
    quick = ["profile", "--synthetic", "1", "--pp", "2", "--requests", "2", "--output-len", "4", "--out", str(out)]
    assert CliRunner().invoke(main, [*quick, "--sweep-depth", "0,1"]).exit_code == 0
    (out / "notes.md").write_text("mine")
    result = CliRunner().invoke(main, [*quick, "--depth", "1"])
    assert result.exit_code == 0, result.output
    assert {p.name for p in out.iterdir()} == {"report.md", "trace.json", "timeline.png", "notes.md"}
    assert (f"removed 6 files of an earlier profile from {out}: depth.png, report.md, timeline-depth0.png, "
            "timeline-depth1.png, trace-depth0.json, trace-depth1.json") in result.output


def test_a_folder_whose_report_md_no_profile_wrote_is_refused_not_emptied(tmp_path):
    """`--out .` in a project, or a notes folder: its own report.md and trace.json stay."""
    (tmp_path / "report.md").write_text("# Quarterly report\n")
    (tmp_path / "trace.json").write_text("{}")
    result = CliRunner().invoke(main, ["profile", "--synthetic", "1", "--requests", "2", "--output-len", "4", "--out", str(tmp_path)])
    assert result.exit_code == 1 and f"{tmp_path} holds report.md, trace.json, which a profile would overwrite" in result.output
    assert (tmp_path / "report.md").read_text() == "# Quarterly report\n" and (tmp_path / "trace.json").read_text() == "{}"


def test_an_interrupted_sweep_keeps_a_report_of_the_depths_it_finished(tmp_path):
    """Ctrl+C as the second depth starts: the first depth's trace, timeline and report stay."""
    options = ProfileOptions(
        engine_kwargs=dict(pp=2), depths=[0, 1], sweep=True, out=tmp_path, num_requests=2, input_range=(4, 4),
        output_range=(4, 4), synthetic_ms=1.0,
    )
    lines = []

    def echo(line):
        lines.append(line)
        if line.startswith("[graphrt] depth 1: starting"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_profile(options, echo=echo)
    assert {p.name for p in tmp_path.iterdir()} == {"report.md", "trace-depth0.json", "timeline-depth0.png"}
    report = (tmp_path / "report.md").read_text()
    assert "## pp=2, depth=0" in report and "depth=1" not in report and "Interrupted: this report covers depth 0 only." in report
    assert lines[-1] == f"[graphrt] interrupted; wrote {tmp_path / 'report.md'} for depth 0"


@pytest.mark.parametrize("args, message", [
    (["--synthetic", "1", "--model", "x"], "give --model DIR or --synthetic MS, not both"),
    (["--synthetic", "1", "--depth", "1", "--sweep-depth", "0,1"], "give --depth D or --sweep-depth"),
    (["--synthetic", "1", "--sweep-depth", "0,x"], "expected comma-separated depths"),
    (["--synthetic", "1", "--output-len", "1"], "--output-len must be at least 2"),
    (["--synthetic", "1", "--pp", "2", "--procs", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'],
     "cannot tell the workers' verify steps from decode steps yet; drop --procs or --speculative-config"),
])
def test_bad_options_are_one_line(tmp_path, args, message):
    result = CliRunner().invoke(main, ["profile", *args, "--out", str(tmp_path)])
    assert result.exit_code != 0
    assert message in result.output


def test_an_out_path_that_is_a_file_is_one_line(tmp_path):
    blocker = tmp_path / "taken"
    blocker.write_text("not a folder")
    result = CliRunner().invoke(main, ["profile", "--synthetic", "1", "--out", str(blocker)])
    assert result.exit_code == 1
    assert "cannot write the profile to" in result.output and "choose a writable --out folder" in result.output
    assert "Traceback" not in result.output


def test_a_workers_slices_join_rank_zeros_timeline_on_its_clock():
    """With --procs each worker keeps a timeline and rank 0 adds its slices (Timeline.add_remote):
    times move by the two origins' wall-clock difference, a stage's leader's slices join the stage's
    track and its other expert ranks' get tracks of their own."""
    cpu = torch.device("cpu")
    engine_side = Timeline([cpu])
    time.sleep(0.01)
    worker_side = Timeline([cpu])  # started 10 ms later
    for expert_rank in (0, 1):
        started = worker_side.begin(cpu)
        time.sleep(0.002)
        worker_side.end(cpu, started, stage=1, slot=0, micro_batch=7, kind="decode", rows=2, bucket=2,
                        rank=2 + expert_rank, expert_rank=expert_rank, combine_s=0.001)
    engine_side.add_remote(worker_side.wall_slices())
    shift = worker_side.origin_wall - engine_side.origin_wall
    assert shift >= 0.009
    (leader,), (other,) = engine_side.slices, engine_side.rank_slices
    assert (leader.expert_rank, other.expert_rank, other.rank) == (0, 1, 3)
    assert leader.start == pytest.approx(worker_side.slices[0].start + shift, abs=1e-6)
    assert other.end - other.start == pytest.approx(worker_side.slices[1].end - worker_side.slices[1].start, abs=1e-6)
    trace = chrome_trace(engine_side, num_stages=2)["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in trace if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {0: "host scheduler", 1: "stage 0 expert rank 0", 2: "stage 1 expert rank 0 (rank 2)", 3: "stage 1 expert rank 1 (rank 3)"}
    (on_rank_3,) = [e for e in trace if e["ph"] == "X" and e["tid"] == 3]
    assert on_rank_3["args"]["all_reduce_ms"] == 1.0 and on_rank_3["name"] == "mb7 decode bs2"
    # without expert ranks, a track per stage as before
    engine_side.rank_slices.clear()
    names = {e["tid"]: e["args"]["name"] for e in chrome_trace(engine_side, 2)["traceEvents"] if e["name"] == "thread_name"}
    assert names == {0: "host scheduler", 1: "stage 0", 2: "stage 1"}
