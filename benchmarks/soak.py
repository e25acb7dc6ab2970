"""Soak: N streaming clients for M minutes against `graphrt serve`, some hanging up mid-stream.

    python benchmarks/soak.py [--clients 32] [--minutes 10] [--hang-up 0.2] [--max-tokens 64]
                              [--model DIR] [--pp N] [--sample-s 5] [--idle-s 5]

Starts `graphrt serve` in a subprocess (as serve_bench.py does), then keeps `--clients` greedy
streams going for `--minutes`; each stream, with probability `--hang-up`, closes its connection
after a few tokens, as a client that gives up would. Every `--sample-s` seconds it reads the
server's resident memory, summed over its processes (the front, its engine process and any stage
processes: the process tree from the server's pid, benchmarks/process_tree.py), and its KV blocks
in use (`/metrics`). Prints RSS at start (after the first minute's warm-up), at one minute and at the end,
the slope over the run after warm-up, the share of that warm-up value the end differs by, the
KV blocks in use once the load stops (0 means every stream, finished or abandoned, gave its
blocks back), and RSS after `--idle-s` idle seconds (five by default).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import threading
import time

import httpx
from process_tree import tree_memory
from serve_bench import PROMPTS, start_server


def rss_mib(pid: int) -> float:
    """Resident memory of the server's processes: `pid` and its descendants, summed."""
    return tree_memory(pid)[0]


async def kv_blocks_used(http: httpx.AsyncClient) -> int:
    text = (await http.get("/metrics")).text
    line = next(line for line in text.splitlines() if line.startswith("graphrt_kv_blocks_used "))
    return int(float(line.split()[1]))


async def stream(http: httpx.AsyncClient, rng: random.Random, max_tokens: int, hang_up: float) -> tuple[int, bool]:
    """One streaming request; returns (tokens read, whether this client hung up)."""
    body = {"prompt": rng.choice(PROMPTS), "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    leave_after = rng.randint(1, max_tokens // 2) if rng.random() < hang_up else None
    tokens = 0
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode()}")
        async for line in response.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                tokens += 1
                if leave_after is not None and tokens >= leave_after:
                    return tokens, True  # leaving the block closes the connection mid-stream
    return tokens, False


ABORTS_LAND_S = 1.0  # aborts of the last hung-up streams land within a step


async def soak(
    url: str, pid: int, clients: int, seconds: float, hang_up: float, max_tokens: int, sample_s: float, idle_s: float
) -> dict:
    deadline = time.monotonic() + seconds
    counts = {"requests": 0, "hung_up": 0, "tokens": 0}
    samples: list[tuple[float, float, int]] = []  # (seconds since start, RSS MiB, KV blocks used)

    async def client(index: int) -> None:
        rng = random.Random(index)
        limits = httpx.Limits(max_connections=1)
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
            while time.monotonic() < deadline:
                tokens, hung_up = await stream(http, rng, max_tokens, hang_up)
                counts["requests"] += 1
                counts["hung_up"] += hung_up
                counts["tokens"] += tokens

    async def sampler(http: httpx.AsyncClient, start: float) -> None:
        while time.monotonic() < deadline:
            samples.append((time.monotonic() - start, rss_mib(pid), await kv_blocks_used(http)))
            print(f"{samples[-1][0]:7.0f} s  RSS {samples[-1][1]:7.1f} MiB  KV blocks {samples[-1][2]}", file=sys.stderr)
            await asyncio.sleep(sample_s)

    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        start = time.monotonic()
        await asyncio.gather(sampler(http, start), *[client(i) for i in range(clients)])
        await asyncio.sleep(ABORTS_LAND_S)
        idle_blocks = await kv_blocks_used(http)
        await asyncio.sleep(max(0.0, idle_s - ABORTS_LAND_S))
    return {**counts, "samples": samples, "idle_kv_blocks": idle_blocks, "idle_rss": rss_mib(pid)}


def slope_mib_per_min(samples: list[tuple[float, float, int]]) -> float:
    """Least-squares slope of RSS over time."""
    xs, ys = [s[0] / 60 for s in samples], [s[1] for s in samples]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread if spread else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--hang-up", type=float, default=0.2, help="Share of streams closed by their client mid-way.")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--model", default=None)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--sample-s", type=float, default=5.0)
    parser.add_argument("--idle-s", type=float, default=5.0, help="Idle seconds after the load before RSS is read again.")
    args = parser.parse_args()
    proc, url = start_server(args.model, args.pp, [])
    # Keep reading the server's output: a full pipe would stop it mid-run.
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    try:
        at_start = rss_mib(proc.pid)
        result = asyncio.run(
            soak(url, proc.pid, args.clients, args.minutes * 60, args.hang_up, args.max_tokens, args.sample_s, args.idle_s)
        )
    finally:
        proc.terminate()
        code = proc.wait(60)
    samples = result["samples"]
    warm = [s for s in samples if s[0] >= 60] or samples
    warmed_up, end = warm[0][1], samples[-1][1]
    print(f"{args.clients} clients, {args.minutes:g} min, {result['requests']} requests "
          f"({result['hung_up']} hung up), {result['tokens']} tokens streamed")
    print(f"RSS: {at_start:.1f} MiB before load, {warmed_up:.1f} MiB at 1 min, {end:.1f} MiB at the end "
          f"({(end - warmed_up) / warmed_up * 100:+.1f}% after warm-up)")
    print(f"RSS slope after warm-up: {slope_mib_per_min(warm):+.2f} MiB/min (whole run {slope_mib_per_min(samples):+.2f}); "
          f"{result['idle_rss']:.1f} MiB after {max(args.idle_s, ABORTS_LAND_S):g} s idle")
    print(f"KV blocks in use once the load stopped: {result['idle_kv_blocks']}; server exit code {code}")
    print(f"load average (1/5/15 min) at the end: {' / '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
