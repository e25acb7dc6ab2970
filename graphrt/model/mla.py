"""Multi-head latent attention (DeepSeek-V3, Kimi K2) over the paged latent cache.

Per token, one matmul (`qkv_a_proj`: transformers' q_a_proj or q_proj, and kv_a_proj_with_mqa,
stacked) gives the query's low-rank code (or the query itself), the KV latent and the shared rotary
key. The cache keeps only the normalised latent and the rotated key (`MlaConfig.cache_dim` values
per token per layer, 576 for DeepSeek-V3 against 40,960 for its 128 heads' keys and values).

Attention runs in the absorbed form in decode and prefill alike: kv_b_proj holds, per head, W_UK
(latent -> key without rope) and W_UV (latent -> value). A key's non-rotary part is W_UK @ latent,
so q_nope . key_nope = (q_nope @ W_UK) . latent: each head's query moves into the latent space and
attends over the cached rows as they are (kernels/mla.py); the output, a weighted sum of latents,
leaves through W_UV. Nothing is decompressed per context token, which is what makes decode read 576
values per token. (Prefill could decompress instead, fewer FLOPs for long prompts; it does not yet.)

Checkpoints lay the rotary dimensions out in (even, odd) pairs (`rope_interleave`); at load the
rows that make them are reordered into graphrt's two halves, so the one rotary kernel serves.
"""

from __future__ import annotations

import torch
from torch import nn

from graphrt.kernels import KernelSet
from graphrt.kernels.mla import LATENT_NORM_EPS, paged_latent_prefill_attention, write_latent_kv
from graphrt.model.batch import StepMetadata
from graphrt.model.config import ModelConfig


class LatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        mla = cfg.mla
        empty = lambda *shape: nn.Parameter(torch.empty(*shape, device="meta"), requires_grad=False)  # noqa: E731
        self.q_a_size = mla.q_lora_rank or cfg.num_heads * mla.qk_head_dim
        self.qkv_a_proj = empty(self.q_a_size + mla.cache_dim, cfg.hidden_size)
        self.q_a_norm = empty(mla.q_lora_rank) if mla.q_lora_rank else None
        self.q_b_proj = empty(cfg.num_heads * mla.qk_head_dim, mla.q_lora_rank) if mla.q_lora_rank else None
        self.kv_a_norm = empty(mla.kv_lora_rank)
        self.kv_b_proj = empty(cfg.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank)

    @property
    def output_size(self) -> int:
        return self.cfg.num_heads * self.cfg.mla.v_head_dim

    @staticmethod
    def hf_names(cfg: ModelConfig, prefix: str) -> dict[str, list[str]]:
        """Our parameter -> the Hugging Face tensors concatenated (in order) to make it; `prefix` is
        the layer's attention (model.layers.N.self_attn.)."""
        q_first = "q_a_proj" if cfg.mla.q_lora_rank else "q_proj"
        names = {
            "qkv_a_proj": [prefix + f"{q_first}.weight", prefix + "kv_a_proj_with_mqa.weight"],
            "kv_a_norm": [prefix + "kv_a_layernorm.weight"],
            "kv_b_proj": [prefix + "kv_b_proj.weight"],
        }
        if cfg.mla.q_lora_rank:
            names["q_a_norm"] = [prefix + "q_a_layernorm.weight"]
            names["q_b_proj"] = [prefix + "q_b_proj.weight"]
        return names

    def loaded(self) -> None:
        """After loading: put the rotary dimensions of the query and of the key in halves (row
        nope + i of each head takes row nope + halves[i]: pair j's (2j, 2j + 1) go to j and rope/2 + j)."""
        mla = self.cfg.mla
        if not mla.rope_interleave:
            return
        rope = mla.qk_rope_head_dim
        halves = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
        q_rope_start = torch.arange(self.cfg.num_heads)[:, None] * mla.qk_head_dim + mla.qk_nope_head_dim
        q_weight = self.q_b_proj if self.q_b_proj is not None else self.qkv_a_proj  # rows [0, q_a_size) are the query's
        q_weight.data[(q_rope_start + torch.arange(rope)).flatten()] = q_weight.data[(q_rope_start + halves).flatten()]
        k_rope_start = self.q_a_size + mla.kv_lora_rank
        self.qkv_a_proj.data[k_rope_start:] = self.qkv_a_proj.data[k_rope_start + halves]

    def forward(
        self,
        hidden: torch.Tensor,  # (tokens, hidden_size), normalised
        meta: StepMetadata,
        cos: torch.Tensor,  # (tokens, qk_rope_head_dim)
        sin: torch.Tensor,
        cache: torch.Tensor,  # (num_blocks, block_size, 1, cache_dim)
        ops: KernelSet,
    ) -> torch.Tensor:
        """Returns the heads' outputs, (tokens, num_heads * v_head_dim), for o_proj."""
        cfg, mla = self.cfg, self.cfg.mla
        q, latent, k_rope = ops.linear(hidden, self.qkv_a_proj).split(
            [self.q_a_size, mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1
        )
        if self.q_b_proj is not None:
            q, _ = ops.rms_norm(q, self.q_a_norm, LATENT_NORM_EPS)
            q = ops.linear(q, self.q_b_proj)
        q_nope, q_rope = q.reshape(-1, cfg.num_heads, mla.qk_head_dim).split(
            [mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1
        )
        latent, _ = ops.rms_norm(latent, self.kv_a_norm, LATENT_NORM_EPS)
        q_rope, k_rope = ops.apply_rotary(q_rope, k_rope.reshape(-1, 1, mla.qk_rope_head_dim), cos, sin)
        # As in a dense layer, the micro-batch's rows go in before any attention reads.
        write_latent_kv(torch.cat([latent.unsqueeze(1), k_rope], dim=-1), cache, meta.slot_mapping)
        w_uk, w_uv = self.kv_b_proj.view(cfg.num_heads, -1, mla.kv_lora_rank).split(
            [mla.qk_nope_head_dim, mla.v_head_dim], dim=1
        )
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # (tokens, heads, kv_lora_rank)
        q = torch.cat([q_latent, q_rope], dim=-1)
        if meta.is_prefill:
            attn = paged_latent_prefill_attention(
                q, cache, meta.block_tables, meta.query_lens, meta.seq_lens_host, mla.softmax_scale, mla.kv_lora_rank,
                device_seq_lens=meta.seq_lens, decode_attention=ops.paged_latent_decode_attention,
            )
        else:
            attn = ops.paged_latent_decode_attention(
                q, cache, meta.block_tables, meta.seq_lens, mla.softmax_scale, mla.kv_lora_rank, meta.max_seq_len
            )
        out = torch.bmm(attn.transpose(0, 1), w_uv.transpose(1, 2))  # (heads, tokens, v_head_dim)
        return out.transpose(0, 1).reshape(-1, self.output_size)

