"""`graphrt bench` (or the serving benchmark) from two installs, interleaved, medians side by side:
a change's before and after.

    python benchmarks/bench_ab.py --before /tmp/base/.venv --after .venv [--rounds 3] -- --requests 32
    python benchmarks/bench_ab.py --before /tmp/base/.venv --after .venv --serve -- --concurrency 1,8

Each install is a virtual environment with graphrt installed (e.g. `make venv` in a worktree of
the earlier commit: `git worktree add /tmp/base REV && make -C /tmp/base venv`). Arguments after
`--` go to `graphrt bench` for both, or with `--serve` to `benchmarks/serve_bench.py` (this
checkout's, so both sides get the same load generator), run by each install's python so that the
server it starts is that install's `graphrt serve`. Rounds alternate before/after so a machine
that slows down or speeds up during the sitting affects both alike; only the medians mean anything.
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
    "output tok/s": re.compile(r"([\d.]+) output tokens/s|output ([\d.]+) tok/s"),  # vLLM's Throughput line since 2026-12-08
    "TTFT p50 ms": re.compile(r"TTFT (?:mean [\d.]+ ms, )?p50 ([\d.]+) ms"),  # graphrt before 2026-12-07 printed no mean
    "TPOT p50 ms": re.compile(r"TPOT (?:mean [\d.]+ ms, )?p50 ([\d.]+) ms"),
}
# A row of serve_bench.py's table: concurrency, requests, tok/s, TTFT p50 / p90 / p99, TPOT p50 / p90 / p99.
SERVE_ROW = re.compile(r"^\| (\d+) \| \d+ \| ([\d.]+) \| ([\d.]+) / [\d.]+ / [\d.]+ \| ([\d.]+) / [\d.]+ / [\d.]+ \|", re.M)
SERVE_BENCH = Path(__file__).with_name("serve_bench.py")


def run_bench(venv: Path, bench_args: list[str]) -> dict[str, float]:
    result = subprocess.run([str(venv / "bin" / "graphrt"), "bench", *bench_args], capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"graphrt bench in {venv} failed with code {result.returncode}:\n{result.stderr[-2000:]}")
    found = {}
    for name, pattern in METRICS.items():
        match = pattern.search(result.stdout)
        if match is None:
            sys.exit(f"no '{name}' in the output of graphrt bench in {venv}:\n{result.stdout[-2000:]}")
        found[name] = float(next(group for group in match.groups() if group is not None))
    return found


def run_serve_bench(venv: Path, bench_args: list[str]) -> dict[str, float]:
    """The same metrics for each concurrency level of serve_bench.py, named `c{level} ...`."""
    # From the install's own folder (its checkout, for `make venv`): the server serve_bench.py starts
    # is `python -m graphrt`, which would find the graphrt of the folder it runs in first.
    result = subprocess.run(
        [str(venv / "bin" / "python"), str(SERVE_BENCH), *bench_args], capture_output=True, text=True,
        cwd=venv.resolve().parent,
    )
    rows = SERVE_ROW.findall(result.stdout)
    if result.returncode != 0 or not rows:
        sys.exit(
            f"serve_bench.py under {venv} failed with code {result.returncode} and {len(rows)} table rows:\n"
            f"{result.stdout[-1000:]}\n{result.stderr[-2000:]}"
        )
    found = {}
    for level, tok_s, ttft, tpot in rows:
        found |= {f"c{level} output tok/s": float(tok_s), f"c{level} TTFT p50 ms": float(ttft), f"c{level} TPOT p50 ms": float(tpot)}
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="virtual environment of the earlier graphrt")
    parser.add_argument("--after", type=Path, required=True, help="virtual environment of the later graphrt")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--serve", action="store_true", help="run benchmarks/serve_bench.py, not graphrt bench")
    args, bench_args = parser.parse_known_args()
    bench_args = [a for a in bench_args if a != "--"]
    bench, what = (run_serve_bench, "serve_bench.py") if args.serve else (run_bench, "graphrt bench")
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    started = time.monotonic()
    for round_index in range(args.rounds):
        for label, venv in (("before", args.before), ("after", args.after)):
            runs[label].append(bench(venv, bench_args))
            print(f"round {round_index + 1} {label}: {runs[label][-1]}", flush=True)
    print(f"\n`{what} {' '.join(bench_args)}`, {args.rounds} rounds interleaved, {time.monotonic() - started:.0f} s; medians:")
    print("| | before | after | after / before |\n|---|---|---|---|")
    for name in runs["after"][0]:
        before = statistics.median(r[name] for r in runs["before"])
        after = statistics.median(r[name] for r in runs["after"])
        ratio = f"{after / before:.3f}" if before else "n/a"  # a time under the printed resolution reads 0
        print(f"| {name} | {before:g} | {after:g} | {ratio} |")


if __name__ == "__main__":
    main()
