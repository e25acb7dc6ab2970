"""Structured outputs: what constraining half the requests with a JSON schema costs in output tok/s,
and how long grammars take to compile.

    python benchmarks/structured_bench.py [--requests 64] [--max-tokens 128] [--rounds 3] [--pp 1]
                                          [--no-async] [--model DIR]
    python benchmarks/structured_bench.py --validate [--stream] [--schemas 50] [--concurrency 8]

Each request asks the default model for a JSON record (graphrt.tools.schemas: seeded random schemas
of objects, arrays, enums, nested required fields, string patterns, number ranges). `constrained`:
every other request carries its schema as structured_output; `free`: the same requests with none.
A third side, `free, cut to the same lengths`, sends the free requests with each one's max_tokens
the length its constrained output reached (EOS ignored): the constrained requests stop where their
JSON ends, so their batch thins out sooner, and this side has the same shape without the grammar.
The sides take turns for --rounds rounds on one engine, all requests submitted at once; the median
output tok/s of each, the spread (min-max) and the ratios are printed. Then every schema's grammar
is compiled once, cold (no cache), and the p50 / p99 of those times printed.

`--validate`: every schema's output through pp 1 and 2, async scheduling on and off, greedy and
sampled, parsed and validated with the `jsonschema` package; the counts of valid outputs printed, and
the exit status 1 if any is invalid. `--validate --stream`: the same requests through `graphrt serve`
(one server per pp / async combination) with the `openai` client, streamed as chat completions under
`response_format` json_schema, `--concurrency` at a time; each output is its deltas joined.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

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


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, list[int]]:
    """Seconds for the requests, all submitted at once, and each one's output tokens."""
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - start, [len(out.token_ids) for out in outs]


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
        assert state.ready() and state.failure is None, state.failure
        times.append(time.perf_counter() - start)
    grammars.close()
    return times


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# Both --validate paths send the same requests, so an invalid streamed output can be checked offline.
VALIDATE_MAX_TOKENS = 256
VALIDATE_TEMPERATURES = (0.0, 1.0)  # greedy; sampled, seeded with the schema's index


def validation_error(text: str, schema: dict) -> str | None:
    """Why `text` is not a JSON value of `schema`, or None if it is."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError) as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return None


def count_valid(schemas: list[dict], texts: list[str], label: str) -> int:
    """How many texts are valid outputs of their schemas; each invalid one printed whole."""
    valid = 0
    for index, (schema, text) in enumerate(zip(schemas, texts)):
        error = validation_error(text, schema)
        if error is None:
            valid += 1
        else:
            print(f"  {label}, schema {index} invalid ({error}): {text!r}\n  schema: {json.dumps(schema)}", flush=True)
    return valid


def validate(model, num_schemas: int) -> list[tuple[int, bool, float, int]]:
    """(pp, async scheduling, temperature, valid outputs) for every combination, through the offline LLM."""
    schemas = [random_schema(random.Random(seed)) for seed in range(num_schemas)]
    rows = []
    for pp in (1, 2):
        for async_scheduling in (True, False):
            llm = LLM(model=model, dtype="float32", pp=pp, async_scheduling=async_scheduling, max_num_seqs=32)
            prompts = [llm.chat_prompt(schema_prompt(schema, index)) for index, schema in enumerate(schemas)]
            for temperature in VALIDATE_TEMPERATURES:
                params = [
                    SamplingParams(
                        max_tokens=VALIDATE_MAX_TOKENS, temperature=temperature, seed=index,
                        structured_output=StructuredOutput(json=schema),
                    )
                    for index, schema in enumerate(schemas)
                ]
                texts = [out.text for out in llm.generate(prompts, params)]
                label = f"pp {pp}, async {'on' if async_scheduling else 'off'}, temperature {temperature}"
                rows.append((pp, async_scheduling, temperature, count_valid(schemas, texts, label)))
                print(f"{label}: {rows[-1][3]}/{num_schemas} valid", flush=True)
            llm.engine.close()
    return rows


def streamed_text(client, model_id: str, schema: dict, index: int, temperature: float) -> str:
    """The content of one streamed chat completion under `schema`, its deltas joined."""
    stream = client.chat.completions.create(
        model=model_id,
        messages=[{"role": "user", "content": schema_prompt(schema, index)}],
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": f"record_{index}", "schema": schema, "strict": True}},
        temperature=temperature,
        seed=index,
        max_tokens=VALIDATE_MAX_TOKENS,
    )
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def drain(stream) -> None:
    """Read the server's log after start-up so that its pipe never fills."""
    for _ in stream:
        pass


def validate_streamed(model, num_schemas: int, concurrency: int) -> list[tuple[int, bool, float, int]]:
    """validate()'s requests, streamed through `graphrt serve` with the openai client."""
    from openai import OpenAI
    from serve_bench import start_server

    schemas = [random_schema(random.Random(seed)) for seed in range(num_schemas)]
    rows = []
    for pp in (1, 2):
        for async_scheduling in (True, False):
            extra = ["--dtype", "float32", "--max-num-seqs", "32"] + ([] if async_scheduling else ["--no-async-scheduling"])
            proc, url = start_server(model, pp, extra)
            threading.Thread(target=drain, args=(proc.stdout,), daemon=True).start()
            try:
                # No retries: a request that fails must show, not be sent again.
                client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=1800)
                model_id = client.models.list().data[0].id
                for temperature in VALIDATE_TEMPERATURES:
                    start = time.perf_counter()
                    with ThreadPoolExecutor(concurrency) as pool:
                        texts = list(pool.map(
                            lambda index: streamed_text(client, model_id, schemas[index], index, temperature), range(num_schemas)
                        ))
                    label = f"pp {pp}, async {'on' if async_scheduling else 'off'}, temperature {temperature}, streamed"
                    rows.append((pp, async_scheduling, temperature, count_valid(schemas, texts, label)))
                    print(f"{label}: {rows[-1][3]}/{num_schemas} valid ({time.perf_counter() - start:.0f} s)", flush=True)
            finally:
                proc.terminate()
                proc.wait(timeout=60)
    return rows


def validity_table(rows: list[tuple[int, bool, float, int]], num_schemas: int) -> str:
    counts = {(pp, async_scheduling, temperature): valid for pp, async_scheduling, temperature, valid in rows}
    lines = ["| pp | async scheduling | greedy | sampled (temperature 1, seeded) |", "|---|---|---|---|"]
    for pp, async_scheduling in dict.fromkeys((pp, a) for pp, a, _, _ in rows):
        cells = [counts.get((pp, async_scheduling, t)) for t in VALIDATE_TEMPERATURES]
        lines.append(f"| {pp} | {'on' if async_scheduling else 'off'} | " + " | ".join("-" if c is None else f"{c}/{num_schemas}" for c in cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--no-async", action="store_true")
    parser.add_argument("--model", default=None)
    parser.add_argument("--validate", action="store_true")
    parser.add_argument("--stream", action="store_true", help="With --validate: through graphrt serve, streamed.")
    parser.add_argument("--schemas", type=int, default=50)
    parser.add_argument("--concurrency", type=int, default=8, help="With --validate --stream: requests in flight.")
    args = parser.parse_args()
    if args.stream and not args.validate:
        parser.error("--stream goes with --validate")
    if args.validate:
        rows = validate_streamed(args.model, args.schemas, args.concurrency) if args.stream else validate(args.model, args.schemas)
        print(validity_table(rows, args.schemas))
        sys.exit(0 if all(valid == args.schemas for *_, valid in rows) else 1)
    llm = LLM(model=args.model, dtype="float32", pp=args.pp, async_scheduling=not args.no_async, max_num_seqs=args.requests)
    sides = {name: requests(llm, args.requests, args.max_tokens, constrained=name == "constrained") for name in ("free", "constrained")}
    # warm-up: these grammars compile here (compile_times measures other schemas, cold)
    _, lengths = run(llm, *sides["constrained"])
    # The constrained requests stop where their JSON ends, so the batch thins out sooner: the same
    # requests unconstrained and cut at those lengths tell the grammar's own cost from that.
    prompts, params = sides["free"]
    cut = [dataclasses.replace(p, max_tokens=max(1, n), ignore_eos=True) for p, n in zip(params, lengths)]
    sides["free, cut to the same lengths"] = (prompts, cut)
    rates: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, (prompts, params) in sides.items():
            seconds, counts = run(llm, prompts, params)
            tokens = sum(counts)
            rates[name].append(tokens / seconds)
            print(f"{name}: {tokens} tokens in {seconds:.2f} s, {tokens / seconds:.1f} tok/s", flush=True)
    median = {name: statistics.median(values) for name, values in rates.items()}
    for name, values in rates.items():
        print(f"{name}: {median[name]:.1f} tok/s ({min(values):.1f}-{max(values):.1f})")
    print(f"constrained / free: {median['constrained'] / median['free']:.2f}x")
    print(f"constrained / free, cut to the same lengths: {median['constrained'] / median['free, cut to the same lengths']:.2f}x")
    times = compile_times(llm, args.requests)
    print(f"grammar compile: p50 {percentile(times, 0.5) * 1e3:.1f} ms, p99 {percentile(times, 0.99) * 1e3:.1f} ms over {len(times)} schemas")


if __name__ == "__main__":
    main()
