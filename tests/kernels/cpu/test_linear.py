"""CPU matmuls on weights packed for oneDNN (graphrt/kernels/cpu/linear.py) against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from graphrt import LLM
from graphrt.kernels.cpu.linear import can_pack, linear, pack_weight

needs_onednn = pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.float32), reason="this torch has no oneDNN")


def test_float32_and_bfloat16_on_a_cpu_can_be_packed():
    assert not can_pack(torch.device("cpu"), torch.float64)
    assert can_pack(torch.device("cpu"), torch.bfloat16) == (
        can_pack(torch.device("cpu"), torch.float32) and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )
    assert not can_pack(torch.device("cuda"), torch.float32)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 2, 3, 32, 512])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_matches_dense(rows, with_bias):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(1536, 576, generator=generator)
    bias = torch.randn(1536, generator=generator) if with_bias else None
    x = torch.randn(rows, 576, generator=generator)
    packed = pack_weight(weight)
    assert packed.is_mkldnn
    out = linear(x, packed, bias)
    assert out.shape == (rows, 1536)
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-4, atol=1e-4)
    # A dense weight goes straight to F.linear.
    torch.testing.assert_close(linear(x, weight, bias), F.linear(x, weight, bias), rtol=0, atol=0)


@needs_onednn
def test_a_float32_cpu_stage_packs_its_matmuls_and_float64_does_not(tiny_model_factory, monkeypatch):
    monkeypatch.setenv("GRAPHRT_MATMUL", "packed")  # not what this machine measures fastest (tests/kernels/cpu/test_matmul_choice.py)
    model = tiny_model_factory("qwen2-qkv-bias")  # biases on q/k/v go through the packed path too
    packed_stage = LLM(model=model, pp=2, dtype="float32").engine.pipeline.stages[1]
    dense_stage = LLM(model=model, pp=2, dtype="float64").engine.pipeline.stages[1]
    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        assert getattr(packed_stage.layers[0], name).is_mkldnn
        assert not getattr(dense_stage.layers[0], name).is_mkldnn
    assert packed_stage.is_last and packed_stage.lm_head.is_mkldnn
    assert packed_stage.weight_bytes() == dense_stage.weight_bytes() // 2  # float32 against float64, same tensors
