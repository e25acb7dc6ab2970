"""`graphrt bench` from two installs, interleaved, medians side by side: a change's before and after.

    python benchmarks/bench_ab.py --before /tmp/base/.venv --after .venv [--rounds 3] -- --requests 32

Each install is a virtual environment with graphrt installed (e.g. `make venv` in a worktree of
the earlier commit: `git worktree add /tmp/base REV && make -C /tmp/base venv`). Arguments after
`--` go to `graphrt bench` for both. Rounds alternate before/after so a machine that slows down
or speeds up during the sitting affects both alike; only the medians mean anything.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

METRICS = {
    "output tok/s": re.compile(r"output ([\d.]+) tok/s"),
    "TTFT p50 ms": re.compile(r"TTFT p50 ([\d.]+) ms"),
    "TPOT p50 ms": re.compile(r"TPOT p50 ([\d.]+) ms"),
}


def run_bench(venv: Path, bench_args: list[str]) -> dict[str, float]:
    result = subprocess.run([str(venv / "bin" / "graphrt"), "bench", *bench_args], capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"graphrt bench in {venv} failed with code {result.returncode}:\n{result.stderr[-2000:]}")
    found = {}
    for name, pattern in METRICS.items():
        match = pattern.search(result.stdout)
        if match is None:
            sys.exit(f"no '{name}' in the output of graphrt bench in {venv}:\n{result.stdout[-2000:]}")
        found[name] = float(match.group(1))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="virtual environment of the earlier graphrt")
    parser.add_argument("--after", type=Path, required=True, help="virtual environment of the later graphrt")
    parser.add_argument("--rounds", type=int, default=3)
    args, bench_args = parser.parse_known_args()
    bench_args = [a for a in bench_args if a != "--"]
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    started = time.monotonic()
    for round_index in range(args.rounds):
        for label, venv in (("before", args.before), ("after", args.after)):
            runs[label].append(run_bench(venv, bench_args))
            print(f"round {round_index + 1} {label}: {runs[label][-1]}", flush=True)
    print(f"\n`graphrt bench {' '.join(bench_args)}`, {args.rounds} rounds interleaved, {time.monotonic() - started:.0f} s; medians:")
    print("| | before | after | after / before |\n|---|---|---|---|")
    for name in METRICS:
        before = statistics.median(r[name] for r in runs["before"])
        after = statistics.median(r[name] for r in runs["after"])
        ratio = f"{after / before:.3f}" if before else "n/a"  # a time under the printed resolution reads 0
        print(f"| {name} | {before:g} | {after:g} | {ratio} |")


if __name__ == "__main__":
    main()
