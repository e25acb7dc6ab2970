"""The torch kernel set: every op as its plain torch reference, which defines the semantics."""

from __future__ import annotations

import torch.nn.functional as F

from graphrt.kernels import activation, mla, moe, paged_attention, rmsnorm, rotary
from graphrt.kernels.kernel_set import KernelSet

TORCH = KernelSet(
    name="torch",
    rms_norm=rmsnorm.rms_norm,
    apply_rotary=rotary.apply_rotary,
    silu_and_mul=activation.silu_and_mul,
    write_kv=paged_attention.write_kv,
    paged_decode_attention=paged_attention.paged_decode_attention,
    paged_prefill_attention=paged_attention.paged_prefill_attention,
    linear=F.linear,
    gate_up_silu=activation.gate_up_silu,
    paged_latent_decode_attention=mla.paged_latent_decode_attention,
    fused_moe=moe.fused_moe,
)
