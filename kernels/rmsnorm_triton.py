"""RMSNorm with the residual add fused in, as one Triton kernel (reference: `rmsnorm.rms_norm`).

One program normalises one row: it reads x and the residual once, writes the sum and the normed
row once. The statistics are taken in float32 (float64 stays float64) and the normed row is cast
back to the input dtype before the weight, as the reference and transformers' Llama do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr,
    inner_rows, x_stride_outer, x_stride_inner, residual_stride, hidden_size, eps,
    HAS_RESIDUAL: tl.constexpr, COMPUTE_DTYPE: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    # x may be a strided (outer, inner, hidden) view, e.g. q heads split out of the fused qkv.
    x_offset = (row // inner_rows).to(tl.int64) * x_stride_outer + (row % inner_rows).to(tl.int64) * x_stride_inner
    cols = tl.arange(0, BLOCK)
    in_row = cols < hidden_size
    x = tl.load(x_ptr + x_offset + cols, mask=in_row, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(residual_ptr + row.to(tl.int64) * residual_stride + cols, mask=in_row, other=0.0)
        tl.store(sum_ptr + row.to(tl.int64) * hidden_size + cols, x, mask=in_row)
    h = x.to(COMPUTE_DTYPE)
    h = h * (1.0 / tl.sqrt(tl.sum(h * h, axis=0) / hidden_size + eps))
    weight = tl.load(weight_ptr + cols, mask=in_row, other=0.0)
    tl.store(out_ptr + row.to(tl.int64) * hidden_size + cols, weight * h.to(x.dtype), mask=in_row)


def _as_rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """(x viewed with at most three dims, inner rows per outer row, outer stride, inner stride)."""
    if x.stride(-1) != 1 or x.dim() > 3:
        x = x.reshape(-1, x.shape[-1])
    if x.dim() == 3:
        return x, x.shape[1], x.stride(0), x.stride(1)
    x = x.reshape(-1, x.shape[-1])  # 1-D or 2-D with unit last stride: a view
    return x, 1, x.stride(0), 0


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (norm(x + residual) * weight, x + residual); same contract as `rmsnorm.rms_norm`."""
    hidden_size = x.shape[-1]
    rows, inner_rows, stride_outer, stride_inner = _as_rows(x)
    num_rows = x.numel() // hidden_size
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if residual is None:
        summed, residual_rows = x, out  # the sum is x itself; the residual pointer is never read
    else:
        summed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        residual_rows = residual.reshape(-1, hidden_size)
        if residual_rows.stride(-1) != 1:
            residual_rows = residual_rows.contiguous()
    block = triton.next_power_of_2(hidden_size)
    _rms_norm_kernel[(num_rows,)](
        rows, residual_rows, weight, out, summed,
        inner_rows, stride_outer, stride_inner, residual_rows.stride(0), hidden_size, eps,
        HAS_RESIDUAL=residual is not None,
        COMPUTE_DTYPE=tl.float64 if x.dtype == torch.float64 else tl.float32,
        BLOCK=block,
        num_warps=min(max(block // 512, 1), 16),
    )
    return out, summed
