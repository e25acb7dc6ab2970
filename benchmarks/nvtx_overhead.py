"""Host cost of one NVTX range (push + pop through `Ranges.stage`), as the ring pays it per stage launch.

    python benchmarks/nvtx_overhead.py [--iterations 200000]

Three ways, each in a fresh interpreter because nvtx reads NVTX_DISABLE when it is imported:
- default: `Ranges()` with no profiler attached (what `graphrt serve` does outside Nsight Systems);
- forced: `Ranges(domain=nvtx.get_domain("graphrt"))`, which pushes and pops through the domain
  nvtx hands out without a profiler (a no-op domain), i.e. the cost before ranges were skipped;
- NVTX_DISABLE=1: nvtx switched off by the environment.
An empty loop is subtracted. Under `nsys profile` the real push and pop cost more (a few hundred ns).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

MEASURE = """
import sys, time, nvtx
from graphrt.profiling.nvtx import Ranges
ranges = Ranges(domain=nvtx.get_domain("graphrt")) if sys.argv[1] == "forced" else Ranges()
iterations = int(sys.argv[2])
def loop(body):
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for i in range(iterations):
            body(i)
        best = min(best, time.perf_counter() - start)
    return best
def with_range(i):
    with ranges.stage(i & 3, i & 7, 8):
        pass
def empty(i):
    i & 3, i & 7
print((loop(with_range) - loop(empty)) / iterations * 1e9, ranges.enabled)
"""


def measure(mode: str, iterations: int) -> tuple[float, str]:
    env = {**os.environ, "NVTX_DISABLE": "1"} if mode == "NVTX_DISABLE=1" else {k: v for k, v in os.environ.items() if k != "NVTX_DISABLE"}
    done = subprocess.run([sys.executable, "-c", MEASURE, mode, str(iterations)], env=env, capture_output=True, text=True, check=True)
    ns, enabled = done.stdout.split()
    return float(ns), enabled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=200_000)
    args = parser.parse_args()
    print(f"{'mode':<16} {'ns per range':>12}  pushes")
    for mode in ("default", "forced", "NVTX_DISABLE=1"):
        ns, enabled = measure(mode, args.iterations)
        print(f"{mode:<16} {ns:>12.0f}  {'yes' if enabled == 'True' else 'no'}")


if __name__ == "__main__":
    main()
