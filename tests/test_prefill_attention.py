"""Prefill attention over a chunk that mixes decode rows riding along with prompt pieces, against
attention written out longhand for each sequence alone."""

from __future__ import annotations

import pytest
import torch

from graphrt.kernels.paged_attention import paged_prefill_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 6, 2, 16, 4


def longhand(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first_pos: int, scale: float) -> torch.Tensor:
    """q: (query_len, heads, dim) at positions first_pos...; keys/values: (ctx, kv_heads, dim)."""
    group = HEADS // KV_HEADS
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
    positions = torch.arange(first_pos, first_pos + q.shape[0])
    scores = scores.masked_fill(torch.arange(keys.shape[0])[None, :] > positions[:, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


@pytest.mark.parametrize("query_lens, seq_lens", [
    ([1, 1, 1, 7, 5], [9, 1, 17, 7, 12]),  # three riders (one a 1-token prompt), a whole prompt, a later chunk
    ([1, 1], [3, 20]),  # riders only
    ([4, 1, 1], [4, 6, 8]),  # a one-token row after a prompt piece takes the per-row path
    ([6], [13]),
])
def test_a_mixed_chunk_matches_each_sequence_alone(query_lens, seq_lens):
    generator = torch.Generator().manual_seed(sum(seq_lens))
    max_blocks = max(-(-n // BLOCK_SIZE) for n in seq_lens)
    num_blocks = 1 + max_blocks * len(seq_lens)
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=generator, dtype=torch.float64)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=generator, dtype=torch.float64)
    # Each sequence's blocks scattered over the cache; unused table entries point at scratch block 0.
    order = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    tables = []
    for row, seq_len in enumerate(seq_lens):
        own = order[row * max_blocks : row * max_blocks + -(-seq_len // BLOCK_SIZE)]
        tables.append(own + [0] * (max_blocks - len(own)))
    block_tables = torch.tensor(tables)
    q = torch.randn(sum(query_lens), HEADS, HEAD_DIM, generator=generator, dtype=torch.float64)
    scale = HEAD_DIM**-0.5

    out = paged_prefill_attention(q, k_cache, v_cache, block_tables, query_lens, seq_lens, scale)

    start = 0
    for row, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        slots = [tables[row][pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE for pos in range(seq_len)]
        keys = k_cache.view(-1, KV_HEADS, HEAD_DIM)[slots]
        values = v_cache.view(-1, KV_HEADS, HEAD_DIM)[slots]
        expected = longhand(q[start : start + query_len], keys, values, seq_len - query_len, scale)
        torch.testing.assert_close(out[start : start + query_len], expected, rtol=1e-9, atol=1e-9)
        start += query_len
