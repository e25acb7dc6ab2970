"""Decode batch sizes that get a graph, and picking one for a batch."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

CPU_DEFAULT_MAX_BATCH = 32
GPU_MAX_BATCH_LIMIT = 256
ASSUMED_TOKENS_PER_SEQUENCE = 1024  # for sizing the default max batch from KV cache memory


def default_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_batch (max_batch itself always included)."""
    buckets = [b for b in (1, 2, 4, 8) if b <= max_batch]
    buckets += list(range(16, max_batch + 1, 8))
    if buckets[-1] != max_batch:
        buckets.append(max_batch)
    return buckets


def default_max_batch(device_type: str, kv_cache_tokens: int) -> int:
    """CPU: 32. CUDA: as many ~1k-token sequences as the KV cache holds, in steps of 8, 8 to 256."""
    if device_type != "cuda":
        return CPU_DEFAULT_MAX_BATCH
    fits = kv_cache_tokens // ASSUMED_TOKENS_PER_SEQUENCE
    return max(8, min(GPU_MAX_BATCH_LIMIT, fits // 8 * 8))


def parse_buckets(text: str) -> list[int]:
    """'1,2,4,8' -> [1, 2, 4, 8]; raises ValueError naming what is wrong."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--buckets must be comma-separated positive integers like 1,2,4,8, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"--buckets must be comma-separated positive integers like 1,2,4,8, got {text!r}")
    return sorted(set(values))


@dataclass(frozen=True)
class BucketPlan:
    sizes: tuple[int, ...]  # ascending

    def __post_init__(self) -> None:
        if not self.sizes or list(self.sizes) != sorted(set(self.sizes)) or self.sizes[0] < 1:
            raise ValueError(f"buckets must be distinct positive sizes in ascending order, got {list(self.sizes)}")

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def bucket_for(self, num_rows: int) -> int:
        """The smallest bucket that holds num_rows (callers never exceed max_batch)."""
        if not 1 <= num_rows <= self.max_batch:
            raise ValueError(f"a decode micro-batch of {num_rows} rows does not fit buckets {list(self.sizes)}")
        return self.sizes[bisect.bisect_left(self.sizes, num_rows)]
