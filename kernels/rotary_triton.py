"""Rotary position embedding in place, as one Triton kernel (reference: `rotary.apply_rotary`).

Neox layout: element i of the first half of head_dim rotates with element i of the second half.
One program handles one token: it reads that token's cos/sin row once and rotates every q and k
head with it in float32 (float64 stays float64), writing back over q and k, which may be strided
views of the fused qkv projection.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(x_ptr, token_stride, head_stride, num_heads, half, token, cos1, sin1, cos2, sin2,
                  HEADS: tl.constexpr, HALF: tl.constexpr, COMPUTE_DTYPE: tl.constexpr):
    heads = tl.arange(0, HEADS)[:, None]
    cols = tl.arange(0, HALF)[None, :]
    mask = (heads < num_heads) & (cols < half)
    first = x_ptr + token.to(tl.int64) * token_stride + heads * head_stride + cols  # (HEADS, HALF)
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + half, mask=mask, other=0.0)
    x1f, x2f = x1.to(COMPUTE_DTYPE), x2.to(COMPUTE_DTYPE)
    tl.store(first, (x1f * cos1 - x2f * sin1).to(x1.dtype), mask=mask)
    tl.store(first + half, (x2f * cos2 + x1f * sin2).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr,
    q_token_stride, q_head_stride, k_token_stride, k_head_stride, table_stride,
    num_q_heads, num_k_heads, half,
    Q_HEADS: tl.constexpr, K_HEADS: tl.constexpr, HALF: tl.constexpr, COMPUTE_DTYPE: tl.constexpr,
):
    token = tl.program_id(0)
    cols = tl.arange(0, HALF)[None, :]
    row = token.to(tl.int64) * table_stride
    in_half = cols < half
    # cos/sin hold each frequency twice (cat(freqs, freqs)); read both halves as the reference does.
    cos1 = tl.load(cos_ptr + row + cols, mask=in_half, other=0.0).to(COMPUTE_DTYPE)
    sin1 = tl.load(sin_ptr + row + cols, mask=in_half, other=0.0).to(COMPUTE_DTYPE)
    cos2 = tl.load(cos_ptr + row + half + cols, mask=in_half, other=0.0).to(COMPUTE_DTYPE)
    sin2 = tl.load(sin_ptr + row + half + cols, mask=in_half, other=0.0).to(COMPUTE_DTYPE)
    _rotate_heads(q_ptr, q_token_stride, q_head_stride, num_q_heads, half, token, cos1, sin1, cos2, sin2,
                  Q_HEADS, HALF, COMPUTE_DTYPE)
    _rotate_heads(k_ptr, k_token_stride, k_head_stride, num_k_heads, half, token, cos1, sin1, cos2, sin2,
                  K_HEADS, HALF, COMPUTE_DTYPE)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: (tokens, heads, head_dim), k: (tokens, kv_heads, head_dim), cos/sin: (tokens, head_dim).

    Rotates q and k in place and returns them. Their last dim must be unit-stride (views of the
    fused qkv output are); cos/sin are float32 tables of the same layout as `rotary_cos_sin`.
    """
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("apply_rotary needs q and k with a unit-stride head_dim")
    num_tokens, num_q_heads, head_dim = q.shape
    cos, sin = cos.contiguous(), sin.contiguous()
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        q, k, cos, sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        num_q_heads, k.shape[1], half,
        Q_HEADS=triton.next_power_of_2(num_q_heads),
        K_HEADS=triton.next_power_of_2(k.shape[1]),
        HALF=triton.next_power_of_2(half),
        COMPUTE_DTYPE=tl.float64 if q.dtype == torch.float64 else tl.float32,
        num_warps=4,
    )
    return q, k
