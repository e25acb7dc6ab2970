"""Mixture-of-experts models on the CPU wing: their dense projections take the chosen matmul forms,
the compiled ops run them, the experts run grouped by expert, and the one-call decode step declines
stages with sparse layers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from graphrt import LLM
from graphrt.kernels.cpu import stage_kernels
from graphrt.kernels.cpu.linear import can_pack, pack_panels, weight_form
from graphrt.kernels.cpu.moe import fused_moe_by_expert
from graphrt.kernels.moe import fused_moe
from graphrt.model.config import ModelConfig
from graphrt.model.weights import WeightFiles
from graphrt.runtime.stage_builder import load_stage
from helpers import prompt_logits

CPU = torch.device("cpu")


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
