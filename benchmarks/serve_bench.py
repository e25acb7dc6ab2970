"""Serving benchmark: streaming completions at several concurrency levels against `graphrt serve`.

    python benchmarks/serve_bench.py [--url http://127.0.0.1:8000] [--concurrency 1,8,32]
                                     [--requests N] [--max-tokens 64] [--api-key KEY]
                                     [--model DIR] [--pp N] [--baseline] [--serve-args='...']

Without --url it starts `graphrt serve --model DIR --pp N` in a subprocess on a free port and
stops it at the end; the load generator runs in this process, so it does not share the server's
interpreter. Each level sends `--requests` requests (default: 2 x concurrency, at least 8) from
that many concurrent clients, each a greedy stream of exactly `--max-tokens` tokens (EOS
ignored). Reported per level: output tokens/s over the level's wall time, and the p50/p90/p99
time to first token (TTFT) and time per output token after the first (TPOT).

`--serve-args` adds options to the server started here (e.g. --serve-args=--no-engine-process to step the
engine on a thread of the server's process). `--baseline` then runs the same requests through `LLM.generate` in this process, with at most
`concurrency` sequences at once, after the server has stopped: the engine alone, the reference
the server's throughput is read against.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works to a ten-year-old.",
    "List some ideas for a rainy weekend at home, with a sentence on each.",
    "Describe the water cycle in a few paragraphs.",
    "What should a new engineer know about pipeline parallelism?",
    "Write a letter to a friend about a trip to the mountains.",
    "Summarise the rules of chess for a beginner.",
    "Give advice on learning to play the guitar as an adult.",
]


@dataclass
class RequestTiming:
    ttft: float  # seconds from sending to the first token
    tpot: float | None  # mean seconds per token after the first
    num_tokens: int


async def one_request(http: httpx.AsyncClient, prompt: str, max_tokens: int) -> RequestTiming:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = last = None
    num_tokens = 0
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode()}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"]:
                last = time.perf_counter()
                first = first or last
    tpot = (last - first) / (num_tokens - 1) if num_tokens > 1 else None
    return RequestTiming(ttft=first - start, tpot=tpot, num_tokens=num_tokens)


async def run_level(url: str, headers: dict, concurrency: int, num_requests: int, max_tokens: int) -> dict:
    queue: asyncio.Queue = asyncio.Queue()
    for index in range(num_requests):
        queue.put_nowait(PROMPTS[index % len(PROMPTS)])
    timings: list[RequestTiming] = []

    async def client(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            timings.append(await one_request(http, queue.get_nowait(), max_tokens))

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600, limits=limits) as http:
        start = time.perf_counter()
        await asyncio.gather(*[client(http) for _ in range(concurrency)])
        wall = time.perf_counter() - start
    return summarise(concurrency, timings, wall)


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def summarise(concurrency: int, timings: list[RequestTiming], wall: float) -> dict:
    ttfts = [t.ttft for t in timings]
    tpots = [t.tpot for t in timings if t.tpot is not None]
    row = {"concurrency": concurrency, "requests": len(timings), "output_tok_s": sum(t.num_tokens for t in timings) / wall}
    for q in (50, 90, 99):
        row[f"ttft_p{q}_ms"] = percentile(ttfts, q) * 1000
        row[f"tpot_p{q}_ms"] = percentile(tpots, q) * 1000
    return row


def engine_tok_s(model: str | None, pp: int, concurrency: int, num_requests: int, max_tokens: int) -> float:
    """The same requests through the offline API, at most `concurrency` sequences at once."""
    from graphrt import LLM, SamplingParams

    llm = LLM(model=model, pp=pp, max_num_seqs=concurrency)
    llm.generate(PROMPTS[0], SamplingParams(max_tokens=2, temperature=0))  # warm-up
    prompts = [PROMPTS[index % len(PROMPTS)] for index in range(num_requests)]
    start = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start)


def start_server(model: str | None, pp: int, extra: list[str]) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "graphrt", "serve", "--port", "0", "--pp", str(pp)] + (["--model", model] if model else []) + extra
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        print(line, end="", file=sys.stderr)
        found = re.search(r"serving \S+ on (http://\S+)", line)
        if found:
            return proc, found.group(1)
    raise RuntimeError(f"graphrt serve exited with code {proc.wait()} before serving")


def markdown_table(rows: list[dict]) -> str:
    baseline = all("engine_tok_s" in r for r in rows)
    lines = [
        "| concurrency | requests | output tok/s | TTFT p50 / p90 / p99 (ms) | TPOT p50 / p90 / p99 (ms) |"
        + (" engine alone tok/s |" if baseline else ""),
        "|---|---|---|---|---|" + ("---|" if baseline else ""),
    ]
    for r in rows:
        lines.append(
            f"| {r['concurrency']} | {r['requests']} | {r['output_tok_s']:.1f} | "
            f"{r['ttft_p50_ms']:.0f} / {r['ttft_p90_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
            f"{r['tpot_p50_ms']:.0f} / {r['tpot_p90_ms']:.0f} / {r['tpot_p99_ms']:.0f} |"
            + (f" {r['engine_tok_s']:.1f} |" if baseline else "")
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=None, help="A running server; default: start `graphrt serve` here.")
    parser.add_argument("--concurrency", default="1,8,32", help="Comma-separated concurrency levels.")
    parser.add_argument("--requests", type=int, default=None, help="Requests per level [default: 2 x concurrency, at least 8].")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--model", default=None, help="Model folder for the server started here and the baseline [default model].")
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--serve-args", default="", help="More options for the server started here, e.g. '--no-engine-process'.")
    parser.add_argument("--baseline", action="store_true", help="Also run the same requests through the engine alone.")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    proc, url = (None, args.url) if args.url else start_server(args.model, args.pp, shlex.split(args.serve_args))
    rows = []
    try:
        asyncio.run(run_level(url, headers, 1, 2, 4))  # warm the server and the client's connections
        for concurrency in levels:
            num_requests = args.requests or max(8, 2 * concurrency)
            rows.append(asyncio.run(run_level(url, headers, concurrency, num_requests, args.max_tokens)))
            print(f"concurrency {concurrency}: {rows[-1]['output_tok_s']:.1f} tok/s", file=sys.stderr)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    if args.baseline:
        for row in rows:
            row["engine_tok_s"] = engine_tok_s(args.model, args.pp, row["concurrency"], row["requests"], args.max_tokens)
    print(markdown_table(rows))
    # other processes on the machine skew every figure; say how busy it was
    print(f"load average (1/5/15 min) at the end: {' / '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
