"""Paged decode attention compiled for the CPU (reference: `paged_attention.paged_decode_attention`).

The kernel (csrc/paged_attention_cpu.cpp, built by cpu_extension.py) reads K/V straight from the
cache through the block tables, where the reference first gathers them into a new tensor, and runs
each (sequence, kv head) on torch's intra-op threads.
"""

from __future__ import annotations

import torch

from graphrt.kernels.cpu_extension import SUPPORTED_DTYPES, extension


def check_inputs(q, k_cache, v_cache, block_tables, seq_lens) -> None:
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables, "seq_lens": seq_lens}
    off_cpu = [name for name, tensor in tensors.items() if tensor.device.type != "cpu"]
    if off_cpu:
        raise ValueError(f"paged_decode_attention (CPU kernel): {', '.join(off_cpu)} not on the CPU; "
                         "use the Triton kernels on CUDA")
    if q.dtype not in SUPPORTED_DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"paged_decode_attention (CPU kernel): q, k_cache, v_cache are {q.dtype}, {k_cache.dtype}, "
                         f"{v_cache.dtype}; they must share one of {SUPPORTED_DTYPES}")
    if block_tables.dtype not in (torch.int32, torch.int64) or seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError("paged_decode_attention (CPU kernel): block_tables and seq_lens must be int32 or int64, "
                         f"not {block_tables.dtype} and {seq_lens.dtype}")
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("paged_decode_attention (CPU kernel): q must be (batch, heads, head_dim) and both caches "
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
    build = extension()
    if build.library is None:
        raise RuntimeError(f"the CPU paged attention kernel is unavailable: {build.reason}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()  # a full copy: callers should not need it
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    return torch.ops.graphrt.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, float(scale))


__all__ = ["paged_decode_attention"]
