"""What a piece of work takes, measured the same way wherever graphrt times itself at start-up."""

from __future__ import annotations

import time
from typing import Callable


def median_seconds(run: Callable[[], object], repeats: int = 3) -> float:
    """Seconds one call of `run` takes: the median of `repeats` calls, after one that warms up.
    `run` must return only when its work is done (synchronize what it launches)."""
    times = []
    for _ in range(1 + repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return sorted(times[1:])[repeats // 2]
