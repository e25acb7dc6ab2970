"""RMSNorm with the residual add fused in."""

from __future__ import annotations

import torch


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (norm(x + residual) * weight, x + residual).

    With `residual=None` the sum is x itself. The statistics are taken in float32 (float64 stays
    float64), then cast back before the weight, as transformers' Llama does, so logits match it.
    """
    if residual is not None:
        x = x + residual
    compute_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = x.to(compute_dtype)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), x
