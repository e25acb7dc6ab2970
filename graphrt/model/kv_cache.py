"""The paged KV cache: fixed-size blocks, one tensor pair per stage (the allocator of their ids is
`graphrt.engine.block_allocator`, which the scheduler owns)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphrt.model.config import ModelConfig


@dataclass
class StageKVCache:
    k: torch.Tensor  # (layers, num_blocks, block_size, kv_heads, head_dim)
    v: torch.Tensor
    # A latent attention model's cache (graphrt/model/mla.py) is k alone, (layers, num_blocks,
    # block_size, 1, kv_lora_rank + qk_rope_head_dim); v is a view of its latent columns.

    @staticmethod
    def allocate(
        cfg: ModelConfig, num_layers: int, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype
    ) -> StageKVCache:
        # zeros, not empty: padding rows read the scratch block, and garbage there could be NaN.
        if cfg.mla is not None:
            latent = torch.zeros(num_layers, num_blocks, block_size, 1, cfg.mla.cache_dim, device=device, dtype=dtype)
            return StageKVCache(latent, latent[..., : cfg.mla.kv_lora_rank])
        shape = (num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        return StageKVCache(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))

    @property
    def nbytes(self) -> int:
        """The cache's memory (a latent cache's v is part of its k)."""
        shared = self.v.untyped_storage().data_ptr() == self.k.untyped_storage().data_ptr()
        return self.k.nbytes + (0 if shared else self.v.nbytes)


def values_per_token(cfg: ModelConfig) -> int:
    """What one layer caches per token: keys and values of every KV head, or MLA's latent and rotary key."""
    return cfg.mla.cache_dim if cfg.mla is not None else 2 * cfg.num_kv_heads * cfg.head_dim


def bytes_per_block(cfg: ModelConfig, num_layers: int, block_size: int, dtype: torch.dtype) -> int:
    return num_layers * block_size * values_per_token(cfg) * dtype.itemsize


def describe_token_bytes(cfg: ModelConfig, dtype: torch.dtype) -> str:
    """What a token of context takes in the cache, for the start-up banner."""
    per_token = bytes_per_block(cfg, cfg.num_layers, 1, dtype)
    what = "MLA latent" if cfg.mla is not None else "K and V"
    return f"{per_token / 1024:.1f} KiB a token ({what}: {values_per_token(cfg)} values a layer)"
