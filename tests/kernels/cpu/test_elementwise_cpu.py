"""The compiled CPU elementwise ops (kernels/cpu/elementwise.py) against their torch references:
rms_norm with and without its residual, rotary on views of a fused qkv, silu_and_mul, in the three
dtypes a CPU stage runs, at decode and prefill sizes and sizes that leave a partial vector; and the
sampler's greedy argmax against torch.argmax, ties and NaNs included, and its measured choice."""

from __future__ import annotations

import pytest
import torch

from graphrt.kernels import activation, argmax, rmsnorm, rotary
from graphrt.kernels.cpu import elementwise as elementwise_cpu
from graphrt.kernels.cpu import kernel_choice as cpu_kernel_choice
from graphrt.kernels.rotary import RopeConfig

pytestmark = pytest.mark.usefixtures("built_cpu_kernels")  # tests/conftest.py

DTYPES = [torch.float32, torch.bfloat16, torch.float64]
ROWS = [1, 3, 32, 257]


def randn(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def assert_close_to_reference(got: torch.Tensor, expected: torch.Tensor):
    """Equal but for the order of a sum, which can move a result by a unit or two in the last place
    of the dtype; anything further fails."""
    assert got.shape == expected.shape and got.dtype == expected.dtype
    eps = torch.finfo(got.dtype).eps
    torch.testing.assert_close(got, expected, rtol=4 * eps, atol=eps)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hidden_size", [576, 100])  # SmolLM2's, and one that is no whole number of vectors
def test_rms_norm_with_a_residual(dtype, rows, hidden_size):
    x, residual = randn(rows, hidden_size, dtype=dtype, seed=1), randn(rows, hidden_size, dtype=dtype, seed=2)
    weight = 1 + randn(hidden_size, dtype=dtype, seed=3) / 10
    out, summed = elementwise_cpu.rms_norm(x, weight, 1e-5, residual)
    expected_out, expected_summed = rmsnorm.rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(summed, expected_summed)  # one rounded add: the same bits
    assert_close_to_reference(out, expected_out)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_without_a_residual_returns_x_as_the_sum(dtype):
    x, weight = randn(5, 64, dtype=dtype), 1 + randn(64, dtype=dtype, seed=3) / 10
    out, summed = elementwise_cpu.rms_norm(x, weight, 1e-6)
    assert summed is x
    assert_close_to_reference(out, rmsnorm.rms_norm(x, weight, 1e-6)[0])


def test_rms_norm_of_heads_as_qwen3_norms_q_and_k():
    """(tokens, heads, head_dim) views of a fused projection, normed per head."""
    qkv = randn(7, 4 * 32 + 2 * 2 * 32, dtype=torch.float32)
    q = qkv[:, : 4 * 32].view(7, 4, 32)
    weight = 1 + randn(32, dtype=torch.float32, seed=3) / 10
    out, _ = elementwise_cpu.rms_norm(q, weight, 1e-6)
    assert out.shape == q.shape
    assert_close_to_reference(out, rmsnorm.rms_norm(q, weight, 1e-6)[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 2, 20), (2, 1, 128)])
def test_rotary_on_views_of_the_fused_qkv_is_the_reference_bit_for_bit(dtype, rows, heads, kv_heads, head_dim):
    """Each product and sum rounded where the reference rounds it: the same bits, in every dtype."""
    qkv = randn(rows, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(rows, heads, head_dim), k.view(rows, kv_heads, head_dim)
    cos, sin = rotary.rotary_cos_sin(RopeConfig(theta=10000.0), head_dim, 4096)
    positions = torch.randint(0, 4096, (rows,), generator=torch.Generator().manual_seed(4))
    got_q, got_k = elementwise_cpu.apply_rotary(q, k, cos[positions], sin[positions])
    expected_q, expected_k = rotary.apply_rotary(q, k, cos[positions], sin[positions])
    assert torch.equal(got_q, expected_q) and torch.equal(got_k, expected_k)
    assert got_q.is_contiguous() and got_k.is_contiguous()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("size", [1536, 37])
def test_silu_and_mul(dtype, rows, size):
    gate_up = randn(rows, 2 * size, dtype=dtype) * 4  # well into both tails of the sigmoid
    assert_close_to_reference(elementwise_cpu.silu_and_mul(gate_up), activation.silu_and_mul(gate_up))


def test_two_threads_give_the_same_bits_as_one():
    x, residual, weight = randn(64, 576, dtype=torch.bfloat16), randn(64, 576, dtype=torch.bfloat16, seed=1), randn(576, dtype=torch.bfloat16)
    gate_up = randn(64, 3072, dtype=torch.bfloat16)
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            results.append((*elementwise_cpu.rms_norm(x, weight, 1e-5, residual), elementwise_cpu.silu_and_mul(gate_up)))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_inputs_it_cannot_take_are_refused_with_what_is_wrong():
    x = randn(4, 64, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="weight must be a contiguous \\(64,\\) tensor of x's dtype"):
        elementwise_cpu.rms_norm(x, randn(64, dtype=torch.float64), 1e-5)
    with pytest.raises(RuntimeError, match="residual must match x"):
        elementwise_cpu.rms_norm(x, randn(64, dtype=torch.float32), 1e-5, randn(4, 32, dtype=torch.float32))
    q = randn(4, 2, 64, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="cos and sin must be contiguous float32"):
        elementwise_cpu.apply_rotary(q, q, randn(4, 64, dtype=torch.float64), randn(4, 64, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="head_dim must be even"):
        elementwise_cpu.apply_rotary(q[..., :63], q[..., :63], randn(4, 63, dtype=torch.float32), randn(4, 63, dtype=torch.float32))
    with pytest.raises(RuntimeError, match="gate_up must be \\(rows, 2 \\* size\\)"):
        elementwise_cpu.silu_and_mul(randn(4, 7, dtype=torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows, vocab", [(1, 49152), (32, 49152), (5, 37), (3, 1)])  # 37: two vectors and a tail
def test_greedy_argmax_is_torch_argmax(dtype, rows, vocab):
    logits = randn(rows, vocab, dtype=dtype, seed=rows)
    assert torch.equal(elementwise_cpu.greedy_argmax(logits), argmax.greedy_argmax(logits))


def test_greedy_argmax_keeps_float64_apart_where_float32_would_tie():
    logits = torch.tensor([[1.0, 1.0 + 1e-12, 0.5]], dtype=torch.float64)  # equal once rounded to float32
    assert elementwise_cpu.greedy_argmax(logits).tolist() == [1]


def test_greedy_argmax_takes_the_first_of_equal_maxima_and_the_first_nan():
    logits = torch.zeros(6, 40)
    logits[0, [7, 3, 30]] = 2.0  # ties in two vectors: the first
    logits[1, [39, 38]] = 1.0  # ties in the tail
    logits[2, 5], logits[2, 33] = 1.0, float("nan")  # a NaN counts as the largest
    logits[3, [9, 20]] = float("nan")
    logits[4] = -float("inf")  # all equal: index 0
    logits[5] = -1.0
    logits[5, 17], logits[5, 21] = -0.0, 0.0  # zeros of both signs are equal: the first
    expected = argmax.greedy_argmax(logits)
    assert expected.tolist() == [3, 38, 33, 9, 0, 17]
    assert torch.equal(elementwise_cpu.greedy_argmax(logits), expected)
    assert torch.equal(elementwise_cpu.greedy_argmax(logits[:, :39]), argmax.greedy_argmax(logits[:, :39]))  # a strided view


def test_greedy_argmax_is_chosen_by_timing_both_or_forced():
    class Clock:
        """time_paths reads it before and after each call, compiled and torch in turn: a compiled
        call takes 1 s, a torch one 3."""

        def __init__(self):
            self.reads, self.now = 0, 0.0

        def __call__(self) -> float:
            self.reads += 1
            self.now += {2: 1.0, 0: 3.0}.get(self.reads % 4, 0.0)
            return self.now

    cpu = torch.device("cpu")
    function, line = cpu_kernel_choice.choose_greedy_argmax(cpu, 64, 4, timer=Clock())
    assert function is elementwise_cpu.greedy_argmax
    assert line == "greedy argmax: compiled (1000.000 vs 3000.000 ms at 4 rows of 64, compiled vs torch)"
    assert cpu_kernel_choice.choose_greedy_argmax(cpu, 64, 4, mode="torch")[0] is argmax.greedy_argmax
    assert cpu_kernel_choice.choose_greedy_argmax(cpu, 64, 4, mode="compiled")[0] is elementwise_cpu.greedy_argmax
    assert cpu_kernel_choice.choose_greedy_argmax(torch.device("cuda"), 64, 4) == (argmax.greedy_argmax, None)
    with pytest.raises(ValueError, match="must be one of auto, torch, compiled, got 'fast'"):
        cpu_kernel_choice.choose_greedy_argmax(cpu, 64, 4, mode="fast")


def test_greedy_argmax_refuses_what_is_not_rows_of_logits():
    for logits in (torch.zeros(5), torch.zeros(2, 0), torch.zeros(2, 3, 4)):
        with pytest.raises(ValueError, match=r"logits must be \(rows, vocab\) with vocab >= 1, not"):
            elementwise_cpu.greedy_argmax(logits)
