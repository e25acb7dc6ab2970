"""Speculative decoding (ngram) on and off, interleaved: output tok/s and acceptance.

    python benchmarks/spec_decode_bench.py [--workload copy|random] [--concurrency 1] [--requests 8]
                                           [--max-tokens 128] [--rounds 3] [--pp 1] [--model DIR]
                                           [--speculative-config JSON] [--device cpu|cuda] [--dtype D]

`copy`: chat prompts that hand the model a piece of graphrt's own source and ask for it back with
a small edit (the copy-heavy work prompt lookup is for); greedy, up to --max-tokens, ending at EOS.
`random`: `graphrt bench`'s workload of random prompt tokens, --max-tokens each, ignoring EOS.
`--concurrency` requests are in flight at once. Two engines (speculation off, on) take turns for
--rounds rounds; the median output tok/s of each, the spread (min-max), their ratio and the
acceptance are printed, and how many requests got the same greedy tokens from both (exact in
float32; a bfloat16 verify step's larger matmuls may round a near tie the other way).
`--device cuda` puts every stage on the GPU, whose decode and verify steps replay CUDA graphs
(scripts/gpu_check.sh runs it on a random 1B-shaped model, whose greedy output loops, which
prompt lookup copies); without a GPU it says so and exits 3.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time

import torch

from graphrt import LLM, SamplingParams
from graphrt.tools.bench import make_workload

NO_CUDA_EXIT = 3  # what scripts/gpu_check.sh reads as "no CUDA device"

DEFAULT_SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
EDITS = ("Add a one-line comment above its first line.", "Rename its first argument to value.", "Repeat it exactly.")


def copy_prompts(llm: LLM, num_requests: int) -> list[list[int]]:
    """Chat prompts, each a function of graphrt's own source with an edit to make to it."""
    from graphrt.engine import drafter, scheduler, speculation
    from graphrt.runtime import ring

    functions = [ring.build_inputs, drafter.NgramDrafter.propose, speculation.accept_drafts, scheduler.check_lengths, make_workload]
    prompts = []
    for index in range(num_requests):
        source = inspect.getsource(functions[index % len(functions)])
        edit = EDITS[index % len(EDITS)]
        prompts.append(llm.chat_prompt(f"Here is a Python function:\n\n```python\n{source}```\n\n{edit} Answer with the code only."))
    return prompts


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams, concurrency: int) -> tuple[float, list[list[int]]]:
    """Seconds, and each prompt's output tokens, `concurrency` prompts in flight at a time."""
    engine, pending, live, done = llm.engine, list(enumerate(prompts)), [], {}
    start = time.perf_counter()
    while pending or live:
        while pending and len(live) < concurrency:
            index, prompt = pending.pop(0)
            live.append((index, engine.add_request(prompt, params)))
        engine.step()
        for index, seq in [(i, s) for i, s in live if s.finished]:
            done[index] = list(seq.output_ids)
            live.remove((index, seq))
    return time.perf_counter() - start, [done[i] for i in range(len(prompts))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=("copy", "random"), default="copy")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--model", default=None, help="model folder [default: SmolLM2-135M-Instruct]")
    parser.add_argument("--speculative-config", default=json.dumps(DEFAULT_SPECULATIVE))
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="every stage on it [default: the engine's choice]")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"no CUDA device: torch {torch.__version__} sees none (torch.cuda.is_available() is False)")
        return NO_CUDA_EXIT
    devices = [f"{args.device}:0" if args.device == "cuda" else "cpu"] * args.pp if args.device else None
    engines = {
        spec: LLM(model=args.model, pp=args.pp, max_num_seqs=max(args.concurrency, 1), speculative_config=config,
                  devices=devices, dtype=args.dtype)
        for spec, config in (("off", None), ("on", args.speculative_config))
    }
    if args.workload == "copy":
        prompts = copy_prompts(engines["on"], args.requests)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    else:
        vocab = engines["on"].engine.model_config.vocab_size
        prompts = [r.prompt for r in make_workload(args.requests, (16, 256), (1, 1), vocab, seed=0)]
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    for llm in engines.values():  # warm-up: first-call costs don't count
        run(llm, prompts[:1], SamplingParams(max_tokens=4, temperature=0), 1)
    rates: dict[str, list[float]] = {"off": [], "on": []}
    outputs: dict[str, list[list[int]]] = {}
    started = time.monotonic()
    for round_index in range(args.rounds):
        for spec, llm in engines.items():
            before = llm.engine.stats.spec.copy()
            seconds, outputs[spec] = run(llm, prompts, params, args.concurrency)
            tokens = sum(map(len, outputs[spec]))
            rates[spec].append(tokens / seconds)
            line = f"round {round_index + 1}, speculation {spec}: {tokens} tokens in {seconds:.2f} s, {tokens / seconds:.1f} tok/s"
            if spec == "on":
                line += f"; {llm.engine.stats.spec.since(before).describe()}"
            print(line, flush=True)
    median = {spec: statistics.median(values) for spec, values in rates.items()}
    spread = {spec: f"{min(values):.1f}-{max(values):.1f}" for spec, values in rates.items()}
    accepted = engines["on"].engine.stats.spec
    print(
        f"\n{args.workload} workload, {args.requests} requests, concurrency {args.concurrency}, up to {args.max_tokens} "
        f"tokens, pp={args.pp}, {args.rounds} rounds interleaved, {time.monotonic() - started:.0f} s; medians:"
    )
    print("| | speculation off | speculation on | on / off |\n|---|---|---|---|")
    print(f"| output tok/s | {median['off']:.1f} ({spread['off']}) | {median['on']:.1f} ({spread['on']}) | {median['on'] / median['off']:.2f}x |")
    print(f"| acceptance | | {accepted.acceptance_rate:.0%}, {accepted.mean_accepted:.2f} tokens per verify row | |")
    same = sum(a == b for a, b in zip(outputs["off"], outputs["on"]))
    print(f"\ngreedy tokens the same with and without speculation: {same} of {len(prompts)} requests "
          f"({engines['on'].engine.dtype}, {engines['on'].engine.devices[0]})")
    for llm in engines.values():
        llm.engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
