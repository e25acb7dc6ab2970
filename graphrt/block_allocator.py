"""KV block ids: one host-side allocator for every stage.

Every stage holds the same block ids for its own layers, so one allocator on the host serves all
stages. Block 0 is never handed out: padding rows of a micro-batch write there. The scheduler owns
the allocator; nothing else allocates or frees.
"""

from __future__ import annotations

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
