"""The compiled CPU kernels on what a prefix-cache hit hands them (issue 29): a prefill chunk whose
queries continue after cached blocks, behind decode rows riding along, on q, k and v split out of
the fused q/k/v projection, on any thread count; and the o_proj panel matmul that reads its output.

A hit recomputes only the prompt's last tokens, and every kernel here computes each output row in
one order whatever the rows beside it and the threads, so the hit must give the whole prompt's last
rows to the bit (the blocks it reuses hold a whole number of 16-token query blocks). The grid: GQA
groups 1 to 8, head_dim 32 to 128, 1 to 4 threads, bfloat16 and float32.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from graphrt.kernels.cpu import elementwise as elementwise_cpu
from graphrt.kernels.cpu import paged_attention as paged_attention_cpu
from graphrt.kernels.cpu.linear import can_use_panels, linear, pack_panels
from graphrt.kernels.rotary import RopeConfig, rotary_cos_sin

pytestmark = pytest.mark.usefixtures("built_cpu_kernels")  # tests/conftest.py

CPU = torch.device("cpu")
DTYPES = [pytest.param(dtype, id=str(dtype).removeprefix("torch.")) for dtype in (torch.bfloat16, torch.float32)]
# The same, skipped where this CPU has no panel kernel for the dtype.
PANEL_DTYPES = [
    pytest.param(dtype, id=str(dtype).removeprefix("torch."),
                 marks=pytest.mark.skipif(not can_use_panels(CPU, dtype), reason=f"no panel kernel for {dtype} here"))
    for dtype in (torch.bfloat16, torch.float32)
]
THREADS = [1, 2, 3, 4]
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16  # SmolLM2-135M
PROMPT_LEN = 37  # the issue's chat prompt


@contextmanager
def threads(num_threads: int):
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def cache_with_context(seq_lens, kv_heads, head_dim, dtype, generator, extra_blocks=2):
    """Caches holding each sequence's context in scattered blocks (NaN everywhere else, so a read
    of a wrong block shows) and the block table, as a slice of a wider table (rows not
    `max_blocks` apart), with block 0 (scratch) past each row's live blocks."""
    max_blocks = max(-(-n // BLOCK_SIZE) for n in seq_lens)
    num_blocks = 1 + max_blocks * len(seq_lens) + extra_blocks
    k_cache = torch.full((num_blocks, BLOCK_SIZE, kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    free = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    wide = torch.zeros(len(seq_lens), max_blocks + 3, dtype=torch.int64)
    for row, seq_len in enumerate(seq_lens):
        for b in range(-(-seq_len // BLOCK_SIZE)):
            block = free.pop()
            wide[row, 1 + b] = block
            filled = min(BLOCK_SIZE, seq_len - b * BLOCK_SIZE)
            for cache in (k_cache, v_cache):
                cache[block, :filled] = torch.randn(filled, kv_heads, head_dim, generator=generator).to(dtype)
    return k_cache, v_cache, wide[:, 1 : 1 + max_blocks]


def split_q(tokens, heads, kv_heads, head_dim, dtype, generator):
    """q as the model has it: a view of the fused (tokens, q + k + v) projection's output, its
    rows (q + 2 kv) * head_dim apart."""
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype)
    return qkv[:, : heads * head_dim].view(tokens, heads, head_dim)


def exact_attention(q, k_cache, v_cache, tables, query_lens, seq_lens, scale):
    """Each sequence alone, in float64 from the (rounded) inputs."""
    heads, kv_heads, head_dim = q.shape[1], k_cache.shape[2], q.shape[2]
    out, start = [], 0
    for row, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        positions = torch.arange(seq_len)
        slots = tables[row, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        keys, values = (c.double().view(-1, kv_heads, head_dim)[slots].repeat_interleave(heads // kv_heads, 1)
                        for c in (k_cache, v_cache))
        scores = torch.einsum("qhd,khd->hqk", q[start : start + query_len].double(), keys) * scale
        query_positions = torch.arange(seq_len - query_len, seq_len)
        scores = scores.masked_fill(positions[None, :] > query_positions[:, None], float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), values))
        start += query_len
    return torch.cat(out)


def prefill(q, k_cache, v_cache, tables, query_lens, seq_lens):
    """The chunk as a CPU stage attends it: leading one-token rows on the compiled decode kernel,
    the rest on the compiled prompt kernel."""
    return paged_attention_cpu.paged_prefill_attention(
        q, k_cache, v_cache, tables, query_lens, seq_lens, q.shape[-1] ** -0.5,
        decode_attention=paged_attention_cpu.paged_decode_attention,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prefix", [16, 32])
def test_a_prefix_hit_attends_its_rows_bitwise_as_the_whole_prompt_did(dtype, prefix):
    generator = torch.Generator().manual_seed(prefix)
    k_cache, v_cache, tables = cache_with_context([PROMPT_LEN], KV_HEADS, HEAD_DIM, dtype, generator)
    q = split_q(PROMPT_LEN, HEADS, KV_HEADS, HEAD_DIM, dtype, generator)
    for num_threads in THREADS:
        with threads(num_threads):
            whole = prefill(q, k_cache, v_cache, tables, [PROMPT_LEN], [PROMPT_LEN])
            hit = prefill(q[prefix:], k_cache, v_cache, tables, [PROMPT_LEN - prefix], [PROMPT_LEN])
        assert torch.equal(hit, whole[prefix:]), f"{num_threads} threads"
    expected = exact_attention(q, k_cache, v_cache, tables, [PROMPT_LEN], [PROMPT_LEN], HEAD_DIM**-0.5)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 2e-5
    torch.testing.assert_close(whole.double(), expected, rtol=tolerance, atol=tolerance)


# heads, kv_heads, head_dim: GQA groups 1, 2, 3, 4, 8 (a group past the decode kernel's 4-head tile)
SHAPES = [(4, 4, 32), (4, 2, 128), (9, 3, 64), (16, 4, 64), (8, 1, 64)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda shape: "heads{}-kv{}-dim{}".format(*shape))
def test_continuations_behind_riders_match_exact_attention_on_any_thread_count(shape, dtype):
    heads, kv_heads, head_dim = shape
    # Two decode rows riding along, then continuations after 32 and 16 cached tokens (5 queries,
    # under one query block; 17, one past it) and a whole 3-token prompt.
    query_lens, seq_lens = [1, 1, 5, 17, 3], [9, 40, 37, 33, 3]
    generator = torch.Generator().manual_seed(heads * head_dim)
    k_cache, v_cache, tables = cache_with_context(seq_lens, kv_heads, head_dim, dtype, generator)
    q = split_q(sum(query_lens), heads, kv_heads, head_dim, dtype, generator)
    outs = []
    for num_threads in THREADS:
        with threads(num_threads):
            outs.append(prefill(q, k_cache, v_cache, tables, query_lens, seq_lens))
    assert all(torch.equal(out, outs[0]) for out in outs[1:])
    expected = exact_attention(q, k_cache, v_cache, tables, query_lens, seq_lens, head_dim**-0.5)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 2e-5
    torch.testing.assert_close(outs[0].double(), expected, rtol=tolerance, atol=tolerance)


def attention_block(hidden_qkv, positions, k_cache, v_cache, tables, slots, query_lens, seq_lens, o_proj):
    """A decoder layer's attention half as a CPU stage runs it on compiled kernels and an o_proj in
    panels, from the fused projection's output (tokens, q + k + v) to o_proj's (tokens, hidden)."""
    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    q, k, v = hidden_qkv.split([q_size, kv_size, kv_size], dim=-1)
    cos, sin = rotary_cos_sin(RopeConfig(theta=100000.0), HEAD_DIM, 64)
    q, k = elementwise_cpu.apply_rotary(
        q.view(-1, HEADS, HEAD_DIM), k.view(-1, KV_HEADS, HEAD_DIM), cos[positions], sin[positions]
    )
    paged_attention_cpu.write_kv(k, v.view(-1, KV_HEADS, HEAD_DIM), k_cache, v_cache, slots)
    attn = prefill(q, k_cache, v_cache, tables, query_lens, seq_lens)
    return linear(attn.reshape(-1, q_size), o_proj)


@pytest.mark.parametrize("dtype", PANEL_DTYPES)
def test_the_issue_29_path_gives_a_prefix_hit_the_whole_prompts_last_rows(dtype):
    """The whole prompt into one cache; then, in a cache holding only its first two blocks, the
    last 5 tokens alone, written into a fresh block that held another prompt's tokens."""
    generator = torch.Generator().manual_seed(29)
    qkv = torch.randn(PROMPT_LEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=generator).to(dtype)
    o_proj = pack_panels((torch.randn(576, HEADS * HEAD_DIM, generator=generator) * 0.04).to(dtype))
    positions = torch.arange(PROMPT_LEN)
    cache_shape = (6, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    prefix = 2 * BLOCK_SIZE
    for num_threads in THREADS:
        with threads(num_threads):
            k_whole, v_whole = torch.zeros(cache_shape, dtype=dtype), torch.zeros(cache_shape, dtype=dtype)
            tables = torch.tensor([[3, 1, 4]])
            slots = tables[0, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
            whole = attention_block(qkv, positions, k_whole, v_whole, tables, slots, [PROMPT_LEN], [PROMPT_LEN], o_proj)

            k_hit, v_hit = (torch.randn(cache_shape, generator=generator).to(dtype) for _ in range(2))
            k_hit[[3, 1]], v_hit[[3, 1]] = k_whole[[3, 1]], v_whole[[3, 1]]  # the cached blocks
            hit_tables = torch.tensor([[3, 1, 5]])
            rest = positions[prefix:]
            hit_slots = hit_tables[0, rest // BLOCK_SIZE] * BLOCK_SIZE + rest % BLOCK_SIZE
            hit = attention_block(qkv[prefix:], rest, k_hit, v_hit, hit_tables, hit_slots,
                                  [PROMPT_LEN - prefix], [PROMPT_LEN], o_proj)
        assert torch.equal(k_hit[5, :5], k_whole[4, :5]) and torch.equal(v_hit[5, :5], v_whole[4, :5])
        assert torch.equal(hit, whole[prefix:]), f"{num_threads} threads"
    assert whole.isfinite().all()


@pytest.mark.parametrize("dtype", PANEL_DTYPES)
def test_panel_rows_of_a_wider_tensor_are_each_rows_own_on_any_thread_count(dtype):
    """o_proj's x from rows that are not in_features apart, at row counts off every tile height:
    each row's result is the bits it gets alone, contiguous, on one thread."""
    generator = torch.Generator().manual_seed(5)
    weight = pack_panels((torch.randn(576, 576, generator=generator) * 0.04).to(dtype))
    x = torch.randn(PROMPT_LEN, 576 + 40, generator=generator).to(dtype)[:, 24:600]
    with threads(1):
        alone = torch.cat([linear(x[row : row + 1].contiguous(), weight) for row in range(PROMPT_LEN)])
    for num_threads in THREADS:
        with threads(num_threads):
            for first, rows in ((0, PROMPT_LEN), (32, 5), (3, 13), (36, 1), (1, 7)):
                rows_of = slice(first, first + rows)
                assert torch.equal(linear(x[rows_of], weight), alone[rows_of]), f"{num_threads} threads, rows {rows_of}"
