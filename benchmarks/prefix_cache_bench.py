"""Prefix caching on and off, one workload, one sitting: requests sharing a long system prompt.

    python benchmarks/prefix_cache_bench.py [--requests 64] [--shared-prefix 512] [--input-len 16,64]
                                            [--output-len 16,64] [--rounds 2] [--pp 1] [--model DIR]

Every prompt is the same `--shared-prefix` random tokens followed by its own question, all
submitted at once (`graphrt bench --shared-prefix`'s workload). Two engines, caching off and on,
take turns for `--rounds` rounds; the medians of output throughput and TTFT p50 and their
ratios are printed, with the cache's hit rate. The issue's goal: TTFT p50 at least 3x lower and
output throughput at least 1.5x higher with caching.
"""

from __future__ import annotations

import argparse
import statistics
import time

from graphrt import LLM
from graphrt.tools.bench import make_workload, run_graphrt


def span(text: str) -> tuple[int, int]:
    low, _, high = text.partition(",")
    return int(low), int(high or low)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--shared-prefix", type=int, default=512)
    parser.add_argument("--input-len", default="16,64")
    parser.add_argument("--output-len", default="16,64")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--model", default=None, help="model folder [default: SmolLM2-135M-Instruct]")
    args = parser.parse_args()
    engines = {caching: LLM(model=args.model, pp=args.pp, prefix_caching=caching) for caching in (False, True)}
    vocab = engines[True].engine.model_config.vocab_size
    results: dict[bool, list] = {False: [], True: []}
    started = time.monotonic()
    for round_index in range(args.rounds):
        # A new seed each round: the same prompts again would all be cached from the round before.
        workload = make_workload(args.requests, span(args.input_len), span(args.output_len), vocab, seed=round_index, shared_prefix=args.shared_prefix)
        for caching, llm in engines.items():
            result = run_graphrt(llm, workload)
            results[caching].append(result)
            print(f"round {round_index + 1}, caching {'on' if caching else 'off'}:", *result.lines(), sep="\n", flush=True)
    median = lambda caching, get: statistics.median(get(r) for r in results[caching])  # noqa: E731
    throughput = {c: median(c, lambda r: r.output_tok_s) for c in results}
    ttft = {c: median(c, lambda r: r.ttft_s["p50"]) for c in results}
    hit_rate = median(True, lambda r: r.prefix_hit_rate)
    print(
        f"\n{args.requests} requests, a {args.shared_prefix}-token shared prefix, questions {args.input_len}, outputs "
        f"{args.output_len}, pp={args.pp}, {args.rounds} rounds interleaved, {time.monotonic() - started:.0f} s; medians:"
    )
    print("| | caching off | caching on | on / off |\n|---|---|---|---|")
    print(f"| output tok/s | {throughput[False]:.1f} | {throughput[True]:.1f} | {throughput[True] / throughput[False]:.2f}x |")
    print(f"| TTFT p50 | {ttft[False] * 1000:.0f} ms | {ttft[True] * 1000:.0f} ms | {ttft[False] / ttft[True]:.2f}x lower |")
    print(f"| prefix cache hit rate | | {hit_rate:.1%} | |")


if __name__ == "__main__":
    main()
