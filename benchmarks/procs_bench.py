"""Throughput of stages as processes (--procs) against the same stages in one process.

    python benchmarks/procs_bench.py --pp 2 --requests 16 --input-len 16,64 --output-len 32

Runs the same greedy workload (graphrt.tools.bench.make_workload) on the default model three ways:
one stage in one process, `pp` stages as threads of one process, and `pp` stages as processes
over gloo, and prints output tokens/s and TPOT for each. Each configuration loads fresh.
"""

from __future__ import annotations

import argparse

from graphrt import LLM
from graphrt.tools.bench import make_workload, run_graphrt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--input-len", default="16,64")
    parser.add_argument("--output-len", default="32")
    parser.add_argument("--depth", type=int, default=1)
    args = parser.parse_args()
    span = lambda text: tuple(int(p) for p in (text.split(",") * 2)[:2])  # noqa: E731
    configurations = [("1 process, pp=1", dict(pp=1)), (f"1 process, pp={args.pp}", dict(pp=args.pp)), (f"{args.pp} processes", dict(pp=args.pp, procs=True))]
    print("| configuration | output tok/s | TPOT p50 ms | wall s |\n|---|---|---|---|")
    for name, options in configurations:
        llm = LLM(model=args.model, depth=args.depth, **options)
        workload = make_workload(args.requests, span(args.input_len), span(args.output_len), llm.engine.model_config.vocab_size, seed=0)
        result = run_graphrt(llm, workload)
        llm.engine.close()
        print(f"| {name} | {result.output_tokens / result.seconds:.1f} | {result.tpot_s['p50'] * 1000 if result.tpot_s else float('nan'):.1f} | {result.seconds:.1f} |", flush=True)


if __name__ == "__main__":
    main()
