"""Fused Mixture-of-Experts in Triton (reference: `moe.fused_moe`), shaped so a CUDA graph can hold it.

Each token's top-k choices make T * K token-expert pairs (pair p = t * K + k). `moe_align` sorts
the pairs by expert and pads each expert's run to a whole number of BLOCK_M-row blocks, on the
device, into buffers whose size depends only on (T, K, E, BLOCK_M): the most blocks any routing can
need. How many of them are in use is a device tensor, never read on the host, so one captured
launch is valid for every routing a replay brings. Then:

1. gate/up: one program per (block, tile of inter columns) multiplies the block's rows of hidden by
   its expert's gate and up weights and writes silu(gate) * up, in hidden's dtype, per pair;
2. down: one program per (block, tile of hidden columns) multiplies those rows by the expert's down
   weight and scales each row by its routing weight, in float32 (float64 stays float64), per pair;
3. the sum over k of each token's K rows, in a fixed order (deterministic, unlike atomics).

A program whose block is past the blocks in use returns before it reads anything, and every block
in use belongs to an expert that at least one pair chose, so an expert no row chose has none of
its weights read. Blocks are 16 rows for decode-sized batches and 64 past that; tile sizes and
warps are untuned guesses until benchmarked on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

ALIGN_CHUNK = 64  # pairs per program in the alignment kernels: a (64, 64) compare for ranks within a chunk


@dataclass(frozen=True)
class ExpertBlocks:
    """The token-expert pairs sorted by expert, padded per expert to whole blocks of `block_m` rows."""

    sorted_pair_ids: torch.Tensor  # (max_blocks * block_m,) int32: a pair id, or num_pairs in a padding slot
    block_experts: torch.Tensor  # (max_blocks,) int32: each block's expert, -1 past the blocks in use
    num_valid_blocks: torch.Tensor  # (1,) int32: blocks in use, the first ones
    block_m: int


@dataclass(frozen=True)
class MoeTiles:
    """Tile sizes of the grouped GEMMs; `block_m` is also the alignment's block."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            size = getattr(self, name)
            if size < 16 or size & (size - 1):
                raise ValueError(f"MoeTiles.{name} is {size}: it must be a power of two of at least 16 (tl.dot's smallest tile)")


def max_num_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most blocks any routing of `num_pairs` pairs can fill: every pair, plus up to block_m - 1
    padding slots for each expert that has a pair (at most min(experts, pairs) of them)."""
    return (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m


def default_tiles(num_pairs: int, num_experts: int, dtype: torch.dtype) -> MoeTiles:
    """16-row blocks while experts average at most 32 pairs (decode: less padding), 64 past that."""
    block_m = 16 if num_pairs <= 32 * num_experts else 64
    if dtype in (torch.float16, torch.bfloat16):
        return MoeTiles(block_m, block_n=64, block_k=64)
    return MoeTiles(block_m, block_n=64, block_k=32)  # float32 / float64 tiles take twice the bytes


# -- alignment ------------------------------------------------------------------------------------


def moe_align_reference(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """Plain torch twin of `moe_align`: the same buffers, the same order (each expert's pairs in pair
    order), static shapes only."""
    pair_experts = topk_ids.reshape(-1)  # (num_pairs,)
    num_pairs = pair_experts.numel()
    device = topk_ids.device
    max_blocks = max_num_blocks(num_pairs, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, pair_experts, torch.ones_like(pair_experts))  # (experts,)
    blocks_per_expert = (counts + block_m - 1) // block_m
    block_ends = torch.cumsum(blocks_per_expert, 0)  # (experts,)
    first_slot = (block_ends - blocks_per_expert) * block_m
    first_pair = torch.cumsum(counts, 0) - counts  # where each expert's run starts, unpadded
    order = torch.sort(pair_experts, stable=True).indices  # (num_pairs,)
    sorted_experts = pair_experts[order]
    slots = first_slot[sorted_experts] + torch.arange(num_pairs, device=device) - first_pair[sorted_experts]
    sorted_pair_ids = torch.full((max_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids.scatter_(0, slots, order.to(torch.int32))
    blocks = torch.arange(max_blocks, device=device)
    block_experts = torch.searchsorted(block_ends, blocks, right=True)  # the expert whose blocks hold b
    num_valid_blocks = block_ends[-1:]
    block_experts = torch.where(blocks < num_valid_blocks, block_experts, -1)
    return ExpertBlocks(sorted_pair_ids, block_experts.to(torch.int32), num_valid_blocks.to(torch.int32), block_m)


@triton.jit
def _count_chunk_kernel(topk_ids_ptr, chunk_counts_ptr, num_pairs, CHUNK: tl.constexpr, EXPERTS_PAD: tl.constexpr):
    chunk = tl.program_id(0)
    pairs = chunk * CHUNK + tl.arange(0, CHUNK)
    experts = tl.load(topk_ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
    lanes = tl.arange(0, EXPERTS_PAD)
    counts = tl.sum((experts[:, None] == lanes[None, :]).to(tl.int32), axis=0)  # (EXPERTS_PAD,)
    tl.store(chunk_counts_ptr + chunk * EXPERTS_PAD + lanes, counts)


@triton.jit
def _block_layout_kernel(
    chunk_counts_ptr, chunk_slots_ptr, block_experts_ptr, num_valid_blocks_ptr,
    num_chunks, num_experts, max_blocks,
    BLOCK_M: tl.constexpr, EXPERTS_PAD: tl.constexpr, BLOCKS_TILE: tl.constexpr,
):
    lanes = tl.arange(0, EXPERTS_PAD)
    counts = tl.zeros([EXPERTS_PAD], dtype=tl.int32)
    for chunk in range(num_chunks):
        counts += tl.load(chunk_counts_ptr + chunk * EXPERTS_PAD + lanes)
    counts = tl.where(lanes < num_experts, counts, 0)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    block_ends = tl.cumsum(blocks, axis=0)  # (EXPERTS_PAD,); lanes past the experts end at the total
    num_valid = tl.sum(blocks, axis=0)
    tl.store(num_valid_blocks_ptr, num_valid)
    # A chunk's pairs of expert e start after e's padded start and the pairs earlier chunks gave e.
    slot = (block_ends - blocks) * BLOCK_M
    for chunk in range(num_chunks):
        tl.store(chunk_slots_ptr + chunk * EXPERTS_PAD + lanes, slot)
        slot += tl.load(chunk_counts_ptr + chunk * EXPERTS_PAD + lanes)
    for first_block in range(0, max_blocks, BLOCKS_TILE):
        block = first_block + tl.arange(0, BLOCKS_TILE)
        # Block b belongs to the expert whose blocks end first after b: count the ends at or before b.
        expert = tl.sum((block_ends[None, :] <= block[:, None]).to(tl.int32), axis=1)
        tl.store(block_experts_ptr + block, tl.where(block < num_valid, expert, -1), mask=block < max_blocks)


@triton.jit
def _scatter_pairs_kernel(
    topk_ids_ptr, chunk_slots_ptr, sorted_pair_ids_ptr, num_pairs, num_experts,
    CHUNK: tl.constexpr, EXPERTS_PAD: tl.constexpr,
):
    chunk = tl.program_id(0)
    lane = tl.arange(0, CHUNK)
    pairs = chunk * CHUNK + lane
    experts = tl.load(topk_ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
    is_pair = (pairs < num_pairs) & (experts >= 0) & (experts < num_experts)  # never a slot out of bounds
    # The pair's rank among the chunk's earlier pairs of its expert keeps each run in pair order,
    # so the layout is deterministic and equals the reference's stable sort.
    earlier_same = (experts[:, None] == experts[None, :]) & (lane[None, :] < lane[:, None])
    rank = tl.sum(earlier_same.to(tl.int32), axis=1)  # (CHUNK,)
    first = tl.load(chunk_slots_ptr + chunk * EXPERTS_PAD + experts, mask=is_pair, other=0)
    tl.store(sorted_pair_ids_ptr + first + rank, pairs.to(tl.int32), mask=is_pair)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """Sort the (tokens, top_k) pairs by expert and pad each expert to whole blocks, on the device.

    Four launches (a fill and three kernels), no host sync, buffers sized by `max_num_blocks`.
    topk_ids must lie in [0, num_experts); a pair outside it is dropped rather than written out of
    bounds. Same result as `moe_align_reference`.
    """
    pair_experts = topk_ids.reshape(-1)  # (num_pairs,)
    if pair_experts.stride(0) != 1:
        pair_experts = pair_experts.contiguous()
    num_pairs = pair_experts.numel()
    if num_pairs == 0:  # no program to launch: a grid of none is an error
        return moe_align_reference(topk_ids, num_experts, block_m)
    device = topk_ids.device
    max_blocks = max_num_blocks(num_pairs, num_experts, block_m)
    num_chunks = triton.cdiv(num_pairs, ALIGN_CHUNK)
    experts_pad = triton.next_power_of_2(num_experts)
    chunk_counts = torch.empty(num_chunks, experts_pad, dtype=torch.int32, device=device)
    chunk_slots = torch.empty_like(chunk_counts)
    sorted_pair_ids = torch.full((max_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    block_experts = torch.empty(max_blocks, dtype=torch.int32, device=device)
    num_valid_blocks = torch.empty(1, dtype=torch.int32, device=device)
    _count_chunk_kernel[(num_chunks,)](pair_experts, chunk_counts, num_pairs, CHUNK=ALIGN_CHUNK, EXPERTS_PAD=experts_pad)
    _block_layout_kernel[(1,)](
        chunk_counts, chunk_slots, block_experts, num_valid_blocks,
        num_chunks, num_experts, max_blocks,
        BLOCK_M=block_m, EXPERTS_PAD=experts_pad, BLOCKS_TILE=64,
    )
    _scatter_pairs_kernel[(num_chunks,)](
        pair_experts, chunk_slots, sorted_pair_ids, num_pairs, num_experts, CHUNK=ALIGN_CHUNK, EXPERTS_PAD=experts_pad
    )
    return ExpertBlocks(sorted_pair_ids, block_experts, num_valid_blocks, block_m)


# -- grouped GEMMs --------------------------------------------------------------------------------


@triton.jit
def _gate_up_kernel(
    hidden_ptr, w_gate_up_ptr, sorted_pair_ids_ptr, block_experts_ptr, num_valid_blocks_ptr, act_ptr,
    num_pairs, hidden_size, inter_size, hidden_stride, w_stride_expert, w_stride_out, w_stride_in,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    if block >= tl.load(num_valid_blocks_ptr):
        return  # a block no routing filled this time: nothing to read
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    pair = tl.load(sorted_pair_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))  # (BLOCK_M,)
    is_pair = pair < num_pairs
    token = (pair // TOP_K).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) of inter
    in_cols = cols < inter_size
    x_rows = hidden_ptr + token[:, None] * hidden_stride
    gate_cols = w_gate_up_ptr + expert * w_stride_expert + cols[None, :].to(tl.int64) * w_stride_out
    up_cols = gate_cols + inter_size * w_stride_out  # up is the second half of the fused weight
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=COMPUTE_DTYPE)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=COMPUTE_DTYPE)
    for first_k in range(0, hidden_size, BLOCK_K):
        ks = first_k + tl.arange(0, BLOCK_K)
        in_k = ks < hidden_size
        x = tl.load(x_rows + ks[None, :], mask=is_pair[:, None] & in_k[None, :], other=0.0)  # (BLOCK_M, BLOCK_K)
        w_mask = in_k[:, None] & in_cols[None, :]
        w_gate = tl.load(gate_cols + ks[:, None] * w_stride_in, mask=w_mask, other=0.0)  # (BLOCK_K, BLOCK_N)
        w_up = tl.load(up_cols + ks[:, None] * w_stride_in, mask=w_mask, other=0.0)
        gate = tl.dot(x, w_gate, gate, input_precision=DOT_PRECISION, out_dtype=COMPUTE_DTYPE)
        up = tl.dot(x, w_up, up, input_precision=DOT_PRECISION, out_dtype=COMPUTE_DTYPE)
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(
        act_ptr + pair.to(tl.int64)[:, None] * inter_size + cols[None, :],
        act.to(act_ptr.dtype.element_ty),
        mask=is_pair[:, None] & in_cols[None, :],
    )


@triton.jit
def _down_kernel(
    act_ptr, w_down_ptr, topk_weights_ptr, sorted_pair_ids_ptr, block_experts_ptr, num_valid_blocks_ptr, expert_out_ptr,
    num_pairs, hidden_size, inter_size, w_stride_expert, w_stride_out, w_stride_in,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    if block >= tl.load(num_valid_blocks_ptr):
        return
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    pair = tl.load(sorted_pair_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))  # (BLOCK_M,)
    is_pair = pair < num_pairs
    act_rows = act_ptr + pair.to(tl.int64)[:, None] * inter_size
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) of hidden
    in_cols = cols < hidden_size
    w_cols = w_down_ptr + expert * w_stride_expert + cols[None, :].to(tl.int64) * w_stride_out
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=COMPUTE_DTYPE)
    for first_k in range(0, inter_size, BLOCK_K):
        ks = first_k + tl.arange(0, BLOCK_K)
        in_k = ks < inter_size
        a = tl.load(act_rows + ks[None, :], mask=is_pair[:, None] & in_k[None, :], other=0.0)  # (BLOCK_M, BLOCK_K)
        w = tl.load(w_cols + ks[:, None] * w_stride_in, mask=in_k[:, None] & in_cols[None, :], other=0.0)  # (BLOCK_K, BLOCK_N)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION, out_dtype=COMPUTE_DTYPE)
    routing_weight = tl.load(topk_weights_ptr + pair, mask=is_pair, other=0.0).to(COMPUTE_DTYPE)  # (BLOCK_M,)
    tl.store(
        expert_out_ptr + pair.to(tl.int64)[:, None] * hidden_size + cols[None, :],
        acc * routing_weight[:, None],
        mask=is_pair[:, None] & in_cols[None, :],
    )


@triton.jit
def _sum_over_topk_kernel(expert_out_ptr, out_ptr, hidden_size, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_cols = cols < hidden_size
    rows = expert_out_ptr + token * TOP_K * hidden_size + cols  # the token's K pairs are rows t*K .. t*K+K-1
    total = tl.load(rows, mask=in_cols, other=0.0)
    for k in tl.static_range(1, TOP_K):  # always k = 0, 1, ...: the same sum for the same inputs
        total += tl.load(rows + k * hidden_size, mask=in_cols, other=0.0)
    tl.store(out_ptr + token * hidden_size + cols, total.to(out_ptr.dtype.element_ty), mask=in_cols)


def _check_shapes(hidden, w_gate_up, w_down, topk_weights, topk_ids) -> None:
    num_tokens, hidden_size = hidden.shape
    num_experts, double_inter, _ = w_gate_up.shape
    expected = {
        "w_gate_up": (w_gate_up.shape, (num_experts, double_inter, hidden_size)),
        "w_down": (w_down.shape, (num_experts, hidden_size, double_inter // 2)),
        "topk_ids": (topk_ids.shape, (num_tokens, topk_ids.shape[-1])),
        "topk_weights": (topk_weights.shape, tuple(topk_ids.shape)),
    }
    for name, (shape, want) in expected.items():
        if tuple(shape) != tuple(want) or double_inter % 2:
            raise ValueError(
                f"fused_moe: {name} is {tuple(shape)}, expected {tuple(want)} for hidden {tuple(hidden.shape)} and "
                f"w_gate_up (experts, 2 * inter, hidden) = {tuple(w_gate_up.shape)}"
            )
    if w_gate_up.dtype != hidden.dtype or w_down.dtype != hidden.dtype:
        raise ValueError(f"fused_moe: weights are {w_gate_up.dtype} / {w_down.dtype}, hidden is {hidden.dtype}: cast them alike")


def fused_moe(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    tiles: MoeTiles | None = None,
) -> torch.Tensor:
    """(tokens, hidden) -> (tokens, hidden): sum_k topk_weights[t, k] * expert e = topk_ids[t, k]'s
    gated MLP of hidden[t]; same contract as `moe.fused_moe`.

    w_gate_up: (experts, 2 * inter, hidden), gate rows first; w_down: (experts, hidden, inter);
    topk_weights: (tokens, top_k) float32 (float64 for a float64 model); topk_ids: (tokens, top_k) int64 in [0, experts], where
    `experts` marks another expert rank's pair: dropped by moe_align, it adds nothing. Only the
    chosen experts' weights are read. `tiles` overrides `default_tiles`.
    """
    _check_shapes(hidden, w_gate_up, w_down, topk_weights, topk_ids)
    num_tokens, hidden_size = hidden.shape
    num_experts, inter_size = w_gate_up.shape[0], w_down.shape[2]
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    out = torch.empty_like(hidden, memory_format=torch.contiguous_format)
    if num_pairs == 0:
        return out
    tiles = tiles or default_tiles(num_pairs, num_experts, hidden.dtype)
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()
    topk_weights = topk_weights.contiguous()  # (tokens, top_k): pair p's weight at p
    blocks = moe_align(topk_ids, num_experts, tiles.block_m)
    max_blocks = blocks.block_experts.shape[0]
    compute_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    compute = dict(
        COMPUTE_DTYPE=tl.float64 if compute_dtype == torch.float64 else tl.float32,
        DOT_PRECISION="ieee",  # float32 models must not silently drop to tf32
        num_warps=tiles.num_warps,
    )
    act = torch.empty(num_pairs, inter_size, dtype=hidden.dtype, device=hidden.device)  # silu(gate) * up per pair
    _gate_up_kernel[(max_blocks, triton.cdiv(inter_size, tiles.block_n))](
        hidden, w_gate_up, blocks.sorted_pair_ids, blocks.block_experts, blocks.num_valid_blocks, act,
        num_pairs, hidden_size, inter_size, hidden.stride(0), *w_gate_up.stride(),
        TOP_K=top_k, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, **compute,
    )
    # weighted, per pair; zeros where moe_align dropped a pair (another expert rank's, id num_experts)
    expert_out = torch.zeros(num_pairs, hidden_size, dtype=compute_dtype, device=hidden.device)
    _down_kernel[(max_blocks, triton.cdiv(hidden_size, tiles.block_n))](
        act, w_down, topk_weights, blocks.sorted_pair_ids, blocks.block_experts, blocks.num_valid_blocks, expert_out,
        num_pairs, hidden_size, inter_size, *w_down.stride(),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, **compute,
    )
    sum_block = min(triton.next_power_of_2(hidden_size), 1024)
    _sum_over_topk_kernel[(num_tokens, triton.cdiv(hidden_size, sum_block))](
        expert_out, out, hidden_size, TOP_K=top_k, BLOCK=sum_block, num_warps=4
    )
    return out
