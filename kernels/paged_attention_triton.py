"""Paged KV writes and paged decode attention in Triton (reference: `paged_attention`).

Decode attention reads K/V through the block tables and stops at each sequence's `seq_lens`
entry, read on the device: no host value shapes the launch except static tensor shapes, so the
same launch is valid for every step a CUDA graph replays. One program owns one (sequence, kv head)
and one split of the context, and serves all query heads of that GQA group at once, so each K/V
tile is read once per group. Softmax is online over tiles of context, in float32 (float64 stays
float64). When sequences x kv heads is too small to fill the GPU, the context is cut into a fixed
number of splits (chosen from the block table's width, a static shape) whose partial results a
second kernel merges (flash-decoding). Where each split starts is computed on the device from that
sequence's own length, so every split has work whatever the live context, and a captured graph
(whose table is max_model_len wide) replays for any length.

Prefill attention stays the torch reference (`paged_attention.paged_prefill_attention`): prefill
chunks are ragged, run eagerly, and are not on the decode hot path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphrt.kernels.paged_attention import paged_prefill_attention

MIN_TOKENS_PER_SPLIT = 256  # shorter splits add merge work for little gain; a guess until benchmarked on a GPU


def _decode_tile(dtype: torch.dtype) -> tuple[int, int]:
    """(context tokens per inner-loop step, warps): the largest tile that compiles for sm_90 without
    register spills (checked with cuobjdump; not yet tuned on a GPU)."""
    return (64, 8) if dtype in (torch.float16, torch.bfloat16) else (32, 4)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    k_token_stride, k_head_stride, v_token_stride, v_head_stride,
    num_kv_heads, head_dim,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, HEADS)[:, None]
    dims = tl.arange(0, HEAD_DIM)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)
    cache_offset = slot * num_kv_heads * head_dim + heads * head_dim + dims  # cache rows are contiguous
    k = tl.load(k_ptr + token.to(tl.int64) * k_token_stride + heads * k_head_stride + dims, mask=mask)
    v = tl.load(v_ptr + token.to(tl.int64) * v_token_stride + heads * v_head_stride + dims, mask=mask)
    tl.store(k_cache_ptr + cache_offset, k, mask=mask)
    tl.store(v_cache_ptr + cache_offset, v, mask=mask)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v: (tokens, kv_heads, head_dim), unit-stride head_dim; slot_mapping: (tokens,) flat slot ids."""
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("write_kv needs contiguous caches and k, v with a unit-stride head_dim")
    num_tokens, num_kv_heads, head_dim = k.shape
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        num_kv_heads, head_dim,
        HEADS=triton.next_power_of_2(num_kv_heads), HEAD_DIM=triton.next_power_of_2(head_dim),
        num_warps=4,
    )


@triton.jit
def _split_bounds(seq_len, split, NUM_SPLITS: tl.constexpr, TILE: tl.constexpr):
    """[start, end) of this split's tokens. Each sequence's own context is cut into NUM_SPLITS parts
    (whole tiles), read here from the device: a split count chosen from the table's width
    (max_model_len in a graph) would leave all but the first splits idle on a short context."""
    tokens_per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), TILE) * TILE
    start = split * tokens_per_split
    return start, tl.minimum(start + tokens_per_split, seq_len)


@triton.jit
def _context_tile(block_tables_ptr, table_row, tile_start, end, block_size, cache_block_stride, cache_token_stride,
                  TILE: tl.constexpr):
    """The TILE tokens from tile_start: (which are before end, where each one's row starts in the cache
    through the block table row at `table_row`)."""
    tokens = tile_start + tl.arange(0, TILE)
    live = tokens < end
    block_ids = tl.load(block_tables_ptr + table_row + tokens // block_size, mask=live, other=0).to(tl.int64)
    return live, block_ids * cache_block_stride + (tokens % block_size) * cache_token_stride


@triton.jit
def _online_softmax(scores, running_max, running_sum):
    """One tile of (rows, TILE) scores into the running max and sum: (probs, correction for what
    was accumulated, new max, new sum). Masked scores are -inf; every tile has a live one."""
    new_max = tl.maximum(running_max, tl.max(scores, axis=1))
    probs = tl.exp(scores - new_max[:, None])
    correction = tl.exp(running_max - new_max)
    return probs, correction, new_max, running_sum * correction + tl.sum(probs, axis=1)


@triton.jit
def _store_split(partial_out_ptr, partial_max_ptr, partial_sum_ptr, stat_offset, row_ok, dims, dim_ok, head_dim,
                 running_max, running_sum, acc):
    """A split's partial result in the layout `_decode_merge_kernel` reads. An empty split (past
    the end of a short sequence) records max -inf and sum 0: it weighs nothing."""
    tl.store(partial_max_ptr + stat_offset, running_max, mask=row_ok)
    tl.store(partial_sum_ptr + stat_offset, running_sum, mask=row_ok)
    tl.store(partial_out_ptr + stat_offset[:, None] * head_dim + dims[None, :], acc, mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr,
    scale, q_batch_stride, q_head_stride, table_stride,
    cache_block_stride, cache_token_stride, cache_head_stride,
    num_heads, head_dim, block_size,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, TILE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, COMPUTE_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    start, end = _split_bounds(tl.load(seq_lens_ptr + seq).to(tl.int32), split, NUM_SPLITS, TILE)

    group = tl.arange(0, GROUP_PAD)  # query heads sharing this kv head, padded for tl.dot
    dims = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + group
    head_ok = group < GROUP
    dim_ok = dims < head_dim
    q = tl.load(
        q_ptr + seq.to(tl.int64) * q_batch_stride + heads[:, None] * q_head_stride + dims[None, :],
        mask=head_ok[:, None] & dim_ok[None, :], other=0.0,
    )  # (GROUP_PAD, HEAD_DIM)

    running_max = tl.full([GROUP_PAD], float("-inf"), COMPUTE_DTYPE)
    running_sum = tl.zeros([GROUP_PAD], COMPUTE_DTYPE)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], COMPUTE_DTYPE)
    for tile_start in range(start, end, TILE):
        live, rows = _context_tile(block_tables_ptr, seq.to(tl.int64) * table_stride, tile_start, end, block_size,
                                   cache_block_stride, cache_token_stride, TILE)
        rows += kv_head * cache_head_stride
        kv_mask = live[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)  # (TILE, HEAD_DIM)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION, out_dtype=COMPUTE_DTYPE) * scale
        scores = tl.where(live[None, :], scores, float("-inf"))  # (GROUP_PAD, TILE)
        probs, correction, running_max, running_sum = _online_softmax(scores, running_max, running_sum)
        v = tl.load(v_cache_ptr + rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        acc = acc * correction[:, None] + tl.dot(
            probs.to(v.dtype), v, input_precision=DOT_PRECISION, out_dtype=COMPUTE_DTYPE
        )

    if NUM_SPLITS == 1:
        out = acc / running_sum[:, None]
        out_offset = seq.to(tl.int64) * num_heads * head_dim + heads[:, None] * head_dim + dims[None, :]
        tl.store(out_ptr + out_offset, out.to(q.dtype), mask=head_ok[:, None] & dim_ok[None, :])
    else:
        stat_offset = (seq.to(tl.int64) * num_heads + heads) * NUM_SPLITS + split
        _store_split(partial_out_ptr, partial_max_ptr, partial_sum_ptr, stat_offset, head_ok, dims, dim_ok, head_dim,
                     running_max, running_sum, acc)


@triton.jit
def _decode_merge_kernel(
    out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr, head_dim,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # one (sequence, head)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM)
    split_ok = splits < NUM_SPLITS
    split_max = tl.load(partial_max_ptr + row * NUM_SPLITS + splits, mask=split_ok, other=float("-inf"))
    split_sum = tl.load(partial_sum_ptr + row * NUM_SPLITS + splits, mask=split_ok, other=0.0)
    weight = tl.exp(split_max - tl.max(split_max, axis=0))  # split 0 always holds the first token
    partial = tl.load(
        partial_out_ptr + (row * NUM_SPLITS + splits[:, None]) * head_dim + dims[None, :],
        mask=split_ok[:, None] & (dims[None, :] < head_dim), other=0.0,
    )  # (SPLITS_PAD, HEAD_DIM)
    out = tl.sum(partial * weight[:, None], axis=0) / tl.sum(split_sum * weight, axis=0)
    tl.store(out_ptr + row * head_dim + dims, out.to(out_ptr.dtype.element_ty), mask=dims < head_dim)


def default_num_splits(q: torch.Tensor, num_kv_heads: int, max_context: int) -> int:
    """Enough splits for about two programs per SM, and no more than a context of `max_context`
    tokens cut into MIN_TOKENS_PER_SPLIT parts takes.

    Depends only on shapes and the device, never on sequence lengths, so a captured graph stays
    valid; each sequence's context is then cut into that many parts on the device.
    """
    if q.device.type != "cuda":
        return 1
    num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    wanted = triton.cdiv(2 * num_sms, q.shape[0] * num_kv_heads)
    return max(1, min(wanted, max_context // MIN_TOKENS_PER_SPLIT))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int | None = None,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """One query token per sequence; same contract as `paged_attention.paged_decode_attention`.

    q: (batch, heads, head_dim); block_tables: (batch, max_blocks); seq_lens: (batch,) tokens of
    context including the current one (at least 1). `max_seq_len` is accepted and ignored: the
    kernel reads seq_lens on the device. `num_splits` overrides how the context is split.
    """
    del max_seq_len  # a host value would tie a captured graph to one step's lengths
    batch, num_heads, head_dim = q.shape
    if q.dtype == torch.float64:  # the JIT passes a float argument as float32: scale in float64 here
        q, scale = q * scale, 1.0
    _, block_size, num_kv_heads, _ = k_cache.shape
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("paged_decode_attention needs k and v caches of one layout, unit-stride head_dim")
    max_context = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = default_num_splits(q, num_kv_heads, max_context)
    tile, num_warps = _decode_tile(q.dtype)
    group = num_heads // num_kv_heads
    out = torch.empty(batch, num_heads, head_dim, dtype=q.dtype, device=q.device)
    compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if num_splits == 1:
        partial_out = partial_max = partial_sum = out  # never touched
    else:
        partial_max = torch.empty(batch, num_heads, num_splits, dtype=compute_dtype, device=q.device)
        partial_sum = torch.empty_like(partial_max)
        partial_out = torch.empty(batch, num_heads, num_splits, head_dim, dtype=compute_dtype, device=q.device)
    head_dim_pad = triton.next_power_of_2(head_dim)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens,
        out, partial_out, partial_max, partial_sum,
        scale, q.stride(0), q.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_heads, head_dim, block_size,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=max(16, head_dim_pad),
        TILE=tile, NUM_SPLITS=num_splits,
        COMPUTE_DTYPE=tl.float64 if compute_dtype == torch.float64 else tl.float32,
        DOT_PRECISION="ieee",  # float32 models must not silently drop to tf32
        num_warps=num_warps,
    )
    if num_splits > 1:
        _decode_merge_kernel[(batch * num_heads,)](
            out, partial_out, partial_max, partial_sum, head_dim,
            NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim_pad,
            num_warps=4,
        )
    return out


__all__ = ["paged_decode_attention", "paged_prefill_attention", "write_kv"]
