"""The seam between the model and its kernels: a `KernelSet` names one implementation of each op a
stage calls. The model runs whichever set it is given, the same code on every device."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class KernelSet:
    name: str  # what --kernels chose: torch or triton (a CPU stage's set stays "torch", whatever it compiled)
    rms_norm: Callable
    apply_rotary: Callable
    silu_and_mul: Callable
    write_kv: Callable
    paged_decode_attention: Callable
    paged_prefill_attention: Callable
    linear: Callable  # (x, weight, bias=None) -> x @ weight.T + bias, for the weight in whatever form the set keeps it
    gate_up_silu: Callable  # (x, gate_up_weight) -> silu_and_mul(linear(x, gate_up_weight)), in one pass where it can
    # (hidden (T, H), w_gate_up (E, 2I, H), w_down (E, H, I), topk_weights (T, K) float, topk_ids (T, K) int64)
    # -> (T, H): each token's chosen experts' gated MLPs, summed by their weights (kernels/moe.py)
    fused_moe: Callable
    # (q (B, heads, latent + rope), cache (blocks, block_size, 1, latent + rope), block_tables, seq_lens, scale,
    # latent_dim, max_seq_len=None) -> (B, heads, latent): MLA's decode attention in the absorbed form (kernels/mla.py)
    paged_latent_decode_attention: Callable
    # (stage) -> a function running a decode step through all of the stage's layers in one call,
    # (hidden, meta, cos, sin, kv) -> (hidden, residual), or None where it can't run that stage.
    decode_layers: Callable | None = None
    # () -> the hooks a stage's stream runs on its own thread before each piece of work and when it
    # idles (graphrt.runtime.streams.ThreadHooks), or None: a CPU stage sizes that thread's OpenMP
    # team to the cores other processes leave it, and lets the team go while it idles.
    stream_hook: Callable | None = None
