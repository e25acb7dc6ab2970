"""Paged attention compiled for the CPU: decode (reference: `paged_attention.paged_decode_attention`),
the prompt rows of a prefill chunk (reference: `paged_attention.paged_prefill_attention`) and the
KV cache writes (reference: `paged_attention.write_kv`).

The kernels (csrc/paged_attention_cpu.cpp, built by extension.py) read K/V straight from the
cache through the block tables, where the references first gather them into new tensors, and run
each (sequence, kv head) (a block of 16 query tokens of one, for prefill) on torch's intra-op threads.
"""

from __future__ import annotations

import functools

import torch

from graphrt.kernels import paged_attention as reference
from graphrt.kernels.cpu.extension import SUPPORTED_DTYPES, extension


def check_on_cpu(op: str, tensors: dict[str, torch.Tensor]) -> None:
    """Raises ValueError naming the tensors of `op`'s call that are not on the CPU."""
    off_cpu = [name for name, tensor in tensors.items() if tensor.device.type != "cpu"]
    if off_cpu:
        raise ValueError(f"{op} (CPU kernel): {', '.join(off_cpu)} not on the CPU; use the Triton kernels on CUDA")


def require_build(what: str) -> None:
    """Raises RuntimeError with the reason where the kernels can't be built."""
    build = extension()
    if build.library is None:
        raise RuntimeError(f"the CPU {what} kernel is unavailable: {build.reason}")


def check_inputs(q, k_cache, v_cache, block_tables, seq_lens, op: str = "paged_decode_attention") -> None:
    check_on_cpu(op, {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables, "seq_lens": seq_lens})
    if q.dtype not in SUPPORTED_DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"{op} (CPU kernel): q, k_cache, v_cache are {q.dtype}, {k_cache.dtype}, "
                         f"{v_cache.dtype}; they must share one of {SUPPORTED_DTYPES}")
    if block_tables.dtype not in (torch.int32, torch.int64) or seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op} (CPU kernel): block_tables and seq_lens must be int32 or int64, "
                         f"not {block_tables.dtype} and {seq_lens.dtype}")
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"{op} (CPU kernel): q must be (batch, heads, head_dim) and both caches "
                         f"(num_blocks, block_size, kv_heads, head_dim); got {tuple(q.shape)}, "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """The contract of `paged_attention.paged_decode_attention` (shapes and semantics there).
    `max_seq_len` is not needed: the kernel reads each row's blocks up to its seq_lens entry.
    Raises RuntimeError with the reason where the kernel can't be built."""
    del max_seq_len
    check_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    q, k_cache, v_cache, block_tables = kernel_layout(q, k_cache, v_cache, block_tables)
    return torch.ops.graphrt.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, float(scale))


def paged_latent_decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    latent_dim: int,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """The contract of graphrt.kernels.mla.paged_latent_decode_attention on the compiled decode
    kernel, which takes K and V of one shape: multi-query attention whose values are the whole
    cache row, of which the first `latent_dim` columns are the result (the rotary key's columns
    are summed too, and dropped)."""
    return paged_decode_attention(q, cache, cache, block_tables, seq_lens, scale, max_seq_len)[..., :latent_dim]


def kernel_layout(q, k_cache, v_cache, block_tables) -> tuple[torch.Tensor, ...]:
    """The tensors as the kernels take them (unit-stride rows, caches of one layout), copying only
    what is not; raises RuntimeError with the reason where the kernels can't be built."""
    require_build("paged attention")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()  # a full copy: callers should not need it
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    return q, k_cache, v_cache, block_tables


def prompt_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's query tokens (q's rows, back to back, `query_lens[i]`
    of sequence i, the last of its `seq_lens[i]` context tokens, all already in the cache) over its
    context: (tokens, heads, head_dim), as the reference's per-sequence loop computes it."""
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    check_inputs(q, k_cache, v_cache, block_tables, lens, op="paged_prefill_attention")
    q, k_cache, v_cache, block_tables = kernel_layout(q, k_cache, v_cache, block_tables.to(torch.int64))
    return torch.ops.graphrt.paged_prefill_attention(
        q, k_cache, v_cache, block_tables, torch.tensor(query_lens, dtype=torch.int64), lens, float(scale)
    )


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """The contract of `paged_attention.write_kv`: k, v (tokens, kv_heads, head_dim) into the caches'
    slots. Raises IndexError naming the first slot outside the cache, having written nothing."""
    check_on_cpu("write_kv", {"k": k, "v": v, "k_cache": k_cache, "v_cache": v_cache, "slot_mapping": slot_mapping})
    require_build("KV write")
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    torch.ops.graphrt.write_kv(k, v, k_cache, v_cache, slot_mapping)


# The KernelSet field: the reference's handling of a chunk (riding decode rows through the chosen
# decode attention) with its prompt rows on the kernel.
paged_prefill_attention = functools.partial(reference.paged_prefill_attention, prompt_attention=prompt_attention)


__all__ = ["paged_decode_attention", "paged_latent_decode_attention", "paged_prefill_attention", "prompt_attention", "write_kv"]
