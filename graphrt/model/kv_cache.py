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

    @staticmethod
    def allocate(
        cfg: ModelConfig, num_layers: int, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype
    ) -> StageKVCache:
        shape = (num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        # zeros, not empty: padding rows read the scratch block, and garbage there could be NaN.
        return StageKVCache(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))


def bytes_per_block(cfg: ModelConfig, num_layers: int, block_size: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
