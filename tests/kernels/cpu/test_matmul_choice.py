"""CPU matmul paths chosen by measurement (graphrt/kernels/cpu/matmul_choice.py).

Which path wins is this machine's business, so no test asserts a winner: they assert that the
timing logic picks what a controlled clock says, that every path computes what F.linear does, that
the weights are in the form chosen, and that the choice is reported, forced and cached."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from graphrt import LLM
from graphrt.capture.manifest import StaleCacheError, cached_matmul_plans, read_manifest, write_manifest
from graphrt.cli import build_manifest
from graphrt.kernels.cpu.forcing import ForcedModes
from graphrt.kernels.cpu.linear import can_pack, dense_weight, linear, weight_form
from graphrt.kernels.cpu.matmul_choice import (
    SHAPE_NAMES,
    MatmulChoice,
    MatmulPlan,
    available_paths,
    choose_path,
    far_behind,
    median_seconds,
    mode_from_env,
    pick_path,
    summarize,
)
from graphrt.tools.doctor import run_doctor
from helpers import prompt_logits

needs_onednn = pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.float32), reason="this torch has no oneDNN")
SHAPES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")


class Clock:
    """A clock the test moves: a run advances it by the seconds the test says its calls take."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def run_taking(self, rounds: list[list[float]], calls: list[str], name: str):
        """A run whose calls take rounds[0] (a list of seconds), then rounds[1], ...; logs its
        name. Like a real sweep it makes one call at least and none after the limit."""
        rounds = list(rounds)

        def run(stop_at: float) -> list[float]:
            calls.append(name)
            seconds = []
            for call in rounds.pop(0):
                self.now += call
                seconds.append(call)
                if self.now >= stop_at:
                    break
            return seconds

        return run


def test_runs_interleave_round_by_round_and_keep_their_median_call():
    clock, calls = Clock(), []
    runs = {
        # Two calls of ten stalled by another process: the median call is a clean one (the median
        # sweep, 10 or 2, would not be).
        "dense": clock.run_taking([[1.0, 9.0], [1.0, 1.0], [1.0, 9.0], [1.0, 1.0], [1.0, 1.0]], calls, "dense"),
        "packed": clock.run_taking([[2.0, 2.0]] * 5, calls, "packed"),
    }
    seconds = median_seconds(runs, clock, min_samples=10, max_rounds=5, budget_s=0.0, limit_s=100.0)
    assert seconds == {"dense": 1.0, "packed": 2.0}
    assert calls == ["dense", "packed"] * 5


def test_timing_stops_once_the_budget_is_spent_and_each_run_has_its_samples():
    clock, calls = Clock(), []
    runs = {key: clock.run_taking([[0.01] * 2] * 9, calls, key) for key in ("dense", "packed")}
    median_seconds(runs, clock, min_samples=5, max_rounds=9, budget_s=0.01, limit_s=10.0)
    assert len(calls) == 2 * 3  # the budget went in round 1; 5 calls each took 3 rounds
    clock, calls = Clock(), []
    runs = {key: clock.run_taking([[0.001] * 2] * 9, calls, key) for key in ("dense", "packed")}
    median_seconds(runs, clock, min_samples=5, max_rounds=9, budget_s=0.5, limit_s=10.0)
    assert len(calls) == 2 * 9  # never spent: stops at the maximum


def test_a_busy_machine_gets_fewer_samples_not_a_slower_start():
    clock, calls = Clock(), []
    runs = {key: clock.run_taking([[0.2] * 30] * 5, calls, key) for key in ("dense", "packed")}
    seconds = median_seconds(runs, clock, min_samples=5, max_rounds=5, budget_s=0.1, limit_s=0.3)
    assert calls == ["dense", "packed"]  # one round: each sweep stopped at the limit after its first calls
    assert clock.now <= 0.3 + 0.2 + 0.2  # the limit, plus the call in flight and the other run's one call
    assert seconds == {"dense": 0.2, "packed": 0.2}


def test_a_path_far_behind_after_a_round_is_not_timed_again():
    clock, calls = Clock(), []
    runs = {
        ("dense", 1): clock.run_taking([[3.0]] * 5, calls, "dense"),
        ("panel", 1): clock.run_taking([[1.0]] * 5, calls, "panel"),
        ("packed", 1): clock.run_taking([[1.9]] * 5, calls, "packed"),
    }
    seconds = median_seconds(runs, clock, min_samples=3, max_rounds=5, budget_s=0.0, limit_s=100.0, losing=far_behind)
    assert calls == ["dense", "panel", "packed"] + ["panel", "packed"] * 2  # dense, 3x behind, ran once
    assert seconds == {("dense", 1): 3.0, ("panel", 1): 1.0, ("packed", 1): 1.9}
    # Behind at one row count only is not far behind: that path may still win on the sum.
    assert far_behind({("dense", 1): 3.0, ("dense", 32): 1.0, ("panel", 1): 1.0, ("panel", 32): 1.5}) == set()
    assert far_behind({("dense", 1): 3.0, ("dense", 32): 3.5, ("panel", 1): 1.0, ("panel", 32): 1.5}) == {("dense", 1), ("dense", 32)}


def test_a_shape_keeps_the_path_that_loses_least_over_both_row_counts():
    # packed is 2x faster at 32 rows and 1.5x slower at one row: 1.5 + 1 < 1 + 2.
    assert pick_path({"dense": {1: 1.0, 32: 10.0}, "packed": {1: 1.5, 32: 5.0}}) == "packed"
    # packed 3x slower at one row outweighs 1.5x faster at 32: 3 + 1 > 1 + 1.5.
    assert pick_path({"dense": {1: 1.0, 32: 10.0}, "packed": {1: 3.0, 32: 6.7}}) == "dense"
    # Within the margin F.linear, the reference, stays.
    assert pick_path({"dense": {1: 1.0, 32: 10.0}, "packed": {1: 0.99, 32: 9.9}}) == "dense"
    assert pick_path({"dense": {1: 1.0}, "packed": {1: 0.5}}) == "packed"
    # Panels within the margin of the fastest win (a decode step's layers then run in one call) ...
    assert pick_path({"dense": {1: 1.0, 32: 10.0}, "packed": {1: 0.5, 32: 5.0}, "panel": {1: 0.51, 32: 5.05}}) == "panel"
    # ... but not past it, nor where dense is as fast
    assert pick_path({"dense": {1: 1.0, 32: 10.0}, "packed": {1: 0.5, 32: 5.0}, "panel": {1: 0.55, 32: 5.0}}) == "packed"
    assert pick_path({"dense": {1: 1.0, 32: 10.0}, "panel": {1: 0.99, 32: 9.9}}) == "dense"


def test_forcing_a_path_comes_before_any_measurement_and_a_bad_value_is_named():
    weights = [torch.randn(64, 32) for _ in range(3)]
    choice, trial = choose_path("o_proj", weights, (1, 8), "packed", ("dense", "packed", "panel"))
    assert (choice.path, choice.source, choice.seconds, trial) == ("packed", "forced", {}, [])
    choice, _ = choose_path("o_proj", weights, (1, 8), "dense", ("dense",))
    assert (choice.path, choice.source) == ("dense", "forced")
    choice, _ = choose_path("o_proj", weights, (1, 8), "panel", ("dense", "packed"))  # no AVX-512, or no whole panels
    assert (choice.path, choice.source) == ("dense", "unavailable")
    assert summarize([MatmulPlan((choice,), (1, 8))]) == "matmuls: F.linear for o_proj (F.linear where GRAPHRT_MATMUL's path can't run here)"
    choice, _ = choose_path("o_proj", weights, (1, 8), "auto", ("dense",))  # float64, or not a CPU
    assert (choice.path, choice.source) == ("dense", "only")


def test_graphrt_matmul_forces_a_path_for_every_shape_or_by_name():
    assert mode_from_env({"GRAPHRT_MATMUL": "Panel"}) == ForcedModes("panel")
    assert mode_from_env({}) == ForcedModes("auto")
    one = mode_from_env({"GRAPHRT_MATMUL": " o_proj=panel "})
    assert [one.of(name) for name in ("o_proj", "qkv_proj", "lm_head")] == ["panel", "auto", "auto"]
    mixed = mode_from_env({"GRAPHRT_MATMUL": "o_proj=panel,packed,lm_head=dense"})
    assert [mixed.of(name) for name in ("o_proj", "qkv_proj", "lm_head")] == ["panel", "packed", "dense"]
    assert mixed.describe(SHAPE_NAMES) == "qkv_proj=packed, o_proj=panel, gate_up_proj=packed, down_proj=packed, lm_head=dense"
    with pytest.raises(ValueError, match="GRAPHRT_MATMUL must be one of auto, dense, packed, panel, or NAME=MODE entries, got 'fast'"):
        mode_from_env({"GRAPHRT_MATMUL": "fast"})
    with pytest.raises(ValueError, match="GRAPHRT_MATMUL names 'v_proj', which is not one of qkv_proj, o_proj"):
        mode_from_env({"GRAPHRT_MATMUL": "v_proj=panel"})
    with pytest.raises(ValueError, match="GRAPHRT_MATMUL: o_proj must be one of auto, dense, packed, panel, got 'fast'"):
        mode_from_env({"GRAPHRT_MATMUL": "o_proj=fast"})


@needs_onednn
def test_a_previous_choice_is_reused_for_the_same_shape_only():
    weights = [torch.randn(64, 32) for _ in range(3)]
    previous = MatmulChoice("o_proj", (64, 32), "packed", "cached")
    assert choose_path("o_proj", weights, (1, 8), "auto", ("dense", "packed"), previous)[0] == previous
    other_shape = MatmulChoice("o_proj", (32, 32), "packed", "cached")
    measured, _ = choose_path("o_proj", weights, (1, 8), "auto", ("dense", "packed"), other_shape)
    assert measured.source == "measured"
    assert set(measured.seconds) == {"dense", "packed"} and set(measured.seconds["dense"]) == {1, 8}
    # A cached path this machine can't run (a cache from an AVX-512 machine, say) is measured again.
    remeasured, _ = choose_path("o_proj", weights, (1, 8), "auto", ("dense", "packed"), MatmulChoice("o_proj", (64, 32), "panel", "cached"))
    assert remeasured.source == "measured"


def test_available_paths_look_only_for_a_forced_one():
    cpu = torch.device("cpu")
    assert available_paths(cpu, torch.float64, (64, 32)) == ("dense",)
    assert available_paths(torch.device("cuda"), torch.float32, (64, 32)) == ("dense",)
    assert available_paths(cpu, torch.float32, (64, 32), mode="dense") == ("dense",)
    assert "panel" not in available_paths(cpu, torch.float32, (64, 32), mode="packed")


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_measured_stage_holds_each_weight_in_the_form_chosen_and_computes_what_f_linear_does(tiny_model_factory, monkeypatch, dtype):
    if not can_pack(torch.device("cpu"), dtype):
        pytest.skip(f"oneDNN does not compute {dtype} here")
    monkeypatch.setenv("GRAPHRT_MATMUL", "auto")
    llm = LLM(model=tiny_model_factory("qwen2-qkv-bias"), pp=2, dtype=dtype, max_batch=8)
    generator = torch.Generator().manual_seed(0)
    for stage, plan in zip(llm.engine.pipeline.stages, llm.engine.pipeline.matmul_plans()):
        assert plan.rows == (1, 8)  # one row and the largest decode bucket
        for name, owners in stage.matmul_owners().items():
            choice = plan.by_name()[name]
            assert choice.source == "measured"
            for owner, attr in owners:
                weight = getattr(owner, attr)
                assert weight_form(weight) == choice.path, f"{name} on stage {stage.index}"
                dense = dense_weight(weight)
                x = torch.randn(3, dense.shape[1], generator=generator).to(dtype)
                tolerance = 1e-4 if dtype == torch.float32 else 2e-2
                torch.testing.assert_close(linear(x, weight), F.linear(x, dense), rtol=tolerance, atol=tolerance)
    summary = llm.engine.pipeline.matmul_summary()
    assert summary.startswith("matmuls: ") and "measured at 1 and 8 rows in" in summary
    assert all(name in summary for name in SHAPES)


@needs_onednn
def test_every_forced_path_gives_the_logits_of_the_others(tiny_model_factory, monkeypatch):
    model = tiny_model_factory("llama-gqa-tied")
    prompt = list(range(3, 40))
    logits = {}
    for mode in ("dense", "packed", "panel", "auto"):
        monkeypatch.setenv("GRAPHRT_MATMUL", mode)
        engine = LLM(model=model, pp=2, dtype="float32", kv_cache_tokens=256).engine
        if mode != "auto":
            paths = {c.name: c.path for plan in engine.pipeline.matmul_plans() for c in plan.choices}
            # A 97-token vocabulary does not cut into panels of 16: that LM head stays on F.linear.
            assert set(paths.values()) <= {mode, "dense"} and paths["qkv_proj"] == (mode if mode in available_paths(
                torch.device("cpu"), torch.float32, (128, 64)) else "dense")
            assert "GRAPHRT_MATMUL" in engine.pipeline.matmul_summary()  # forced, or unavailable here
        logits[mode] = prompt_logits(engine, prompt)
    for mode in ("packed", "panel", "auto"):
        torch.testing.assert_close(logits[mode], logits["dense"], atol=1e-4, rtol=0)


def test_a_stage_without_a_second_path_says_so(tiny_model_factory, monkeypatch):
    monkeypatch.setenv("GRAPHRT_MATMUL", "auto")
    engine = LLM(model=tiny_model_factory("llama-gqa-tied"), dtype="float64").engine
    assert engine.pipeline.matmul_summary() == (
        "matmuls: F.linear for qkv_proj, o_proj, gate_up_proj, down_proj, lm_head "
        "(F.linear is the only path for this device and dtype)"
    )


def test_the_summary_names_shapes_whose_path_differs_between_stages():
    plans = [
        MatmulPlan((MatmulChoice("o_proj", (8, 8), "packed", "measured"),), (1, 32), 0.25),
        MatmulPlan((MatmulChoice("o_proj", (8, 8), "dense", "measured"), MatmulChoice("lm_head", (9, 8), "packed", "measured")), (1, 32), 0.5),
    ]
    assert summarize(plans) == "matmuls: F.linear for o_proj@1; packed oneDNN for o_proj@0, lm_head (measured at 1 and 32 rows in 0.75 s)"


def test_a_plan_survives_the_graph_cache_as_json():
    plan = MatmulPlan((MatmulChoice("down_proj", (576, 1536), "packed", "measured", {"dense": {1: 2e-4, 32: 5e-4}, "packed": {1: 1e-4, 32: 3e-4}}),), (1, 32), 0.3)
    again = MatmulPlan.from_json(plan.to_json())
    assert again.choices[0].source == "cached"
    assert again.choices[0].seconds == plan.choices[0].seconds and again.rows == plan.rows
    with pytest.raises(StaleCacheError, match="matmul plans cannot be read"):
        cached_matmul_plans({"matmuls": [{"rows": [1], "choices": [{"name": "o_proj", "shape": [1, 2], "path": "fast"}]}]})
    assert cached_matmul_plans({}) is None  # a cache written before matmul paths were recorded


@needs_onednn
def test_a_start_with_the_graph_cache_takes_its_matmul_paths_without_measuring(tiny_model_factory, tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHRT_MATMUL", "auto")
    model = tiny_model_factory("llama-gqa-tied")
    engine = LLM(model=model, pp=2, dtype="float32", kv_cache_tokens=256).engine
    manifest = build_manifest(engine)
    # Paths no measurement would be asked for: every shape the opposite of what was measured.
    flipped = [MatmulPlan(tuple(MatmulChoice(c.name, c.shape, "dense" if c.path == "packed" else "packed", "measured") for c in plan.choices), plan.rows)
               for plan in engine.pipeline.matmul_plans()]
    manifest["matmuls"] = [plan.to_json() for plan in flipped]
    write_manifest(tmp_path, manifest)
    cached = LLM(model=model, cache=tmp_path, kv_cache_tokens=256).engine
    assert cached.pipeline.matmul_summary().endswith("(from the graph cache)")
    for stage, plan, chosen in zip(cached.pipeline.stages, flipped, cached.pipeline.matmul_plans()):
        assert chosen.measure_s == 0.0
        for choice in plan.choices:
            owner, attr = stage.matmul_owners()[choice.name][0]
            assert weight_form(getattr(owner, attr)) == choice.path
    assert "matmuls" in read_manifest(tmp_path)


def test_doctor_reports_the_cpu_and_its_matmul_paths():
    lines = []
    assert run_doctor(echo=lines.append) == 0
    text = "\n".join(lines)
    assert "--dtype auto on the CPU gives " in text
    assert "    float32: matmuls: " in text
