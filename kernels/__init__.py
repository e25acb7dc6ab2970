"""Kernels for the decode hot path, each beside its plain torch reference.

The torch references define the semantics and run on the CPU; Triton versions with the same
signatures run on CUDA. A stage calls them through the `KernelSet` chosen by `--kernels`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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


@dataclass(frozen=True)
class ForcedModes:
    """What an environment variable (GRAPHRT_MATMUL, GRAPHRT_CPU_KERNELS) forces, name by name: the
    mode of each name in `by_name` (a weight shape, an op), `default` for the others. "auto" leaves
    a name to be measured."""

    default: str = "auto"
    by_name: Mapping[str, str] = field(default_factory=dict)

    def of(self, name: str) -> str:
        return self.by_name.get(name, self.default)

    def describe(self, names: tuple[str, ...]) -> str:
        """What is forced among `names`, e.g. "o_proj=panel, qkv_proj=packed"; "" if nothing is."""
        return ", ".join(f"{name}={self.of(name)}" for name in names if self.of(name) != "auto")


def as_forced(mode: ForcedModes | str) -> ForcedModes:
    """A bare mode forces it for every name."""
    return mode if isinstance(mode, ForcedModes) else ForcedModes(mode)


def mode_from_env(
    name: str, modes: tuple[str, ...], environ: Mapping[str, str], names: Mapping[str, tuple[str, ...]] | None = None
) -> ForcedModes:
    """What an environment variable forces: a comma-separated list of a mode for every name and of
    NAME=MODE for one, case-insensitive, e.g. GRAPHRT_MATMUL=packed, GRAPHRT_MATMUL=o_proj=panel
    (the other shapes measured) or GRAPHRT_MATMUL=o_proj=panel,packed. `modes` are the modes a bare
    entry may take; `names` the names an entry may give, each with its own modes (default: `modes`).
    Unset or empty is "auto" for all. Raises ValueError naming the variable and what it accepts."""
    text = environ.get(name, "").strip().lower()
    names = names or {}
    default, by_name = "auto", {}
    for entry in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = entry.rpartition("=")
        key, value = key.strip(), value.strip()
        if not key:
            if value not in modes:
                raise ValueError(f"{name} must be one of {', '.join(modes)}, or NAME=MODE entries, got {environ[name]!r}")
            default = value
            continue
        if key not in names:
            raise ValueError(f"{name} names {key!r}, which is not one of {', '.join(names)}; got {environ[name]!r}")
        if value not in names[key]:
            raise ValueError(f"{name}: {key} must be one of {', '.join(names[key])}, got {value!r}")
        by_name[key] = value
    return ForcedModes(default, by_name)


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


__all__ = ["KERNEL_CHOICES", "TORCH", "ForcedModes", "KernelSet", "as_forced", "kernel_set", "mode_from_env", "rotary_cos_sin"]
