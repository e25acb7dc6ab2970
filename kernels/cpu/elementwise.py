"""A decoder layer's elementwise ops compiled for the CPU, each one call and one pass
(csrc/elementwise_cpu.cpp, built by extension.py). References, whose contracts these keep:
`rmsnorm.rms_norm`, `rotary.apply_rotary`, `activation.silu_and_mul`, and the sampler's greedy
`argmax.greedy_argmax`.

Each raises RuntimeError with the reason where the kernels can't be built; callers choose them
only where `extension.available(dtype)` (kernels/cpu/kernel_choice.py).
"""

from __future__ import annotations

import torch

from graphrt.kernels import argmax
from graphrt.kernels.cpu.extension import extension


def _ops():
    build = extension()
    if build.library is None:
        raise RuntimeError(f"the compiled CPU kernels are unavailable: {build.reason}")
    return torch.ops.graphrt


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as (rows, last dim) with unit-stride rows, without a copy where its layout allows one."""
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (norm(x + residual) * weight, x + residual); with `residual=None` the sum is x."""
    out, summed = _ops().rms_norm(_rows(x), None if residual is None else _rows(residual), weight, eps)
    if residual is None:
        summed = x  # the op returns an empty sum then
    elif x.dim() != 2:
        summed = summed.view(x.shape)
    return (out if x.dim() == 2 else out.view(x.shape)), summed


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: (tokens, heads, head_dim), k: (tokens, kv_heads, head_dim), cos/sin: (tokens, head_dim)
    float32, rounded to q's dtype as the reference rounds them. Returns new contiguous q and k;
    q and k may be views (e.g. of the fused qkv projection)."""
    return _ops().apply_rotary(q, k, cos, sin)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(tokens, 2 * inter) -> (tokens, inter): silu(gate) * up, gate first as in the fused weight."""
    return _ops().silu_and_mul(_rows(gate_up))


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """(rows, vocab) -> (rows,) int64: the contract of `argmax.greedy_argmax`. The kernel reads
    float32; bfloat16 and float16 logits are made float32 first, as there, and float64 ones (exactness
    tests) go to the reference, which rounds nothing."""
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"greedy_argmax: logits must be (rows, vocab) with vocab >= 1, not {tuple(logits.shape)}")
    if logits.dtype == torch.float64:
        return argmax.greedy_argmax(logits)
    return _ops().greedy_argmax(_rows(logits.float()))


__all__ = ["apply_rotary", "greedy_argmax", "rms_norm", "silu_and_mul"]
