"""CPU matmuls three ways: F.linear, oneDNN on a reordered weight, and graphrt's panel kernel.

For float32, `F.linear` calls MKL's sgemm; oneDNN, with each weight reordered once into its blocked
layout ("packed"), runs a decode step's skinny matmuls (1 to 32 rows by 576 to 49152 columns) up
to three times faster on the 2-core AMD EPYC we measure on, and slower on some other CPUs and
shapes. For bfloat16 both go through oneDNN, the packed weight skipping a reorder on every call.
The compiled panel kernel (csrc/matmul_cpu.cpp, "panel") streams a weight packed into panels of 16
columns; at one to eight rows it reads the weight at up to twice oneDNN's rate. Which one a stage
uses is measured per weight shape at load (kernels/cpu/matmul_choice.py). `linear` here runs all three
forms (a dense 2-D tensor, an opaque mkldnn tensor, a 4-D panel tensor); `F.linear` on the dense
weight is the reference.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from graphrt.kernels.cpu import extension
from graphrt.kernels.cpu.info import cpu_bf16_support

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


# A panel is 16 output columns (one AVX-512 register of float32); along in_features it holds
# PANEL_K_STEP[dtype] values per column at each step (a bfloat16 pair feeds one vdpbf16ps).
PANEL_WIDTH = 16
PANEL_K_STEP = {torch.float32: 1, torch.bfloat16: 2}


def can_use_panels(device: torch.device, dtype: torch.dtype, shape: tuple[int, int] | None = None) -> bool:
    """float32 on an AVX-512 CPU, bfloat16 on one with AVX512-BF16, where the compiled kernels
    build and run it; for a weight `shape` (out_features, in_features) also that it cuts into
    whole panels."""
    if device.type != "cpu" or dtype not in PANEL_K_STEP or torch.backends.cpu.get_cpu_capability() != "AVX512":
        return False
    if dtype == torch.bfloat16 and cpu_bf16_support() is None:
        return False
    if shape is not None and (shape[0] % PANEL_WIDTH or shape[1] % PANEL_K_STEP[dtype]):
        return False
    return extension.available(dtype) and _panel_kernel_runs(dtype)


@functools.cache
def _panel_kernel_runs(dtype: torch.dtype) -> bool:
    """Whether this build of the kernel computes `dtype` (a compiler without AVX512-BF16 support
    builds it without bfloat16), tried once on a tiny matmul."""
    weight = torch.ones(PANEL_WIDTH, 2 * PANEL_K_STEP[dtype], dtype=dtype)
    try:
        out = torch.ops.graphrt.panel_linear(torch.ones(1, weight.shape[1], dtype=dtype), pack_panels(weight), None)
    except RuntimeError:
        return False
    return bool((out == weight.shape[1]).all())


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """(out_features, in_features) -> (out_features / 16, in_features / k_step, 16, k_step): each
    panel of 16 columns stored as one stream, a step of k (a pair for bfloat16) for all 16 at a time."""
    out_features, in_features = weight.shape
    k_step = PANEL_K_STEP[weight.dtype]
    panels = weight.reshape(out_features // PANEL_WIDTH, PANEL_WIDTH, in_features // k_step, k_step)
    return panels.permute(0, 2, 1, 3).contiguous()


def convert(path: str, weight: torch.Tensor) -> torch.Tensor:
    """A dense `weight` in the form `path` (dense, packed or panel; kernels/cpu/matmul_choice.py) reads."""
    if path == "packed":
        return pack_weight(weight)
    if path == "panel":
        return pack_panels(weight)
    return weight


def weight_form(weight: torch.Tensor) -> str:
    """The path a weight was converted for: dense, packed or panel."""
    return "packed" if weight.is_mkldnn else "panel" if weight.dim() == 4 else "dense"


def dense_weight(weight: torch.Tensor) -> torch.Tensor:
    """A weight in any form as the dense (out_features, in_features) tensor it was made from."""
    form = weight_form(weight)
    if form == "packed":
        return weight.to_dense()
    if form == "panel":
        num_panels, steps, width, k_step = weight.shape
        return weight.permute(0, 2, 1, 3).reshape(num_panels * width, steps * k_step)
    return weight


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: (rows, in_features) -> (rows, out_features), for a dense, packed or panel weight."""
    if weight.dim() == 4:
        return torch.ops.graphrt.panel_linear(x if x.stride(-1) == 1 else x.contiguous(), weight, bias)
    if not weight.is_mkldnn:
        return F.linear(x, weight, bias)
    rows = x.shape[0]
    if rows < MIN_ROWS:
        x = torch.cat([x, x.new_zeros(MIN_ROWS - rows, x.shape[1])])
    out = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return out[:rows] if rows < MIN_ROWS else out


def panel_linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu_and_mul(linear(x, weight)) for a gate/up weight in panels (gate columns first), in one
    pass, bitwise what the compiled silu_and_mul computes from the panel matmul's output."""
    return torch.ops.graphrt.panel_linear_silu_and_mul(x if x.stride(-1) == 1 else x.contiguous(), weight)
