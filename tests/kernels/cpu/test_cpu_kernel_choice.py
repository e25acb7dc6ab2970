"""A CPU stage's kernels, op by op: the compiled kernel or the torch reference, chosen by timing both
(kernels/cpu/kernel_choice.py), forced by GRAPHRT_CPU_KERNELS, or the references where the compiled
kernels can't run; and an engine on the compiled kernels generates what the references do."""

from __future__ import annotations

import pytest
import torch

from graphrt import LLM, SamplingParams
from graphrt.kernels import argmax
from graphrt.kernels.cpu import elementwise as elementwise_cpu
from graphrt.kernels.cpu import extension as cpu_extension
from graphrt.kernels.cpu import kernel_choice as cpu_kernel_choice
from graphrt.kernels.cpu import paged_attention as paged_attention_cpu
from graphrt.kernels.cpu.kernel_choice import OPS, CpuKernelChoice, LayerShapes, choose_cpu_kernels, mode_from_env, time_paths
from graphrt.kernels.cpu.linear import can_pack, can_use_panels
from graphrt.kernels.cpu.stage_kernels import cpu_kernel_set, runs_silu_and_mul_alone
from graphrt.kernels.torch_ops import TORCH
from graphrt.runtime.pipeline import Pipeline
from graphrt.tools.synthetic import make_tiny_model

CPU = torch.device("cpu")
SHAPES = dict(
    shapes=LayerShapes(num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64, intermediate_size=96),
    block_size=16, dtype=torch.float32, device=CPU, rows=8,
)


class Clock:
    """A timer the test moves: each path's call takes the seconds it is given, in turn."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def path_taking(self, seconds: list[float], calls: list[str], name: str):
        durations = iter(seconds)

        def run(*_):
            calls.append(name)
            self.now += next(durations)

        return run


def test_paths_alternate_and_keep_their_median_call():
    clock, calls = Clock(), []
    # The warm-up call, then seven timed ones; two of the kernel's stalled by another process.
    paths = {
        "compiled": clock.path_taking([5.0, 1.0, 9.0, 1.0, 1.0, 9.0, 1.0, 1.0], calls, "compiled"),
        "torch": clock.path_taking([5.0] + [3.0] * 7, calls, "torch"),
    }
    assert time_paths(paths, (), clock) == {"compiled": 1.0, "torch": 3.0}
    assert calls == ["compiled", "torch"] * 8


def test_each_op_keeps_the_faster_path_and_a_tie_goes_to_what_a_decode_step_runs_in_one_call(monkeypatch):
    seconds = {
        "paged_decode_attention": {"compiled": 1.0, "torch": 3.0},
        "paged_prefill_attention": {"compiled": 0.97, "torch": 1.0},  # within the margin: a tie keeps the reference
        "write_kv": {"compiled": 0.1, "torch": 1.0},
        "rms_norm": {"compiled": 1.03, "torch": 1.0},  # a tie on an op of graphrt::decode_layers keeps the kernel
        "apply_rotary": {"compiled": 2.0, "torch": 1.0},  # the reference faster by more than the margin
        "silu_and_mul": {"compiled": 0.5, "torch": 1.0},
    }
    monkeypatch.setattr(cpu_extension, "unavailable_reason", lambda *_: None)
    monkeypatch.setattr(cpu_kernel_choice, "timing_inputs", lambda op, *_: (op,))
    monkeypatch.setattr(cpu_kernel_choice, "time_paths", lambda paths, inputs, timer: seconds[inputs[0]])
    choice = choose_cpu_kernels(**SHAPES)
    assert choice.paths == {"paged_decode_attention": "compiled", "paged_prefill_attention": "torch", "write_kv": "compiled",
                            "rms_norm": "compiled", "apply_rotary": "torch", "silu_and_mul": "compiled"}
    assert (choice.source, choice.seconds, choice.rows) == ("measured", seconds, 8)
    assert choice.summary().startswith(
        "CPU kernels: compiled decode attention, KV writes, rms_norm, silu_and_mul; torch prefill attention, rotary (ms per "
        "call at 8 rows, prefill attention on 4 prompts of 128 tokens, compiled vs torch: decode attention 1000.000 vs "
        "3000.000, prefill attention 970.000 vs 1000.000, KV writes 100.000 vs 1000.000, rms_norm 1030.000 vs 1000.000"
    )


@pytest.mark.usefixtures("built_cpu_kernels")
def test_every_op_is_timed_on_inputs_its_kernel_and_reference_take():
    """The real timing inputs run on both paths (a shape mistake would raise)."""
    choice = choose_cpu_kernels(**SHAPES)
    assert set(choice.seconds) == set(OPS)
    assert all(s["compiled"] > 0 and s["torch"] > 0 for s in choice.seconds.values())


def test_where_the_kernels_cannot_run_the_references_run_and_the_banner_says_why(monkeypatch):
    monkeypatch.setattr(cpu_extension, "unavailable_reason", lambda *_: "no C++ compiler: 'c++' is not on PATH")
    choice = choose_cpu_kernels(**SHAPES)
    assert (choice.source, set(choice.paths.values())) == ("only", {"torch"})
    ops = cpu_kernel_set(TORCH, choice)
    assert ops.rms_norm is TORCH.rms_norm and ops.decode_layers is None  # the one-call step needs the compiled ops
    assert "no C++ compiler" in choice.summary()
    with pytest.raises(ValueError, match="GRAPHRT_CPU_KERNELS=compiled.*no C\\+\\+ compiler"):
        choose_cpu_kernels(**SHAPES, mode="compiled")


def test_a_forced_mode_measures_nothing(monkeypatch):
    monkeypatch.setattr(cpu_kernel_choice, "time_paths", lambda *_: pytest.fail("timed a forced choice"))
    assert choose_cpu_kernels(**SHAPES, mode="torch") == CpuKernelChoice.everywhere("torch", "forced")
    with pytest.raises(ValueError, match="only a CPU stage"):
        choose_cpu_kernels(**{**SHAPES, "device": torch.device("cuda")})
    with pytest.raises(ValueError, match="GRAPHRT_CPU_KERNELS must be one of auto, torch, compiled"):
        mode_from_env({"GRAPHRT_CPU_KERNELS": "fast"})
    with pytest.raises(ValueError, match="GRAPHRT_CPU_KERNELS: decode_layers must be one of auto, off, got 'torch'"):
        mode_from_env({"GRAPHRT_CPU_KERNELS": "decode_layers=torch"})
    with pytest.raises(ValueError, match="must be one of auto, torch, compiled, got 'fast'"):
        choose_cpu_kernels(**SHAPES, mode="fast")


@pytest.mark.usefixtures("built_cpu_kernels")
def test_an_engine_on_the_compiled_kernels_generates_what_the_references_do(tiny_model_factory, monkeypatch):
    prompts = [[5, 9, 14, 2, 7] * k for k in (1, 3, 9)]  # contexts of one to several blocks
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outputs = {}
    for mode in ("torch", "compiled"):
        monkeypatch.setenv("GRAPHRT_CPU_KERNELS", mode)
        llm = LLM(model=tiny_model_factory(), pp=2, dtype="float64", kv_cache_tokens=1024, block_size=16, prefill_chunk_size=16)
        stage = llm.engine.pipeline.stages[1]
        assert set(llm.engine.pipeline.kernels[1].cpu.paths.values()) == {mode}
        expected = {"torch": cpu_kernel_choice.TORCH_OPS["rms_norm"], "compiled": elementwise_cpu.rms_norm}[mode]
        assert stage.layers[0].ops.rms_norm is expected
        attention = {"torch": TORCH.paged_decode_attention, "compiled": paged_attention_cpu.paged_decode_attention}[mode]
        assert stage.layers[0].ops.paged_decode_attention is attention
        assert stage.layers[0].ops.write_kv is {"torch": TORCH.write_kv, "compiled": paged_attention_cpu.write_kv}[mode]
        assert llm.engine.sampler.greedy_argmax is {"torch": argmax.greedy_argmax, "compiled": elementwise_cpu.greedy_argmax}[mode]
        # (followed by the team it was timed on where a neighbour was busy during the load)
        assert f"; greedy argmax: {mode} (forced by GRAPHRT_CPU_KERNELS)" in llm.engine.kernel_summary()
        prefill = stage.layers[0].ops.paged_prefill_attention  # the reference, given the chosen kernels
        assert prefill.keywords["decode_attention"] is attention
        assert prefill.keywords.get("prompt_attention") is {"torch": None, "compiled": paged_attention_cpu.prompt_attention}[mode]
        outputs[mode] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outputs["compiled"] == outputs["torch"]


def test_a_cuda_stage_keeps_its_kernel_set():
    class CudaStage:  # what choosing reads of a stage; a real one needs a GPU
        device, dtype = torch.device("cuda"), torch.float16
        ops = type("Ops", (), {"name": "triton"})()

        def matmul_owners(self):
            return {}

        def use_kernels(self, ops):
            if ops is not self.ops:
                pytest.fail(f"a CUDA stage was given {ops}")

    pipeline = Pipeline([CudaStage()], [])
    pipeline.choose_kernels(max_rows=8, block_size=16, matmul_mode="auto", cpu_mode="auto")
    assert pipeline.kernels[0].cpu is None and pipeline.cpu_kernels() is None
    assert pipeline.kernel_summary() == "kernels: the triton kernels on cuda"


def test_ops_can_be_forced_one_by_one_and_the_rest_are_timed(monkeypatch):
    timed = []
    monkeypatch.setattr(cpu_extension, "unavailable_reason", lambda *_: None)
    monkeypatch.setattr(cpu_kernel_choice, "timing_inputs", lambda op, *_: (op,))
    monkeypatch.setattr(cpu_kernel_choice, "time_paths", lambda paths, inputs, timer: timed.append(inputs[0]) or {"compiled": 1.0, "torch": 2.0})
    modes = mode_from_env({"GRAPHRT_CPU_KERNELS": "paged_prefill_attention=torch, rms_norm=torch, decode_layers=off"})
    choice = choose_cpu_kernels(**SHAPES, mode=modes)
    assert timed == [op for op in OPS if op not in ("paged_prefill_attention", "rms_norm")]
    assert choice.paths == {op: "torch" if op in ("paged_prefill_attention", "rms_norm") else "compiled" for op in OPS}
    assert not choice.one_call
    summary = choice.summary()
    assert "; prefill attention, rms_norm forced by GRAPHRT_CPU_KERNELS)" in summary
    assert summary.endswith("; decode layers one by one (GRAPHRT_CPU_KERNELS=decode_layers=off)")
    # Every op forced: nothing is timed.
    timed.clear()
    choice = choose_cpu_kernels(**SHAPES, mode=mode_from_env({"GRAPHRT_CPU_KERNELS": "rms_norm=torch,compiled"}))
    assert timed == [] and choice.source == "forced" and choice.paths["rms_norm"] == "torch"
    assert choice.summary().endswith("(forced by GRAPHRT_CPU_KERNELS)")


def test_the_graph_cache_gives_the_ops_nothing_forces(monkeypatch):
    monkeypatch.setattr(cpu_extension, "unavailable_reason", lambda *_: None)
    monkeypatch.setattr(cpu_kernel_choice, "time_paths", lambda *_: pytest.fail("timed an op the cache gave"))
    cached = {op: "torch" if op == "write_kv" else "compiled" for op in OPS}
    choice = choose_cpu_kernels(**SHAPES, cached=cached)
    assert (choice.paths, choice.source) == (cached, "cached")
    assert choice.summary().endswith("(from the graph cache)")
    forced = choose_cpu_kernels(**SHAPES, mode=mode_from_env({"GRAPHRT_CPU_KERNELS": "write_kv=compiled"}), cached=cached)
    assert forced.paths == {op: "compiled" for op in OPS}  # the environment comes first
    assert forced.summary().endswith("(KV writes forced by GRAPHRT_CPU_KERNELS; decode attention, prefill attention, "
                                     "rms_norm, rotary, silu_and_mul from the graph cache)")


def test_silu_and_mul_in_the_gate_up_matmuls_pass_is_not_timed_alone(monkeypatch):
    """Where every gate/up matmul ends in silu_and_mul (fused_silu), the op alone never runs: it is
    the compiled one whatever its time alone, or a graph cache, would say; forcing still decides."""
    timed = []
    monkeypatch.setattr(cpu_extension, "unavailable_reason", lambda *_: None)
    monkeypatch.setattr(cpu_kernel_choice, "timing_inputs", lambda op, *_: (op,))
    monkeypatch.setattr(cpu_kernel_choice, "time_paths", lambda paths, inputs, timer: timed.append(inputs[0]) or {"compiled": 2.0, "torch": 1.0})
    choice = choose_cpu_kernels(**SHAPES, fused_silu=True)
    assert timed == [op for op in OPS if op != "silu_and_mul"]
    assert choice.paths["silu_and_mul"] == "compiled" and choice.settled == {"silu_and_mul": "fused"}
    assert choice.summary().endswith("; silu_and_mul in the gate/up matmuls' pass)")
    assert choose_cpu_kernels(**SHAPES).paths["silu_and_mul"] == "torch"  # timed alone, it loses here
    cached = {op: "torch" for op in OPS}
    assert choose_cpu_kernels(**SHAPES, cached=cached, fused_silu=True).paths == {**cached, "silu_and_mul": "compiled"}
    forced = mode_from_env({"GRAPHRT_CPU_KERNELS": "silu_and_mul=torch"})
    assert choose_cpu_kernels(**SHAPES, mode=forced, fused_silu=True).paths["silu_and_mul"] == "torch"


# Qwen2-MoE whose shared expert has 40 gate and 40 up columns (not whole panels), its layers 0-2 dense.
SHARED_EXPERT_OF_40 = {"shared_expert_intermediate_size": 40, "mlp_only_layers": [0, 1, 2]}


@pytest.mark.usefixtures("built_cpu_kernels")
@pytest.mark.parametrize(("variant", "overrides", "pp", "matmul", "alone"), [
    ("llama-gqa-tied", None, 1, "panel", [False]),
    ("llama-gqa-tied", None, 1, "packed", [True]),  # gate/up on oneDNN: silu_and_mul runs alone
    ("qwen2-moe", None, 1, "panel", [False]),  # the shared expert in panels too
    ("qwen2-moe", None, 1, "experts_gate_up=packed,panel", [False]),  # routed experts never call the op
    ("qwen3-moe", None, 1, "experts_gate_up=packed,experts_down=packed,panel", [False]),  # routed experts alone
    ("qwen2-moe", SHARED_EXPERT_OF_40, 1, "panel", [True]),
    ("qwen2-moe", SHARED_EXPERT_OF_40, 2, "panel", [False, True]),  # stage 0 dense layers only: timed for both
], ids=lambda v: "-".join(map(str, v)) if isinstance(v, list) else None)
def test_silu_and_mul_is_timed_where_a_stage_on_the_device_runs_it_alone(
    tiny_model_factory, tmp_path, monkeypatch, variant, overrides, pp, matmul, alone
):
    if not (can_use_panels(CPU, torch.float32) and can_pack(CPU, torch.float32)):
        pytest.skip("the panel matmuls or oneDNN's packed ones don't run on this CPU")
    monkeypatch.setenv("GRAPHRT_MATMUL", matmul)
    model = make_tiny_model(tmp_path, variant, overrides=overrides) if overrides else tiny_model_factory(variant)
    llm = LLM(model=model, pp=pp, dtype="float32", kv_cache_tokens=512)
    try:
        stages = llm.engine.pipeline.stages
        assert [runs_silu_and_mul_alone(stage) for stage in stages] == alone
        fused = [kernels.cpu.settled.get("silu_and_mul") == "fused" for kernels in llm.engine.pipeline.kernels]
        assert fused == [not any(alone)] * pp
    finally:
        llm.engine.close()


@pytest.mark.usefixtures("built_cpu_kernels")
def test_a_start_with_the_graph_cache_runs_the_cpu_kernels_it_recorded(tiny_model_factory, tmp_path, monkeypatch):
    from graphrt.capture.manifest import read_manifest, write_manifest
    from graphrt.cli import build_manifest

    model = tiny_model_factory("llama-gqa-tied")
    # What no timing here would choose, for the test to see it come back: the references for the
    # attention, the kernels for the rest, and torch's argmax.
    monkeypatch.setenv("GRAPHRT_CPU_KERNELS", "paged_decode_attention=torch,paged_prefill_attention=torch,greedy_argmax=torch,compiled")
    engine = LLM(model=model, pp=2, dtype="float32", kv_cache_tokens=256).engine
    write_manifest(tmp_path, build_manifest(engine))
    recorded = read_manifest(tmp_path)["cpu_kernels"]
    assert recorded == {"ops": engine.pipeline.cpu_kernels().paths, "greedy_argmax": "torch"}
    monkeypatch.setenv("GRAPHRT_CPU_KERNELS", "auto")
    monkeypatch.setattr(cpu_kernel_choice, "time_paths", lambda *_: pytest.fail("timed a kernel the cache gave"))
    cached = LLM(model=model, pp=2, dtype="float32", kv_cache_tokens=256, cache=tmp_path).engine
    for stage, chosen in zip(cached.pipeline.stages, cached.pipeline.kernels):
        assert chosen.cpu.paths == recorded["ops"]
        assert stage.layers[0].ops.paged_decode_attention is TORCH.paged_decode_attention
    assert cached.sampler.greedy_argmax is argmax.greedy_argmax
    summary = cached.kernel_summary()
    assert "(from the graph cache)" in summary and "greedy argmax: torch (from the graph cache)" in summary
