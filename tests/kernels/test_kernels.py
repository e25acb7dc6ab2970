"""Every Triton kernel against its torch reference, and the whole model with kernels="triton".

Without a GPU the kernels run through Triton's interpreter (`TRITON_INTERPRET=1`, which must be
set before the kernel modules are imported, since `triton.jit` reads it when it decorates). The
interpreter computes bfloat16 wrongly, so bfloat16 is checked only on CUDA. Shapes are small and
deliberately not multiples of the tile sizes; outputs start as NaN so an unwritten element fails.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from graphrt import LLM, SamplingParams  # noqa: E402
from graphrt.kernels import (  # noqa: E402
    activation,
    activation_triton,
    paged_attention,
    paged_attention_triton,
    rmsnorm,
    rmsnorm_triton,
    rotary,
    rotary_triton,
)
from graphrt.kernels.rotary import RopeConfig, rotary_cos_sin  # noqa: E402
from helpers import prompt_logits  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [
    pytest.param(dtype, id=str(dtype).removeprefix("torch."))
    for dtype in [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # atol = rtol

if DEVICE == "cpu" and type(rmsnorm_triton._rms_norm_kernel).__name__ != "InterpretedFunction":
    raise RuntimeError("graphrt.kernels.*_triton was imported before TRITON_INTERPRET=1 was set; these tests need it")


def assert_matches(got: torch.Tensor, expected: torch.Tensor) -> None:
    tol = TOLERANCE[expected.dtype]
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(dtype=dtype, device=DEVICE)


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty / empty_like hand out NaN-filled memory, so an output element nobody writes fails."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison(real_empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poison(real_empty_like(*a, **kw)))


def fused_qkv(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int):
    """q, k, v as the model makes them: strided views into one (tokens, q + 2 kv) projection."""
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=seed)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return qkv, q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, hidden_size", [(1, 64), (7, 100), (3, 4096)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(poisoned_empty, dtype, rows, hidden_size, with_residual):
    x = randn(rows, hidden_size, dtype=dtype, seed=rows)
    weight = randn(hidden_size, dtype=dtype, seed=hidden_size)
    residual = randn(rows, hidden_size, dtype=dtype, seed=rows + 1) if with_residual else None
    normed, summed = rmsnorm_triton.rms_norm(x, weight, 1e-6, residual)
    expected_normed, expected_sum = rmsnorm.rms_norm(x, weight, 1e-6, residual)
    assert_matches(normed, expected_normed)
    torch.testing.assert_close(summed, expected_sum, atol=0, rtol=0)  # one rounding either way


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head_on_strided_qkv_view(poisoned_empty, dtype):
    """Qwen3's q/k norm: each head of a strided q view is one row."""
    _, q, _, _ = fused_qkv(5, 6, 2, 48, dtype, seed=3)
    weight = randn(48, dtype=dtype, seed=4)
    normed, summed = rmsnorm_triton.rms_norm(q, weight, 1e-6)
    assert_matches(normed, rmsnorm.rms_norm(q, weight, 1e-6)[0])
    assert summed is q


def rope_tables(head_dim: int, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = rotary_cos_sin(RopeConfig(theta=10000.0), head_dim, max(positions) + 1)
    index = torch.tensor(positions)
    return cos[index].to(DEVICE), sin[index].to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, heads, kv_heads, head_dim", [(1, 4, 2, 32), (5, 6, 3, 24), (3, 8, 1, 128)])
def test_rotary_rotates_qkv_views_in_place(dtype, tokens, heads, kv_heads, head_dim):
    qkv, q, k, v = fused_qkv(tokens, heads, kv_heads, head_dim, dtype, seed=tokens * heads)
    cos, sin = rope_tables(head_dim, [7 * i + 3 for i in range(tokens)])
    expected_q, expected_k = rotary.apply_rotary(q.clone(), k.clone(), cos, sin)
    v_before = v.clone()
    got_q, got_k = rotary_triton.apply_rotary(q, k, cos, sin)
    assert got_q is q and got_k is k
    assert_matches(q, expected_q)
    assert_matches(k, expected_k)
    torch.testing.assert_close(v, v_before, atol=0, rtol=0)  # v shares the buffer and must be left alone
    assert qkv.isfinite().all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, inter_size", [(1, 64), (7, 100), (3, 1500)])
def test_silu_and_mul_matches_reference(poisoned_empty, dtype, tokens, inter_size):
    gate_up = randn(tokens, 2 * inter_size, dtype=dtype, seed=inter_size) * 3
    assert_matches(activation_triton.silu_and_mul(gate_up), activation.silu_and_mul(gate_up))


def poisoned_cache(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, kv_heads, head_dim, block_size", [(1, 2, 32, 16), (5, 3, 48, 8)])
def test_write_kv_writes_exactly_the_mapped_slots(dtype, tokens, kv_heads, head_dim, block_size):
    _, _, k, v = fused_qkv(tokens, 4, kv_heads, head_dim, dtype, seed=tokens)
    slots = torch.randperm(6 * block_size, generator=torch.Generator().manual_seed(tokens))[:tokens].to(DEVICE)
    got_k, got_v = (poisoned_cache(6, block_size, kv_heads, head_dim, dtype) for _ in range(2))
    expected_k, expected_v = got_k.clone(), got_v.clone()
    paged_attention_triton.write_kv(k, v, got_k, got_v, slots)
    paged_attention.write_kv(k, v, expected_k, expected_v, slots)
    torch.testing.assert_close(got_k, expected_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(got_v, expected_v, atol=0, rtol=0, equal_nan=True)


DECODE_CASES = {  # heads, kv_heads, head_dim, block_size, seq_lens (all of them end mid-block)
    "gqa2": (4, 2, 32, 16, [1, 17, 50]),
    "mha-head48-block8": (3, 3, 48, 8, [9, 30]),
    "gqa8-one-kv-head": (8, 1, 64, 16, [75]),
}


def decode_inputs(case: str, dtype: torch.dtype, table_blocks: int | None = None):
    """Query, NaN-poisoned caches holding context only up to seq_lens, shuffled block tables
    (`table_blocks` columns wide: a graph's table reaches max_model_len, past every live context)."""
    heads, kv_heads, head_dim, block_size, seq_lens = DECODE_CASES[case]
    max_blocks = table_blocks or -(-max(seq_lens) // block_size) + 1  # one spare column: tables are wider than needed
    num_blocks = 1 + len(seq_lens) * max_blocks
    generator = torch.Generator().manual_seed(len(case))
    tables = (torch.randperm(num_blocks - 1, generator=generator) + 1)[: len(seq_lens) * max_blocks]
    tables = tables.view(len(seq_lens), max_blocks).to(DEVICE)
    k_cache, v_cache = (poisoned_cache(num_blocks, block_size, kv_heads, head_dim, dtype) for _ in range(2))
    for row, seq_len in enumerate(seq_lens):
        positions = torch.arange(seq_len, device=DEVICE)
        slots = tables[row, positions // block_size] * block_size + positions % block_size
        k_cache.view(-1, kv_heads, head_dim)[slots] = randn(seq_len, kv_heads, head_dim, dtype=dtype, seed=row)
        v_cache.view(-1, kv_heads, head_dim)[slots] = randn(seq_len, kv_heads, head_dim, dtype=dtype, seed=row + 9)
    q = randn(len(seq_lens), heads, head_dim, dtype=dtype, seed=99)
    return q, k_cache, v_cache, tables, torch.tensor(seq_lens, device=DEVICE), head_dim**-0.5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(DECODE_CASES))
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_paged_decode_attention_matches_reference(poisoned_empty, dtype, case, num_splits):
    """The kernel reads only live context (the rest is NaN); the reference gets the NaNs zeroed."""
    q, k_cache, v_cache, tables, seq_lens, scale = decode_inputs(case, dtype)
    got = paged_attention_triton.paged_decode_attention(
        q, k_cache, v_cache, tables, seq_lens, scale, num_splits=num_splits
    )
    expected = paged_attention.paged_decode_attention(
        q, k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0), tables, seq_lens, scale
    )
    assert_matches(got, expected)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_decode_attention_stays_float64(poisoned_empty, num_splits):
    """float64 throughout, scale included (the JIT would pass a Python float as float32: on an H200
    that cost the MLA kernel 2e-8 where 1e-12 was wanted)."""
    q, k_cache, v_cache, tables, seq_lens, scale = decode_inputs("gqa2", torch.float64)
    got = paged_attention_triton.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale, num_splits=num_splits)
    expected = paged_attention.paged_decode_attention(
        q, k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0), tables, seq_lens, scale
    )
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-12)


LONG_CONTEXTS = {"gqa2-long": (4, 2, 32, 16, [1, 200, 700]), "gqa4-one-long": (8, 2, 16, 16, [1000])}
DECODE_CASES.update(LONG_CONTEXTS)


@pytest.mark.parametrize("case", sorted(LONG_CONTEXTS))
@pytest.mark.parametrize("num_splits", [None, 1, 2, 5, 8])
def test_paged_decode_attention_splits_each_context_into_parts_that_all_work(poisoned_empty, case, num_splits):
    """Tables 2048 tokens wide, as in a graph recorded for a long max_model_len, hold contexts of
    1 to 1000 tokens: every split count gives the reference's result."""
    q, k_cache, v_cache, tables, seq_lens, scale = decode_inputs(case, torch.float32, table_blocks=128)
    got = paged_attention_triton.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale, num_splits=num_splits)
    expected = paged_attention.paged_decode_attention(
        q, k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0), tables, seq_lens, scale
    )
    assert_matches(got, expected)


@pytest.fixture
def split_sums(monkeypatch) -> list[torch.Tensor]:
    """The tensors paged_decode_attention makes with torch.empty_like: its per-split softmax sums,
    (batch, heads, splits), which stay 0 for a split that read no context."""
    made, real = [], torch.empty_like

    def recording(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(torch, "empty_like", recording)
    return made


@pytest.mark.parametrize("seq_len, num_splits", [(200, 8), (700, 8), (33, 4), (1000, 5)])
def test_every_split_of_a_short_context_in_a_wide_table_has_work(split_sums, seq_len, num_splits):
    """On a 131k-token model at batch 1, splits cut from the table's width left 8 of 264 programs
    with work; cut from each sequence's own length, a context spreads over every split it fills
    (whole tiles: 32 tokens in float32)."""
    q, k_cache, v_cache, tables, _, scale = decode_inputs("gqa2-long", torch.float32, table_blocks=128)
    seq_lens = torch.tensor([seq_len] * 3, device=DEVICE)
    paged_attention_triton.paged_decode_attention(q, k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0), tables, seq_lens, scale,
                                                  num_splits=num_splits)
    (sums,) = split_sums  # (batch, heads, splits)
    working = (sums[0, 0] > 0).sum().item()
    tile = 32
    assert working == min(num_splits, -(-seq_len // tile)), sums[0, 0]


def test_paged_decode_attention_ignores_host_max_seq_len(poisoned_empty):
    """A captured graph replays with other lengths than it was recorded with; the host hint must not matter."""
    q, k_cache, v_cache, tables, seq_lens, scale = decode_inputs("gqa2", torch.float32)
    with_hint = paged_attention_triton.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale, 1)
    without = paged_attention_triton.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale)
    torch.testing.assert_close(with_hint, without, atol=0, rtol=0)


@pytest.mark.cuda
def test_paged_decode_attention_replays_in_a_cuda_graph_with_new_lengths():
    q, k_cache, v_cache, tables, seq_lens, scale = decode_inputs("gqa2", torch.float16)
    static_lens = torch.ones_like(seq_lens)
    paged_attention_triton.paged_decode_attention(q, k_cache, v_cache, tables, static_lens, scale)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention_triton.paged_decode_attention(q, k_cache, v_cache, tables, static_lens, scale)
    static_lens.copy_(seq_lens)
    graph.replay()
    expected = paged_attention.paged_decode_attention(
        q, k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0), tables, seq_lens, scale
    )
    assert_matches(out, expected)


@pytest.mark.parametrize("variant", ["qwen3-qk-norm", "llama-gqa-tied", "deepseek-v3", "deepseek-kimi-layout"])
def test_model_with_triton_kernels_matches_torch_kernels(tiny_model_factory, variant):
    """Prefill logits and greedy decode across block boundaries, GQA, q/k norm or strided rotary."""
    model_dir = tiny_model_factory(variant, num_layers=2)
    prompts = [[5, 9, 13], list(range(20, 34))]
    results = {}
    for kernels in ("torch", "triton"):
        llm = LLM(model=model_dir, dtype="float32", kernels=kernels, kv_cache_tokens=128, max_num_seqs=2)
        if kernels == "triton":  # a CPU stage runs the Triton set too (through the interpreter), not its CPU wing's
            assert llm.engine.pipeline.stages[0].ops.rms_norm is rmsnorm_triton.rms_norm
        outputs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        results[kernels] = [o.token_ids for o in outputs], prompt_logits(llm.engine, list(range(3, 40)))
    assert results["triton"][0] == results["torch"][0]
    torch.testing.assert_close(results["triton"][1], results["torch"][1], atol=1e-5, rtol=0)


def test_triton_kernels_off_a_gpu_without_the_interpreter_are_refused_saying_what_to_do(tiny_model_factory, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # set above for this module's tests without a GPU
    with pytest.raises(ValueError, match=r"^--kernels triton runs graphrt's Triton kernels on CUDA GPUs, and this stage is on the cpu; leave --kernels auto"):
        LLM(model=tiny_model_factory(), dtype="float32", kernels="triton", devices=["cpu"])
