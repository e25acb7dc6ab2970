"""MLA's decode attention over the paged latent cache in Triton (reference: `mla.paged_latent_decode_attention`).

In the absorbed form every query head attends to the same one row per token, `latent_dim + rope_dim`
wide, whose first `latent_dim` columns are also the value. So one program serves a tile of query
heads at once: it reads each context row once for the whole tile, scores it with tl.dot as two
products (latent columns, then rope columns, each padded to a power of two on its own, so 512 + 64
costs no padding where a 576-wide product would pad to 1024), and multiplies the probabilities by
the very latent tile it scored, so the value is never loaded a second time.

The launch follows `paged_attention_triton.paged_decode_attention`: one program per (head tile,
sequence, split), seq_lens read on the device so that only static tensor shapes shape the launch
and a captured graph replays for any length; softmax online over tiles of context in float32
(float64 stays float64); and, when the head tiles of the batch are too few to fill the GPU, a fixed
number of splits per sequence (that module's `default_num_splits`, from the block table's width, at
most MAX_SPLITS) cut on the device from each sequence's own length, merged by that module's merge
kernel. The head tile is the grid's first axis, so the tiles of one sequence run side by side and
read its rows from L2 rather than once each from memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphrt.kernels import paged_attention_triton
from graphrt.kernels.paged_attention_triton import (
    _context_tile, _decode_merge_kernel, _online_softmax, _split_bounds, _store_split,
)

# The merge kernel holds all of a head's split partials at once, (splits, latent_dim) float32: 32 x 512
# is 64 KiB a program, 48 registers a thread at 8 warps (cuobjdump, sm_90). And with 128 heads each
# split's partials are 256 KiB a sequence, written and read back: the traffic of ~450 cache rows.
MAX_SPLITS = 32


def _latent_tile(dtype: torch.dtype, num_heads: int) -> tuple[int, int, int]:
    """(query heads per program, context tokens per inner-loop step, warps). 16 heads is tl.dot's
    smallest tile; past 16 heads, 32 halve how often each row is read (from L2). For DeepSeek-V3's
    576-wide rows on sm_90 (cuobjdump of what triton 3.6 builds, scripts/triton_aot.py): 16-bit at
    16 heads 153 registers a thread and 56 KiB of shared memory, at 32 heads 196-211 and 75 KiB;
    float32 at 16 heads 186 and 73 KiB; none spilling. 64 heads compile too, at 249 registers: no
    margin. Not yet tuned on a GPU."""
    if dtype in (torch.float16, torch.bfloat16):
        return (16 if num_heads <= 16 else 32), 32, 8
    return 16, 16, 4


@triton.jit
def _latent_decode_split_kernel(
    q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr,
    scale, q_batch_stride, q_head_stride, table_stride, cache_block_stride, cache_token_stride,
    num_heads, latent_dim, rope_dim, block_size,
    HEAD_TILE: tl.constexpr, LATENT_PAD: tl.constexpr, ROPE_PAD: tl.constexpr, TILE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, COMPUTE_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    head_tile = tl.program_id(0)
    seq = tl.program_id(1)
    split = tl.program_id(2)
    start, end = _split_bounds(tl.load(seq_lens_ptr + seq).to(tl.int32), split, NUM_SPLITS, TILE)

    heads = head_tile * HEAD_TILE + tl.arange(0, HEAD_TILE)
    latent = tl.arange(0, LATENT_PAD)
    rope = tl.arange(0, ROPE_PAD)
    head_ok = heads < num_heads
    latent_ok = latent < latent_dim
    rope_ok = rope < rope_dim
    q_rows = q_ptr + seq.to(tl.int64) * q_batch_stride + heads[:, None] * q_head_stride
    q_latent = tl.load(q_rows + latent[None, :], mask=head_ok[:, None] & latent_ok[None, :], other=0.0)
    q_rope = tl.load(q_rows + latent_dim + rope[None, :], mask=head_ok[:, None] & rope_ok[None, :], other=0.0)
    # (HEAD_TILE, LATENT_PAD), (HEAD_TILE, ROPE_PAD); padded heads score 0 everywhere and are never stored

    running_max = tl.full([HEAD_TILE], float("-inf"), COMPUTE_DTYPE)
    running_sum = tl.zeros([HEAD_TILE], COMPUTE_DTYPE)
    acc = tl.zeros([HEAD_TILE, LATENT_PAD], COMPUTE_DTYPE)
    for tile_start in range(start, end, TILE):
        live, rows = _context_tile(block_tables_ptr, seq.to(tl.int64) * table_stride, tile_start, end, block_size,
                                   cache_block_stride, cache_token_stride, TILE)
        rows = cache_ptr + rows
        kv_latent = tl.load(rows[:, None] + latent[None, :], mask=live[:, None] & latent_ok[None, :], other=0.0)
        kv_rope = tl.load(rows[:, None] + latent_dim + rope[None, :], mask=live[:, None] & rope_ok[None, :], other=0.0)
        # (TILE, LATENT_PAD), (TILE, ROPE_PAD)
        scores = tl.dot(q_latent, tl.trans(kv_latent), input_precision=DOT_PRECISION, out_dtype=COMPUTE_DTYPE)
        scores = tl.dot(q_rope, tl.trans(kv_rope), scores, input_precision=DOT_PRECISION, out_dtype=COMPUTE_DTYPE)
        scores = tl.where(live[None, :], scores * scale, float("-inf"))  # (HEAD_TILE, TILE)
        probs, correction, running_max, running_sum = _online_softmax(scores, running_max, running_sum)
        acc = acc * correction[:, None] + tl.dot(
            probs.to(kv_latent.dtype), kv_latent, input_precision=DOT_PRECISION, out_dtype=COMPUTE_DTYPE
        )

    if NUM_SPLITS == 1:
        out_offset = (seq.to(tl.int64) * num_heads + heads[:, None]) * latent_dim + latent[None, :]
        tl.store(out_ptr + out_offset, (acc / running_sum[:, None]).to(q_latent.dtype),
                 mask=head_ok[:, None] & latent_ok[None, :])
    else:
        stat_offset = (seq.to(tl.int64) * num_heads + heads) * NUM_SPLITS + split
        _store_split(partial_out_ptr, partial_max_ptr, partial_sum_ptr, stat_offset, head_ok, latent, latent_ok, latent_dim,
                     running_max, running_sum, acc)


def paged_latent_decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    latent_dim: int,
    max_seq_len: int | None = None,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """One query token per sequence; the contract of `mla.paged_latent_decode_attention`.

    q: (batch, heads, latent_dim + rope_dim), unit-stride last dim; cache: (num_blocks, block_size,
    1, latent_dim + rope_dim), contiguous; block_tables: (batch, max_blocks) int32 or int64;
    seq_lens: (batch,) on the device, at least 1. Returns (batch, heads, latent_dim). `max_seq_len`
    is accepted and ignored: the kernel reads seq_lens on the device. `num_splits` overrides how the
    context is split.
    """
    del max_seq_len  # a host value would tie a captured graph to one step's lengths
    batch, num_heads, row_dim = q.shape
    if q.dtype == torch.float64:  # the JIT passes a float argument as float32: scale in float64 here
        q, scale = q * scale, 1.0
    _, block_size, num_cache_heads, cache_row_dim = cache.shape
    if num_cache_heads != 1 or cache_row_dim != row_dim or not 0 < latent_dim <= row_dim:
        raise ValueError(
            f"paged_latent_decode_attention: q is {tuple(q.shape)} and the cache {tuple(cache.shape)} with latent_dim "
            f"{latent_dim}; expected a cache of (num_blocks, block_size, 1, {row_dim}) and 0 < latent_dim <= {row_dim}"
        )
    if not cache.is_contiguous() or q.stride(-1) != 1:
        raise ValueError("paged_latent_decode_attention needs a contiguous cache and q with a unit-stride last dim")
    head_tile, tile, num_warps = _latent_tile(q.dtype, num_heads)
    num_head_tiles = triton.cdiv(num_heads, head_tile)
    if num_splits is None:  # a sequence's programs are its head tiles, as they are its kv heads there
        max_context = block_tables.shape[1] * block_size
        num_splits = min(MAX_SPLITS, paged_attention_triton.default_num_splits(q, num_head_tiles, max_context))
    compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.empty(batch, num_heads, latent_dim, dtype=q.dtype, device=q.device)
    partial_out = partial_max = partial_sum = out  # never touched with one split
    if num_splits > 1:
        partial_max, partial_sum = torch.empty(2, batch, num_heads, num_splits, dtype=compute_dtype, device=q.device)
        partial_out = torch.empty(batch, num_heads, num_splits, latent_dim, dtype=compute_dtype, device=q.device)
    _latent_decode_split_kernel[(num_head_tiles, batch, num_splits)](
        q, cache, block_tables, seq_lens,
        out, partial_out, partial_max, partial_sum,
        scale, q.stride(0), q.stride(1), block_tables.stride(0), cache.stride(0), cache.stride(1),
        num_heads, latent_dim, row_dim - latent_dim, block_size,
        HEAD_TILE=head_tile, LATENT_PAD=max(16, triton.next_power_of_2(latent_dim)),
        ROPE_PAD=max(16, triton.next_power_of_2(row_dim - latent_dim)), TILE=tile, NUM_SPLITS=num_splits,
        COMPUTE_DTYPE=tl.float64 if compute_dtype == torch.float64 else tl.float32,
        DOT_PRECISION="ieee",  # float32 models must not silently drop to tf32
        num_warps=num_warps,
    )
    if num_splits > 1:
        _decode_merge_kernel[(batch * num_heads,)](
            out, partial_out, partial_max, partial_sum, latent_dim,
            NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits),
            HEAD_DIM=triton.next_power_of_2(latent_dim), num_warps=8,
        )
    return out


__all__ = ["paged_latent_decode_attention"]
