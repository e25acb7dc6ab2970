"""Matmuls against weights reordered once for oneDNN, on the CPU.

For float32, `F.linear` calls MKL's sgemm; oneDNN, with each weight reordered once into its blocked
layout, runs a decode step's skinny matmuls (1 to 32 rows by 576 to 49152 columns) up to three
times faster on the 2-core AMD EPYC we measure on, and slower on some other CPUs and shapes. For
bfloat16 both go through oneDNN, the packed weight skipping a reorder on every call. Which one a
stage uses is measured per weight shape at load (kernels/matmul_choice.py). A packed weight is an
opaque mkldnn tensor: only `linear` here reads it, and `F.linear` on the dense weight is its
reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The layout oneDNN picks depends on the rows it expects; packed for 32 it runs 2 to 512 rows at
# full speed. One row is the exception (oneDNN switches to a layout for vectors and would reorder
# the weight on every call), so `linear` pads a single row to two.
PACKED_FOR_ROWS = 32
MIN_ROWS = 2


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """float32, or bfloat16 where oneDNN computes it, on a CPU whose torch has oneDNN."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    if not (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return False
    bf16_supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return dtype == torch.float32 or (bf16_supported is not None and bool(bf16_supported()))


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """(out_features, in_features) dense -> the same weight in oneDNN's layout (an mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACKED_FOR_ROWS)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: (rows, in_features) -> (rows, out_features), for a dense or a packed weight."""
    if not weight.is_mkldnn:
        return F.linear(x, weight, bias)
    rows = x.shape[0]
    if rows < MIN_ROWS:
        x = torch.cat([x, x.new_zeros(MIN_ROWS - rows, x.shape[1])])
    out = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return out[:rows] if rows < MIN_ROWS else out
