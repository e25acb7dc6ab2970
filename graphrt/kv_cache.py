"""The paged KV cache: fixed-size blocks, one tensor pair per stage, one host-side allocator.

Every stage holds the same block ids for its own layers, so one allocator on the host serves all
stages. Block 0 is never handed out: padding rows of a micro-batch write there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphrt.config import ModelConfig

SCRATCH_BLOCK = 0


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(
                f"the KV cache needs at least 2 blocks of {block_size} tokens (one is scratch), got {num_blocks}; "
                "raise kv_cache_tokens"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, SCRATCH_BLOCK, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        """Tokens one sequence could hold if it had every usable block."""
        return (self.num_blocks - 1) * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self._free):
            raise RuntimeError(f"asked for {num_blocks} KV blocks with {len(self._free)} free")
        return [self._free.pop() for _ in range(num_blocks)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


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
