"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged latent cache: the torch reference.

The cache holds, per token and layer, one row of `latent_dim + rope_dim` values (one "KV head"):
the compressed KV latent (after its RMSNorm) followed by the shared rotary key. Attention runs in
the absorbed form: each query head arrives already projected into the latent space
(q = [q_nope @ W_UK, q_rope], `latent_dim + rope_dim` wide), scores are q . row, and the output is
the probability-weighted sum of the rows' latent part (`latent_dim` wide), which the caller takes
through W_UV. So MLA is multi-query attention whose values are the first `latent_dim` columns of its
keys, and the dense paged attention computes it over a view of the cache.

Cache layout, per layer: (num_blocks, block_size, 1, latent_dim + rope_dim); slots and block 0's
scratch role as in `paged_attention`.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from graphrt.kernels import paged_attention

# The eps of the query's and the latent's norms (q_a_layernorm, kv_a_layernorm): transformers builds
# them with its default, not the model's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def write_latent_kv(kv: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv: (tokens, 1, latent_dim + rope_dim); slot_mapping: (tokens,) int64 flat slot ids."""
    cache.view(-1, *kv.shape[1:]).index_copy_(0, slot_mapping, kv)


def paged_latent_decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    latent_dim: int,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """One query token per sequence. q: (batch, heads, latent_dim + rope_dim); block_tables:
    (batch, max_blocks); seq_lens: (batch,) on the device, tokens of context including the current
    one (at least 1); `max_seq_len` as in `paged_attention.paged_decode_attention`. Returns
    (batch, heads, latent_dim)."""
    return paged_attention.paged_decode_attention(
        q, cache, cache[..., :latent_dim], block_tables, seq_lens, scale, max_seq_len
    )


def paged_latent_prefill_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    scale: float,
    latent_dim: int,
    device_seq_lens: torch.Tensor | None = None,
    decode_attention: Callable = paged_latent_decode_attention,
) -> torch.Tensor:
    """A prompt chunk, as `paged_attention.paged_prefill_attention` (its decode rows through
    `decode_attention`, a function of this module's decode signature). q: (tokens, heads,
    latent_dim + rope_dim). Returns (tokens, heads, latent_dim)."""

    def decode_rows(q, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len):
        return decode_attention(q, k_cache, block_tables, seq_lens, scale, latent_dim, max_seq_len)

    return paged_attention.paged_prefill_attention(
        q, cache, cache[..., :latent_dim], block_tables, query_lens, seq_lens, scale,
        decode_attention=decode_rows, device_seq_lens=device_seq_lens,
    )


def latent_prefill_for(decode_attention: Callable) -> Callable:
    """paged_latent_prefill_attention with its decode rows through `decode_attention`."""
    return functools.partial(paged_latent_prefill_attention, decode_attention=decode_attention)
