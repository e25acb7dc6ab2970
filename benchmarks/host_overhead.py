"""Host time per stage launch in the ring, measured on synthetic stages.

    python benchmarks/host_overhead.py [--pp 4] [--depth 1] [--requests 32] [--tokens 64] [--no-async-scheduling]

Each stage sleeps `--stage-ms` (so the host is never the bottleneck and never waits long), on a
tiny random Llama (no download). The host's own time is measured around `_launch_next` (pick the
micro-batch, build its metadata, enqueue it on every stage); "per stage launch" divides that by
the number of stages.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from graphrt import LLM, SamplingParams
from graphrt.tools.synthetic import make_synthetic, make_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--depth", type=int, default=1)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--stage-ms", type=float, default=2.0)
    parser.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "tiny", "llama-gqa-tied", num_layers=args.pp)
        llm = LLM(
            model=model_dir, pp=args.pp, depth=args.depth, kv_cache_tokens=16384, buckets=[1, 2, 4, 8, 16],
            async_scheduling=args.async_scheduling,
        )
    engine = make_synthetic(llm.engine, stage_ms=args.stage_ms)
    launch_times: list[float] = []
    launch_next = engine._launch_next

    def timed_launch() -> bool:
        start = time.perf_counter()
        launched = launch_next()
        if launched:
            launch_times.append(time.perf_counter() - start)
        return launched

    engine._launch_next = timed_launch
    prompts = [[i % 90 + 3, 5, 7, 11] for i in range(args.requests)]
    llm.generate(prompts, SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True))
    launched = len(launch_times)
    # The median: on a machine whose cores the stage threads share, a launch that loses its core
    # now and then would otherwise decide the figure.
    per_stage_us = statistics.median(launch_times) / args.pp * 1e6
    scheduling = "async scheduling" if args.async_scheduling else "host in the loop"
    print(f"pp={args.pp} depth={args.depth}, {scheduling}, {args.requests} requests x {args.tokens} tokens, {launched} micro-batches")
    print(f"host time per stage launch: {per_stage_us:.1f} us (median; schedule + metadata + enqueue, divided by {args.pp} stages)")
    print(f"host time per micro-batch launch: median {statistics.median(launch_times) * 1e6:.1f} us, mean {sum(launch_times) / launched * 1e6:.1f} us")
    engine.close()


if __name__ == "__main__":
    main()
