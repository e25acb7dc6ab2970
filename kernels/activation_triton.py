"""SiLU-and-mul as one Triton kernel (reference: `activation.silu_and_mul`).

Reads gate and up once, computes silu(gate) * up in float32 (float64 stays float64) and writes the
product once: the (tokens, inter) intermediate that the reference materialises for silu(gate)
never exists.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr, out_ptr, row_stride, inter_size, COMPUTE_DTYPE: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter_size
    gate_ptr = gate_up_ptr + row.to(tl.int64) * row_stride + cols
    gate = tl.load(gate_ptr, mask=mask, other=0.0)
    up = tl.load(gate_ptr + inter_size, mask=mask, other=0.0).to(COMPUTE_DTYPE)
    gate_f = gate.to(COMPUTE_DTYPE)
    out = gate_f / (1.0 + tl.exp(-gate_f)) * up
    tl.store(out_ptr + row.to(tl.int64) * inter_size + cols, out.to(gate.dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(tokens, 2 * inter) -> (tokens, inter): silu(gate) * up, gate first as in the fused weight."""
    inter_size = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * inter_size)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(*gate_up.shape[:-1], inter_size, dtype=gate_up.dtype, device=gate_up.device)
    block = min(triton.next_power_of_2(inter_size), 1024)
    _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(inter_size, block))](
        rows, out, rows.stride(0), inter_size,
        COMPUTE_DTYPE=tl.float64 if gate_up.dtype == torch.float64 else tl.float32,
        BLOCK=block,
        num_warps=4,
    )
    return out


def gate_up_silu(x: torch.Tensor, gate_up_weight: torch.Tensor) -> torch.Tensor:
    """The gated MLP's first half: the fused gate/up matmul on cuBLAS, then silu_and_mul in Triton."""
    return silu_and_mul(torch.nn.functional.linear(x, gate_up_weight))
