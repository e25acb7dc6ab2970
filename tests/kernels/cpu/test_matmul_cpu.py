"""The compiled panel matmul (kernels/cpu/csrc/matmul_cpu.cpp, via graphrt/kernels/cpu/linear.py) against
F.linear and a float64 reference: every tile shape the kernel has, panels in groups and remainders,
strided rows, bias, threads, and the messages for bad inputs; and the gate/up matmul that ends in
silu_and_mul, against the two ops it fuses."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

from graphrt import LLM, SamplingParams
from graphrt.kernels.cpu import elementwise as elementwise_cpu
from graphrt.kernels.cpu.linear import (
    PANEL_WIDTH,
    can_use_panels,
    dense_weight,
    linear,
    pack_panels,
    panel_linear_silu_and_mul,
    weight_form,
)

CPU = torch.device("cpu")
DTYPES = [pytest.param(dtype, marks=pytest.mark.skipif(not can_use_panels(CPU, dtype), reason=f"no panel kernel for {dtype} here"))
          for dtype in (torch.float32, torch.bfloat16)]
# Rows through every tile height (8, 4, 2, 1 and their sums) and past a chunk of 128 rows.
ROWS = [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 31, 32, 33, 131, 300]


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


def test_panels_hold_each_column_as_one_stream_of_k():
    weight = torch.arange(32 * 6, dtype=torch.float32).reshape(32, 6)
    panels = pack_panels(weight)
    assert panels.shape == (2, 6, 16, 1) and panels.is_contiguous()
    assert panels[1, 4, 3, 0] == weight[16 + 3, 4]
    pairs = pack_panels(weight.to(torch.bfloat16))
    assert pairs.shape == (2, 3, 16, 2)
    assert pairs[1, 2, 5, 1] == weight[16 + 5, 2 * 2 + 1]  # step 2's pair, second value, column 5 of panel 1
    torch.testing.assert_close(dense_weight(pairs), weight.to(torch.bfloat16), rtol=0, atol=0)


def test_panels_need_whole_panels_an_avx512_cpu_and_a_cpu_tensor():
    assert not can_use_panels(CPU, torch.float64)
    assert not can_use_panels(torch.device("cuda"), torch.float32)
    assert not can_use_panels(CPU, torch.float32, (PANEL_WIDTH * 3 + 1, 64))
    assert not can_use_panels(CPU, torch.bfloat16, (PANEL_WIDTH, 63))  # bfloat16 steps k in pairs
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        assert not can_use_panels(CPU, torch.float32)


@contextmanager
def threads(count: int):
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("num_threads", [1, 2])
def test_every_row_count_matches_the_reference(dtype, rows, num_threads):
    # 13 panels: on one thread a group of 8 and a group of 5, on two 7 and 6 (from 8 rows up), each
    # cut into tiles of 2 panels (8 rows), 4 (4 rows, and 16 rows or more), 8 (2 rows and 1) and a
    # narrower tile for the rest.
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(13 * PANEL_WIDTH, 96, generator=generator).to(dtype)
    bias = torch.randn(13 * PANEL_WIDTH, generator=generator).to(dtype)
    x = torch.randn(rows, 96, generator=generator).to(dtype)
    for b in (None, bias):
        with threads(num_threads):
            out = linear(x, pack_panels(weight), b)
        assert out.shape == (rows, 13 * PANEL_WIDTH) and out.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-4)
        else:
            # Sums in float32 (off the exact sum by float32 roundings, about 1e-6 of it), rounded
            # once to bfloat16: within half a bfloat16 step (2**-8 of the value) of the exact sum.
            torch.testing.assert_close(out.double(), reference(x, weight, b), rtol=2**-8 * 1.01, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_threads", [1, 2])
def test_long_k_runs_panels_in_smaller_groups(dtype, num_threads):
    """k long enough that a group is 6, 5 or 4 panels (two of them must fit L2), or 4 panels with
    nothing fetched ahead; 131 rows pass a 128-row chunk, whose next group is the first again."""
    element = torch.finfo(dtype).bits // 8
    lengths = [k for k in (1024, 1200, 1536, 2048, 3072, 4096) if (384 << 10) // (k * PANEL_WIDTH * element) <= 6]
    for k in lengths:
        generator = torch.Generator().manual_seed(k)
        weight = torch.randn(13 * PANEL_WIDTH, k, generator=generator).to(dtype)
        for rows in (33, 131):
            x = torch.randn(rows, k, generator=generator).to(dtype)
            with threads(num_threads):
                out = linear(x, pack_panels(weight))
            # float32: the sum's roundings, about k * 2**-24 of its terms; bfloat16: as above.
            rtol, atol = (1e-5, 1e-3) if dtype == torch.float32 else (2**-8 * 1.01, 1e-2)
            torch.testing.assert_close(out.double(), reference(x, weight, None), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_default_models_shapes_match_f_linear(dtype):
    generator = torch.Generator().manual_seed(0)
    for out_features, in_features in ((960, 576), (576, 576), (3072, 576), (576, 1536)):
        weight = (torch.randn(out_features, in_features, generator=generator) * 0.05).to(dtype)
        x = torch.randn(32, in_features, generator=generator).to(dtype)
        out = linear(x, pack_panels(weight))
        tolerance = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out, F.linear(x, weight), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_of_a_wider_tensor_and_transposed_rows_are_read_where_they_are(dtype):
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(48, 64, generator=generator).to(dtype)
    wide = torch.randn(9, 100, generator=generator).to(dtype)
    x = wide[:, 10:74]  # unit-stride rows, 100 apart
    expected = linear(x.contiguous(), pack_panels(weight))
    torch.testing.assert_close(linear(x, pack_panels(weight)), expected, rtol=0, atol=0)
    transposed = x.contiguous().T.contiguous().T  # same values, columns unit-stride
    torch.testing.assert_close(linear(transposed, pack_panels(weight)), expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_thread_and_two_give_the_same_bits(dtype):
    generator = torch.Generator().manual_seed(2)
    weight = pack_panels(torch.randn(3072, 576, generator=generator).to(dtype))
    x = torch.randn(33, 576, generator=generator).to(dtype)
    with threads(1):
        one = linear(x, weight)
    with threads(2):
        two = linear(x, weight)
    assert torch.equal(one, two)
    # Nor does a row's result depend on the rows beside it (or the tile it lands in).
    assert torch.equal(linear(x[5:6], weight), one[5:6]) and torch.equal(linear(x[:13], weight), one[:13])


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_rows_give_no_rows(dtype):
    out = linear(torch.empty(0, 64, dtype=dtype), pack_panels(torch.randn(32, 64).to(dtype)))
    assert out.shape == (0, 32) and out.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES)
def test_bad_inputs_are_named(dtype):
    weight = torch.randn(32, 64).to(dtype)
    panels = pack_panels(weight)
    op = torch.ops.graphrt.panel_linear
    with pytest.raises(RuntimeError, match="must be packed by graphrt.kernels.cpu.linear.pack_panels"):
        op(torch.randn(2, 64).to(dtype), weight, None)
    with pytest.raises(RuntimeError, match="x has 48 features but the weight was packed for 64"):
        op(torch.randn(2, 48).to(dtype), panels, None)
    with pytest.raises(RuntimeError, match="x is Double but the weight is"):
        op(torch.randn(2, 64, dtype=torch.float64), panels, None)
    with pytest.raises(RuntimeError, match=r"bias must be a contiguous \(32,\) tensor"):
        op(torch.randn(2, 64).to(dtype), panels, torch.randn(31).to(dtype))
    with pytest.raises(RuntimeError, match="unit-stride rows"):
        op(torch.randn(64, 2).to(dtype).T, panels, None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("num_threads", [1, 2])
def test_the_gate_up_matmul_ending_in_silu_and_mul_is_bitwise_the_two_ops(dtype, rows, num_threads):
    # 13 gate panels and their 13 up partners (split 7 and 6 between two threads from 8 rows up), in
    # groups of 4 pairs, of 2 where k is long (1280 in float32) and without fetching ahead past 1536
    # (1600), cut into tiles of 1 pair (8 rows), 2 (4 rows, and 16 rows or more), 4 (2 rows and 1)
    # and narrower ones for the rest.
    generator = torch.Generator().manual_seed(rows)
    for k in (96, 768, 1280, 1600):
        weight = pack_panels((torch.randn(2 * 13 * PANEL_WIDTH, k, generator=generator) * 0.2).to(dtype))
        x = torch.randn(rows, k, generator=generator).to(dtype)
        with threads(num_threads):
            fused = panel_linear_silu_and_mul(x, weight)
            expected = elementwise_cpu.silu_and_mul(linear(x, weight))
        assert fused.shape == (rows, 13 * PANEL_WIDTH) and fused.dtype == dtype
        assert torch.equal(fused, expected)
    # The gate half is silu'd, the up half multiplies: swapping them changes the result.
    swapped = torch.cat([weight[13:], weight[:13]])
    assert not torch.equal(panel_linear_silu_and_mul(x, swapped), fused)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_gate_up_matmul_names_a_weight_without_pairs(dtype):
    with pytest.raises(RuntimeError, match="panel_linear_silu_and_mul: the gate/up weight must have as many up columns"):
        panel_linear_silu_and_mul(torch.randn(2, 64).to(dtype), pack_panels(torch.randn(48, 64).to(dtype)))
    with pytest.raises(RuntimeError, match="panel_linear_silu_and_mul: x has 48 features but the weight was packed for 64"):
        panel_linear_silu_and_mul(torch.randn(2, 48).to(dtype), pack_panels(torch.randn(64, 64).to(dtype)))


@pytest.mark.skipif(not can_use_panels(CPU, torch.float32), reason="no panel kernel for float32 here")
def test_an_engine_on_panels_generates_what_one_on_f_linear_does(tiny_model_factory, monkeypatch):
    model = tiny_model_factory("qwen2-qkv-bias")  # q/k/v biases; a 97-token vocabulary does not cut into panels
    prompts = [list(range(3, 30)), list(range(40, 50))]
    tokens, forms = {}, {}
    for mode in ("dense", "panel"):
        monkeypatch.setenv("GRAPHRT_MATMUL", mode)
        llm = LLM(model=model, pp=2, dtype="float32", kv_cache_tokens=256)
        last = llm.engine.pipeline.stages[-1]
        forms[mode] = (weight_form(last.layers[0].qkv_proj), weight_form(last.lm_head))
        outputs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        tokens[mode] = [out.token_ids for out in outputs]
    assert forms == {"dense": ("dense", "dense"), "panel": ("panel", "dense")}
    assert tokens["panel"] == tokens["dense"]
