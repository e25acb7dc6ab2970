"""Kernels for the decode hot path, each beside its plain torch reference.

The torch references define the semantics; the model calls them on the CPU. Triton versions with
the same signatures replace them on CUDA.
"""

from graphrt.kernels.activation import silu_and_mul
from graphrt.kernels.paged_attention import paged_decode_attention, paged_prefill_attention, write_kv
from graphrt.kernels.rmsnorm import rms_norm
from graphrt.kernels.rotary import apply_rotary, rotary_cos_sin

__all__ = [
    "apply_rotary",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "rotary_cos_sin",
    "silu_and_mul",
    "write_kv",
]
