"""The seam between the model and its kernels: a `KernelSet` names one implementation of each op a
stage calls. The model runs whichever set it is given, the same code on every device."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class KernelSet:
    name: str
    rms_norm: Callable
    apply_rotary: Callable
    silu_and_mul: Callable
    write_kv: Callable
    paged_decode_attention: Callable
    paged_prefill_attention: Callable
