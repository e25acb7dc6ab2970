"""Structured outputs: what constraining half the requests with a JSON schema costs in output tok/s,
and how long grammars take to compile.

    python benchmarks/structured_bench.py [--requests 64] [--max-tokens 128] [--rounds 3] [--pp 1]
                                          [--no-async] [--model DIR]
    python benchmarks/structured_bench.py --validate [--schemas 50]

Each request asks the default model for a JSON record (graphrt.tools.schemas: seeded random schemas
of objects, arrays, enums, nested required fields, string patterns, number ranges). `constrained`:
every other request carries its schema as structured_output; `free`: the same requests with none.
The two take turns for --rounds rounds on one engine, all requests submitted at once; the median
output tok/s of each, the spread (min-max) and their ratio are printed. Then every schema's grammar
is compiled once, cold (no cache), and the p50 / p99 of those times printed.

`--validate`: every schema's output through pp 1 and 2, async scheduling on and off, greedy and
sampled, parsed and validated with the `jsonschema` package; the counts of valid outputs printed.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from graphrt import LLM, SamplingParams
from graphrt.engine.grammar import Grammars
from graphrt.sampling_params import StructuredOutput
from graphrt.tools.schemas import random_schema, schema_prompt


def requests(llm: LLM, num: int, max_tokens: int, constrained: bool) -> tuple[list[list[int]], list[SamplingParams]]:
    schemas = [random_schema(random.Random(seed)) for seed in range(num)]
    prompts = [llm.chat_prompt(schema_prompt(schema, index)) for index, schema in enumerate(schemas)]
    params = [
        SamplingParams(
            max_tokens=max_tokens, temperature=0,
            structured_output=StructuredOutput(json=schema) if constrained and index % 2 == 0 else None,
        )
        for index, schema in enumerate(schemas)
    ]
    return prompts, params


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, int]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - start, sum(len(out.token_ids) for out in outs)


def compile_times(llm: LLM, num: int) -> list[float]:
    """Seconds each of `num` distinct schemas takes to compile, on a fresh compiler (none cached)."""
    engine = llm.engine
    grammars = Grammars(engine.model_dir, engine.model_config.vocab_size, sorted(engine.eos_ids))
    grammars.compile(StructuredOutput(regex="warm-up")).wait(120)  # the tokenizer's load is not a compile
    times = []
    for seed in range(1000, 1000 + num):
        spec = StructuredOutput(json=random_schema(random.Random(seed)))
        start = time.perf_counter()
        state = grammars.compile(spec)
        state.wait(120)
        assert state.ready() and state.error is None
        times.append(time.perf_counter() - start)
    grammars.close()
    return times


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def validate(model, num_schemas: int) -> None:
    import jsonschema

    schemas = [random_schema(random.Random(seed)) for seed in range(num_schemas)]
    for pp in (1, 2):
        for async_scheduling in (True, False):
            llm = LLM(model=model, dtype="float32", pp=pp, async_scheduling=async_scheduling, max_num_seqs=32)
            prompts = [llm.chat_prompt(schema_prompt(schema, index)) for index, schema in enumerate(schemas)]
            for temperature in (0.0, 1.0):
                params = [
                    SamplingParams(max_tokens=256, temperature=temperature, seed=index, structured_output=StructuredOutput(json=schema))
                    for index, schema in enumerate(schemas)
                ]
                valid = 0
                for schema, out in zip(schemas, llm.generate(prompts, params)):
                    try:
                        jsonschema.validate(json.loads(out.text), schema)
                        valid += 1
                    except (ValueError, jsonschema.ValidationError) as exc:
                        print(f"  invalid ({type(exc).__name__}): {out.text[:120]!r}")
                print(f"pp {pp}, async {'on' if async_scheduling else 'off'}, temperature {temperature}: {valid}/{num_schemas} valid")
            llm.engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--no-async", action="store_true")
    parser.add_argument("--model", default=None)
    parser.add_argument("--validate", action="store_true")
    parser.add_argument("--schemas", type=int, default=50)
    args = parser.parse_args()
    if args.validate:
        validate(args.model, args.schemas)
        return
    llm = LLM(model=args.model, dtype="float32", pp=args.pp, async_scheduling=not args.no_async, max_num_seqs=args.requests)
    sides = {name: requests(llm, args.requests, args.max_tokens, constrained=name == "constrained") for name in ("free", "constrained")}
    run(llm, *sides["constrained"])  # warm-up: these grammars compile here (compile_times measures other schemas, cold)
    rates: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, (prompts, params) in sides.items():
            seconds, tokens = run(llm, prompts, params)
            rates[name].append(tokens / seconds)
            print(f"{name}: {tokens} tokens in {seconds:.2f} s, {tokens / seconds:.1f} tok/s", flush=True)
    median = {name: statistics.median(values) for name, values in rates.items()}
    for name, values in rates.items():
        print(f"{name}: {median[name]:.1f} tok/s ({min(values):.1f}-{max(values):.1f})")
    print(f"constrained / free: {median['constrained'] / median['free']:.2f}x")
    times = compile_times(llm, args.requests)
    print(f"grammar compile: p50 {percentile(times, 0.5) * 1e3:.1f} ms, p99 {percentile(times, 0.99) * 1e3:.1f} ms over {len(times)} schemas")


if __name__ == "__main__":
    main()
