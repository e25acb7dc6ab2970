"""Kernels for the decode hot path, each beside its plain torch reference.

The torch references define the semantics and run on the CPU; Triton versions with the same
signatures run on CUDA. A stage calls them through the `KernelSet` chosen by `--kernels`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

from graphrt.kernels import activation, paged_attention, rmsnorm, rotary
from graphrt.kernels.rotary import rotary_cos_sin

KERNEL_CHOICES = ("auto", "torch", "triton")


@dataclass(frozen=True)
class KernelSet:
    name: str
    rms_norm: Callable
    apply_rotary: Callable
    silu_and_mul: Callable
    write_kv: Callable
    paged_decode_attention: Callable
    paged_prefill_attention: Callable


TORCH = KernelSet(
    name="torch",
    rms_norm=rmsnorm.rms_norm,
    apply_rotary=rotary.apply_rotary,
    silu_and_mul=activation.silu_and_mul,
    write_kv=paged_attention.write_kv,
    paged_decode_attention=paged_attention.paged_decode_attention,
    paged_prefill_attention=paged_attention.paged_prefill_attention,
)


def mode_from_env(name: str, modes: tuple[str, ...], environ: Mapping[str, str]) -> str:
    """The mode an environment variable forces (GRAPHRT_MATMUL, GRAPHRT_CPU_KERNELS): one of `modes`,
    case-insensitive; unset or empty is "auto". Raises ValueError naming the variable."""
    mode = environ.get(name, "auto").strip().lower() or "auto"
    if mode not in modes:
        raise ValueError(f"{name} must be one of {', '.join(modes)}, got {environ[name]!r}")
    return mode


def kernel_set(name: str, device_type: str) -> KernelSet:
    """`auto` is triton on CUDA and torch elsewhere."""
    if name not in KERNEL_CHOICES:
        raise ValueError(f"kernels {name!r} is not one of {', '.join(KERNEL_CHOICES)}")
    if name == "auto":
        name = "triton" if device_type == "cuda" else "torch"
    if name == "torch":
        return TORCH
    from graphrt.kernels import triton_ops  # imports triton, which a CPU-only install may lack

    return triton_ops.TRITON


__all__ = ["KERNEL_CHOICES", "TORCH", "KernelSet", "kernel_set", "mode_from_env", "rotary_cos_sin"]
