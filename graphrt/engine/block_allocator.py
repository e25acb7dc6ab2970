"""KV block ids: one host-side allocator for every stage, with a prefix cache.

Every stage holds the same block ids for its own layers, so one allocator on the host serves all
stages, local or in other processes. Block 0 is never handed out: padding rows of a micro-batch
write there. The scheduler owns the allocator; nothing else allocates or frees.

Prefix caching (as vLLM's automatic prefix caching): a full block whose K/V is written can be
registered under a key that names its content, the hash of its token ids chained with its
parent block's key (the chain starts from what else changes K/V: the model and its dtype). A
later request whose prompt starts with the same tokens takes a reference on those blocks instead
of computing them again. A block is referenced by every sequence using it; at zero references a
registered block stays cached (evictable) and one never registered is plainly free. Allocation
takes free blocks first, then evicts cached ones, least recently used first; `num_free` counts
both, as either can be handed out. Only full blocks are shared, and nobody writes into a full
block, so sharing needs no copies.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from graphrt.model import SCRATCH_BLOCK


def block_keys(token_ids: list[int], block_size: int, root: bytes, start: int = 0, parent: bytes | None = None) -> list[bytes]:
    """The keys of the full blocks of `token_ids` from block `start` on, `parent` being the key of
    block `start - 1` (the `root` for block 0). A 128-bit BLAKE2 digest: a collision would hand one
    request another's K/V, so the key must not be forgeable the way Python's `hash` of ints is."""
    keys, key = [], parent if start else root
    for begin in range(start * block_size, len(token_ids) - block_size + 1, block_size):
        key = hashlib.blake2b(key + array("q", token_ids[begin : begin + block_size]).tobytes(), digest_size=16).digest()
        keys.append(key)
    return keys


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
        self._refs = [0] * num_blocks
        self._key_of: dict[int, bytes] = {}  # registered block -> its key
        self._block_of: dict[bytes, int] = {}  # key -> registered block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # registered, unreferenced; oldest first
        self.num_queried_tokens = 0  # prefix cache statistics, in tokens
        self.num_hit_tokens = 0

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out: free ones and cached ones nobody references."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Registered blocks nobody references (kept for later hits, evicted when needed)."""
        return len(self._evictable)

    @property
    def num_referenced(self) -> int:
        return sum(1 for refs in self._refs if refs)

    @property
    def capacity_tokens(self) -> int:
        """Tokens one sequence could hold if it had every usable block."""
        return (self.num_blocks - 1) * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > self.num_free:
            raise RuntimeError(f"asked for {num_blocks} KV blocks with {self.num_free} free")
        blocks = []
        for _ in range(num_blocks):
            if self._free:
                block = self._free.pop()
            else:  # evict the least recently used cached block
                block, _ = self._evictable.popitem(last=False)
                del self._block_of[self._key_of.pop(block)]
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; an unreferenced one becomes cached or free."""
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] < 0:
                raise RuntimeError(f"KV block {block} freed more often than it was taken")
            if self._refs[block] == 0:
                if block in self._key_of:
                    self._evictable[block] = None  # the most recently used goes last
                else:
                    self._free.append(block)

    # -- the prefix cache ------------------------------------------------------------------------

    def cached_prefix(self, keys: list[bytes]) -> list[int]:
        """The blocks registered under the longest run of `keys` from the first (nothing taken)."""
        blocks = []
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def num_unreferenced(self, blocks: list[int]) -> int:
        """How many of these cached blocks taking them would remove from `num_free`."""
        return sum(1 for block in blocks if self._refs[block] == 0)

    def take(self, blocks: list[int]) -> None:
        """A reference on each of these cached blocks (see `cached_prefix`)."""
        for block in blocks:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1

    def register(self, block: int, key: bytes) -> None:
        """`block`, referenced and full, holds the K/V its key names; later prompts may reuse it.
        A key already registered (two requests computed the same block at once) keeps its block."""
        if key not in self._block_of and block not in self._key_of:
            self._block_of[key] = block
            self._key_of[block] = key

    def forget_cache(self) -> None:
        """Unregister every block (after a stage failure their contents can't be trusted)."""
        for block in list(self._evictable):
            self._free.append(block)
        self._evictable.clear()
        self._key_of.clear()
        self._block_of.clear()

    def count_lookup(self, queried_tokens: int, hit_tokens: int) -> None:
        self.num_queried_tokens += queried_tokens
        self.num_hit_tokens += hit_tokens
