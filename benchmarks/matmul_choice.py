"""Does the measured matmul choice pick well? Decode tok/s with every path forced, and with the choice.

    python benchmarks/matmul_choice.py [--dtypes float32,bfloat16] [--rounds 3] [--tokens 64] [--batch 32]

For each dtype, four engines of the default model (or --model): GRAPHRT_MATMUL=dense (F.linear on
every weight), =packed (oneDNN on every weight), =panel (the compiled panel kernel on every weight
that cuts into panels; F.linear where it can't run), and auto (each weight shape on the path the
stage measured fastest at load). Each round runs every engine at batch 1 and at --batch (greedy, EOS
ignored, --tokens new tokens per sequence), engines interleaved, and the table gives each one's
median decode tok/s. auto should be about as fast as the faster forced path at both batch sizes; on
a shared machine only the interleaved medians mean anything. Also prints each engine's matmul line
(a forced path runs F.linear where it can't run) and what each auto engine measured.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from graphrt import LLM, SamplingParams
from graphrt.kernels.cpu.matmul_choice import PATH_NAMES

PROMPT = "Explain pipeline parallelism to a new engineer."


def decode_rate(llm: LLM, prompts: list[list[int]], tokens: int) -> float:
    stats = llm.engine.stats
    decoded, seconds = stats.decode_tokens, stats.decode_seconds
    llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    return (stats.decode_tokens - decoded) / (stats.decode_seconds - seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder [default: SmolLM2-135M-Instruct]")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()

    engines: dict[tuple[str, str], LLM] = {}
    load_s = {}
    for dtype in args.dtypes.split(","):
        for mode in (*PATH_NAMES, "auto"):
            os.environ["GRAPHRT_MATMUL"] = mode
            start = time.perf_counter()
            engines[dtype, mode] = LLM(model=args.model, dtype=dtype, max_batch=args.batch)
            load_s[dtype, mode] = time.perf_counter() - start
    os.environ.pop("GRAPHRT_MATMUL")
    prompt = next(iter(engines.values())).chat_prompt(PROMPT)
    batches = {1: [prompt], args.batch: [prompt[: len(prompt) - i % 7] for i in range(args.batch)]}
    for llm in engines.values():  # warm-up
        decode_rate(llm, batches[1], 4)
    rates: dict[tuple[str, str, int], list[float]] = {}
    for _ in range(args.rounds):
        for key, llm in engines.items():
            for batch, prompts in batches.items():
                rates.setdefault((*key, batch), []).append(decode_rate(llm, prompts, args.tokens))

    print(f"{torch.get_num_threads()} threads, torch {torch.__version__}; median of {args.rounds} interleaved rounds, "
          f"{args.tokens} greedy tokens per sequence")
    print(f"| dtype | matmuls | decode tok/s at batch 1 | at batch {args.batch} | start-up s |")
    print("|---|---|---|---|---|")
    for (dtype, mode), llm in engines.items():
        cells = [f"{statistics.median(rates[dtype, mode, b]):.1f}" for b in batches]
        print(f"| {dtype} | {mode} | {' | '.join(cells)} | {load_s[dtype, mode]:.1f} |")
    for (dtype, mode), llm in engines.items():
        print(f"{dtype} {mode}: {llm.engine.pipeline.matmul_summary()}")  # what a forced path could not run, too
        if mode == "auto":
            plan = llm.engine.pipeline.matmul_plans()[0]
            for choice in plan.choices:
                timed = ", ".join(
                    f"{path} {' / '.join(f'{s * 1e6:.0f}' for s in by_rows.values())} us" for path, by_rows in choice.seconds.items()
                )
                print(f"  {choice.name} {choice.shape}: {choice.path} ({timed} at {' / '.join(map(str, plan.rows))} rows)")


if __name__ == "__main__":
    main()
