"""Mixture-of-experts models on the CPU wing: their dense projections take the chosen matmul forms,
the compiled ops run them, the experts run grouped by expert, each stage's routed experts are kept
in the form chosen for them (dense, packed or panels), and the one-call decode step declines stages
with sparse layers."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from graphrt import LLM
from graphrt.kernels.cpu import matmul_choice, stage_kernels
from graphrt.kernels.cpu import moe as cpu_moe
from graphrt.kernels.cpu.forcing import ForcedModes
from graphrt.kernels.cpu.linear import can_pack, can_use_panels, convert, dense_weight, linear, pack_panels, weight_form
from graphrt.kernels.cpu.matmul_choice import EXPERT_NAMES, available_paths, summarize
from graphrt.kernels.cpu.moe import ExpertWeights, fused_moe_by_expert
from graphrt.kernels.moe import fused_moe
from graphrt.model.config import ModelConfig
from graphrt.model.weights import WeightFiles
from graphrt.runtime.stage_builder import load_stage
from helpers import prompt_logits

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(not can_pack(CPU, torch.float32), reason="this torch has no oneDNN packed matmuls")
EXPERTS_ONLY = "experts_gate_up={0},experts_down={0},dense"  # GRAPHRT_MATMUL: the experts in {0}, every other shape dense


def stage_in_panels(model_dir, layers: range):
    """A stage of `layers` with every dense matmul weight in panels, as the panel path leaves them."""
    cfg = ModelConfig.from_dir(model_dir)
    stage = load_stage(cfg, 0, 2, layers, CPU, torch.float32, 64, "torch", WeightFiles(model_dir))
    for name, owners in stage.matmul_owners().items():
        if name != "lm_head":
            for owner, attr in owners:
                setattr(owner, attr, nn.Parameter(pack_panels(getattr(owner, attr)), requires_grad=False))
    return stage


def test_one_call_decode_declines_a_stage_with_a_sparse_layer(tiny_model_factory):
    model_dir = tiny_model_factory("qwen3-moe-dense-first")  # layers 0 and 2 dense, 1 and 3 sparse
    assert stage_kernels.bind_decode_layers(stage_in_panels(model_dir, range(0, 1))) is not None  # dense only: it may
    assert stage_kernels.bind_decode_layers(stage_in_panels(model_dir, range(0, 2))) is None
    assert stage_kernels.bind_decode_layers(stage_in_panels(model_dir, range(1, 2))) is None


@pytest.mark.usefixtures("built_cpu_kernels")
@pytest.mark.parametrize("variant", ["qwen2-moe", "qwen3-moe-dense-first"])
def test_moe_models_run_on_compiled_ops_and_packed_weights(tiny_model_factory, monkeypatch, variant):
    if not can_pack(CPU, torch.float32):
        pytest.skip("this torch has no oneDNN packed matmuls")
    model_dir, prompt = tiny_model_factory(variant), list(range(5, 30))
    monkeypatch.setenv("GRAPHRT_CPU_KERNELS", "torch")
    monkeypatch.setenv("GRAPHRT_MATMUL", "dense")
    reference = prompt_logits(LLM(model=model_dir, pp=2, dtype="float32", kv_cache_tokens=128).engine, prompt)
    monkeypatch.setenv("GRAPHRT_CPU_KERNELS", "compiled")
    monkeypatch.setenv("GRAPHRT_MATMUL", "packed")
    llm = LLM(model=model_dir, pp=2, dtype="float32", kv_cache_tokens=128)
    layers = [layer for stage in llm.engine.pipeline.stages for layer in stage.layers]
    assert all(weight_form(layer.qkv_proj) == "packed" for layer in layers)
    if variant == "qwen2-moe":  # its shared expert is a dense MLP, in the form chosen for its shape
        assert all(weight_form(layer.moe.shared_gate_up_proj) == "packed" for layer in layers)
    sparse = [layer.moe for layer in layers if layer.moe is not None]
    assert all(weight_form(expert) == "packed" for moe in sparse for expert in moe.experts_gate_up)  # the experts too
    assert not any(stage.decode_layers_in_one_call() for stage in llm.engine.pipeline.stages)
    torch.testing.assert_close(prompt_logits(llm.engine, prompt), reference, atol=1e-4, rtol=0)


def test_the_cpu_experts_read_only_the_experts_some_row_chose():
    """On a CPU the experts run grouped by expert, each on the rows that chose it: NaN weights of
    experts no row chose are never read, at one row or at many."""
    gen = torch.Generator().manual_seed(0)
    for num_tokens in (1, 9):
        hidden = torch.randn(num_tokens, 16, generator=gen)
        w_gate_up, w_down = torch.randn(5, 20, 16, generator=gen), torch.randn(5, 16, 10, generator=gen)
        topk_ids = torch.tensor([[2, 0], [4, 2], [0, 0]] * 3)[:num_tokens]  # expert 0 twice in a row, once
        topk_weights = torch.rand(num_tokens, 2, generator=gen)
        clean = fused_moe_by_expert(hidden, w_gate_up, w_down, topk_weights, topk_ids)
        torch.testing.assert_close(clean, fused_moe(hidden, w_gate_up, w_down, topk_weights, topk_ids), atol=1e-4, rtol=0)
        w_gate_up[[1, 3]], w_down[[1, 3]] = torch.nan, torch.nan
        assert torch.equal(fused_moe_by_expert(hidden, w_gate_up, w_down, topk_weights, topk_ids), clean)


def test_a_cpu_stage_runs_the_experts_grouped_by_expert(tiny_model_factory):
    llm = LLM(model=tiny_model_factory("mixtral"), pp=2, dtype="float32", kv_cache_tokens=128)
    assert all(stage.ops.fused_moe is fused_moe_by_expert for stage in llm.engine.pipeline.stages)


# (tokens, top_k, experts), as tests/model/test_moe.py's SHAPES: experts that divide neither tokens
# nor sizes, top-k 1 and 8 (rows naming an expert twice), one row (packed pads it to two) to 64.
SHAPES = [(1, 1, 13), (1, 8, 13), (3, 2, 13), (1, 8, 3), (5, 8, 3), (17, 1, 13), (33, 2, 7), (64, 8, 13), (64, 1, 5)]


@pytest.mark.parametrize("path", ["dense", "packed", "panel"])  # every form the timing at load can choose
@pytest.mark.parametrize(("num_tokens", "top_k", "num_experts"), SHAPES)
@pytest.mark.parametrize("inter", [40, 32])
def test_experts_kept_one_weight_per_expert_give_the_reference_to_float32_rounding(num_tokens, top_k, num_experts, path, inter, monkeypatch):
    # gate/up (2 * inter, 48) and down (48, inter): whole panels of 16 columns; with inter 32 each half
    # of gate/up is whole panels too, so panels run their SiLU-and-mul in the matmul's pass
    hidden_size = 48
    if path not in available_paths(CPU, torch.float32, (hidden_size, inter), path):
        pytest.skip(f"no {path} matmuls on this CPU and torch")
    gen = torch.Generator().manual_seed(num_tokens * 100 + top_k * 10 + num_experts)
    hidden = torch.randn(num_tokens, hidden_size, generator=gen)
    w_gate_up = torch.randn(num_experts, 2 * inter, hidden_size, generator=gen) * 0.2
    w_down = torch.randn(num_experts, hidden_size, inter, generator=gen) * 0.2
    topk_weights = torch.rand(num_tokens, top_k, generator=gen)
    topk_ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=gen)
    if top_k > 1:
        topk_ids[0, 1] = topk_ids[0, 0]  # a row that names one expert twice
    per_expert = lambda stacked: ExpertWeights([convert(path, w) for w in stacked], stacked.shape, stacked.dtype)  # noqa: E731
    experts = (per_expert(w_gate_up), per_expert(w_down))
    out = fused_moe_by_expert(hidden, *experts, topk_weights, topk_ids)
    compiled = cpu_moe.in_panels(*experts, torch.float32)
    assert compiled == (path == "panel" and inter % 32 == 0)  # all experts in one compiled op, where it applies
    if compiled:  # bitwise the loop over the experts, whose gate/up runs its SiLU-and-mul in the matmul's pass,
        monkeypatch.setattr(cpu_moe, "in_panels", lambda *args: False)
        fused_calls = []
        fused = cpu_moe.panel_linear_silu_and_mul
        monkeypatch.setattr(cpu_moe, "panel_linear_silu_and_mul", lambda *args: fused_calls.append(1) or fused(*args))
        assert torch.equal(fused_moe_by_expert(hidden, *experts, topk_weights, topk_ids), out) and fused_calls
        # and bitwise what the matmul, then SiLU-and-mul in torch, give
        unfused = lambda x, w: (lambda gate, up: F.silu(gate) * up)(*linear(x, w).chunk(2, dim=-1))  # noqa: E731
        monkeypatch.setattr(cpu_moe, "panel_linear_silu_and_mul", unfused)
        assert torch.equal(fused_moe_by_expert(hidden, *experts, topk_weights, topk_ids), out)
    assert out.shape == (num_tokens, hidden_size) and out.dtype == torch.float32
    # The definition in float64 (tests/model/test_moe.py holds the reference to a per-token loop).
    expected = fused_moe(hidden.double(), w_gate_up.double(), w_down.double(), topk_weights, topk_ids)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_tokens", "top_k", "num_experts"), SHAPES + [(300, 1, 2)])  # 300: experts of over 128 rows
def test_the_compiled_experts_are_bitwise_the_loop_over_the_experts(num_tokens, top_k, num_experts, dtype, monkeypatch):
    """`panel_experts` runs every expert's gate/up matmul in one range of work that the threads
    share, then every down matmul: bitwise the loop over the experts, in both dtypes of the panels;
    where the forms differ (a gate/up in panels, a down weight packed) the loop runs."""
    hidden_size, inter = 48, 32
    if not can_use_panels(CPU, dtype, (2 * inter, hidden_size)):
        pytest.skip(f"no {dtype} panel matmuls on this CPU")
    gen = torch.Generator().manual_seed(num_tokens * 100 + top_k * 10 + num_experts)
    hidden = torch.randn(num_tokens, hidden_size, generator=gen).to(dtype)
    w_gate_up = (torch.randn(num_experts, 2 * inter, hidden_size, generator=gen) * 0.2).to(dtype)
    w_down = (torch.randn(num_experts, hidden_size, inter, generator=gen) * 0.2).to(dtype)
    topk_weights = torch.rand(num_tokens, top_k, generator=gen)
    topk_weights[0, 0] = 0.0  # a pair of weight 0 is never run
    topk_ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=gen)
    if top_k > 1:
        topk_ids[-1, 1] = topk_ids[-1, 0]  # a row that names one expert twice
    panels = lambda stacked: ExpertWeights([pack_panels(w) for w in stacked], stacked.shape, dtype)  # noqa: E731
    experts = (panels(w_gate_up), panels(w_down))
    assert cpu_moe.in_panels(*experts, dtype)
    out = fused_moe_by_expert(hidden, *experts, topk_weights, topk_ids)
    counts = torch.bincount(topk_ids[topk_weights != 0], minlength=num_experts)
    assert num_tokens < 300 or counts.max() > 128  # the op's chunks of 128 rows, where an expert has more
    with monkeypatch.context() as patch:
        patch.setattr(cpu_moe, "in_panels", lambda *args: False)
        assert torch.equal(fused_moe_by_expert(hidden, *experts, topk_weights, topk_ids), out)
    torch.testing.assert_close(  # and the definition
        out.double(), fused_moe(hidden.double(), w_gate_up.double(), w_down.double(), topk_weights, topk_ids),
        **(dict(atol=2e-5, rtol=0) if dtype == torch.float32 else dict(atol=5e-2, rtol=2e-2)),  # bfloat16: rounded at each op
    )
    if can_pack(CPU, dtype):
        mixed = (experts[0], ExpertWeights([convert("packed", w) for w in w_down], w_down.shape, dtype))
        assert mixed[1].form == "packed" and not cpu_moe.in_panels(*mixed, dtype)
        torch.testing.assert_close(fused_moe_by_expert(hidden, *mixed, topk_weights, topk_ids), out, atol=1e-2, rtol=0)


def test_the_compiled_experts_say_what_is_wrong_with_their_weights():
    if not can_use_panels(CPU, torch.float32, (64, 32)):
        pytest.skip("no panel matmuls on this CPU")
    gate_up, down = [pack_panels(torch.randn(64, 32))] * 2, [pack_panels(torch.randn(32, 32))] * 2
    rows = torch.randn(3, 32)
    with pytest.raises(RuntimeError, match="the counts sum to 2 but there are 3 rows"):
        torch.ops.graphrt.panel_experts(rows, [1, 1], gate_up, down)
    with pytest.raises(RuntimeError, match="2 counts but 1 gate/up"):
        torch.ops.graphrt.panel_experts(rows, [1, 2], gate_up[:1], down)
    with pytest.raises(RuntimeError, match="expert 1's weights must be packed"):
        torch.ops.graphrt.panel_experts(rows, [1, 2], [gate_up[0], torch.randn(64, 32)], down)
    with pytest.raises(RuntimeError, match="down weight must take 32 features to 32"):
        torch.ops.graphrt.panel_experts(rows, [1, 2], gate_up, [down[0], pack_panels(torch.randn(32, 16))])
    assert torch.ops.graphrt.panel_experts(rows[:0], [0, 0], gate_up, down).shape == (0, 32)


def test_rows_none_of_whose_experts_this_rank_holds_sum_to_zero():
    """Under --ep a rank may hold none of the experts a step's rows chose (ids num_experts): no matmul runs."""
    experts = ExpertWeights([torch.ones(8, 4)] * 2, torch.Size((2, 8, 4)), torch.float32)
    downs = ExpertWeights([torch.ones(4, 4)] * 2, torch.Size((2, 4, 4)), torch.float32)
    out = fused_moe_by_expert(torch.ones(3, 4), experts, downs, torch.rand(3, 2) + 0.1, torch.full((3, 2), 2))
    assert out.shape == (3, 4) and out.dtype == torch.float32 and not out.any()


def moe_stage(model_dir, dtype: torch.dtype = torch.float32):
    """The whole of a model as one stage, its weights dense as loaded."""
    cfg = ModelConfig.from_dir(model_dir)
    return load_stage(cfg, 0, 1, range(cfg.num_layers), CPU, dtype, 64, "torch", WeightFiles(model_dir))


def sparse_layers(stage) -> list[nn.Module]:
    return [layer.moe for layer in stage.layers if layer.moe is not None]


@needs_onednn
@pytest.mark.parametrize("winner", ["dense", "packed"])
def test_the_experts_take_the_form_their_timing_chose(tiny_model_factory, monkeypatch, winner):
    """Which form is faster is this machine's business: the timing is made to pick `winner`, and the
    experts of both sparse layers are then in that form, each expert the weight it was."""
    monkeypatch.setattr(matmul_choice, "pick_path", lambda seconds: winner)
    stage = moe_stage(tiny_model_factory("qwen3-moe-dense-first"))  # layers 1 and 3 sparse, 6 experts at top-3
    loaded = {name: [getattr(moe, name).clone() for moe in sparse_layers(stage)] for name in EXPERT_NAMES}
    plan = stage_kernels.choose_matmuls(stage, 8, ForcedModes("dense", {name: "auto" for name in EXPERT_NAMES}))
    assert plan.expert_rows == (1, 4)  # 8 rows choosing 3 of 6 experts: 4 rows an expert
    assert "experts at 1 and 4" in summarize([plan]) and plan.measure_s > 0
    for name in EXPERT_NAMES:
        choice = plan.by_name()[name]
        assert (choice.path, choice.source) == (winner, "measured")
        assert {"dense", "packed"} <= set(choice.seconds) and all(set(by_rows) == {1, 4} for by_rows in choice.seconds.values())
        for moe, stacked in zip(sparse_layers(stage), loaded[name]):
            experts = getattr(moe, name)
            assert (experts.shape, experts.dtype) == (stacked.shape, stacked.dtype)  # read as the stack is
            assert [weight_form(expert) for expert in experts] == [winner] * len(stacked)
            assert torch.equal(torch.stack([dense_weight(expert) for expert in experts]), stacked)


@pytest.mark.parametrize(
    ("dtype", "mode", "path", "source"),
    [
        (torch.float32, "dense", "dense", "forced"),
        (torch.float32, "packed", "packed", "forced"),
        (torch.float64, "packed", "dense", "unavailable"),  # oneDNN packs float32 and bfloat16 only
        (torch.float64, "auto", "dense", "only"),
    ],
)
def test_graphrt_matmul_forces_the_experts_form(tiny_model_factory, dtype, mode, path, source):
    if path == "packed" and not can_pack(CPU, dtype):
        pytest.skip("this torch has no oneDNN packed matmuls")
    stage = moe_stage(tiny_model_factory("qwen3-moe-dense-first"), dtype)
    plan = stage_kernels.choose_matmuls(stage, 8, matmul_choice.mode_from_env({"GRAPHRT_MATMUL": EXPERTS_ONLY.format(mode)}))
    for name in EXPERT_NAMES:
        assert (plan.by_name()[name].path, plan.by_name()[name].source) == (path, source)
        assert {weight_form(expert) for moe in sparse_layers(stage) for expert in getattr(moe, name)} == {path}
    assert plan.by_name()["qkv_proj"].path == "dense"  # forced dense with the other shapes


@needs_onednn
def test_the_stacked_experts_are_freed_once_packed_and_their_bytes_still_counted(tiny_model_factory):
    stage = moe_stage(tiny_model_factory("qwen3-moe-dense-first"))
    stacks = [weakref.ref(getattr(moe, name)) for moe in sparse_layers(stage) for name in EXPERT_NAMES]
    reads = stage.weight_reads()
    stage_kernels.choose_matmuls(stage, 8, matmul_choice.mode_from_env({"GRAPHRT_MATMUL": EXPERTS_ONLY.format("packed")}))
    gc.collect()
    assert all(stack() is None for stack in stacks)
    assert stage.weight_reads() == reads  # 2 sparse layers of 6 experts of (80 + 40) x 64 floats
    assert reads.expert_bytes == 2 * 6 * 3 * 40 * 64 * 4 and stage.weight_bytes() == reads.total_bytes


@needs_onednn
def test_a_model_with_packed_experts_gives_the_dense_models_logits(tiny_model_factory, monkeypatch):
    model_dir, prompt = tiny_model_factory("qwen2-moe"), list(range(5, 30))  # its shared expert stays dense
    engines = {}
    for path in ("dense", "packed"):
        monkeypatch.setenv("GRAPHRT_MATMUL", EXPERTS_ONLY.format(path))
        engines[path] = LLM(model=model_dir, pp=2, dtype="float32", kv_cache_tokens=128).engine
    packed = [moe for stage in engines["packed"].pipeline.stages for moe in sparse_layers(stage)]
    assert packed and all(weight_form(expert) == "packed" for moe in packed for expert in moe.experts_down)
    summary = engines["packed"].pipeline.matmul_summary()
    assert "packed oneDNN for experts_gate_up, experts_down (forced by GRAPHRT_MATMUL)" in summary
    assert engines["packed"].weight_reads == engines["dense"].weight_reads
    logits = {path: prompt_logits(engine, prompt) for path, engine in engines.items()}
    torch.testing.assert_close(logits["packed"], logits["dense"], atol=1e-4, rtol=0)
