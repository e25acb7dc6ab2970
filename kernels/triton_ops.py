"""The Triton kernel set: the decode hot path and the fused mixture of experts in Triton, prefill attention from the torch reference.

Importing this module imports triton. With `TRITON_INTERPRET=1` set before that, the same kernels
run on CPU tensors through Triton's interpreter, which is how the tests check them.
"""

from __future__ import annotations

import torch.nn.functional as F

from graphrt.kernels import activation_triton, mla_triton, moe_triton, paged_attention_triton, rmsnorm_triton, rotary_triton
from graphrt.kernels.kernel_set import KernelSet

TRITON = KernelSet(
    name="triton",
    rms_norm=rmsnorm_triton.rms_norm,
    apply_rotary=rotary_triton.apply_rotary,
    silu_and_mul=activation_triton.silu_and_mul,
    write_kv=paged_attention_triton.write_kv,
    paged_decode_attention=paged_attention_triton.paged_decode_attention,
    paged_prefill_attention=paged_attention_triton.paged_prefill_attention,  # the torch reference: prefill is eager
    linear=F.linear,  # cuBLAS
    gate_up_silu=activation_triton.gate_up_silu,
    paged_latent_decode_attention=mla_triton.paged_latent_decode_attention,
    fused_moe=moe_triton.fused_moe,
)
