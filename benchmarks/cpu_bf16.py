"""bfloat16 against float32 on the CPU: greedy agreement on the default model, and decode speed.

    python benchmarks/cpu_bf16.py [--tokens 64] [--rounds 3] [--batch 32]

Greedy output of 8 chat prompts, --tokens new tokens each (EOS ignored), from a float32 and a
bfloat16 engine (each with its matmul paths measured at load). Agreement per prompt: the share of
the tokens before the first that differs, and whether the whole sequence is the same. Since one
near-tie sends the rest of a greedy sequence elsewhere, also per token: the share of float32's
tokens that bfloat16 ranks first when fed float32's text (its prompt logprobs). Speed: decode tok/s
at batch 1 and at --batch, the two engines interleaved, the median of --rounds rounds. `--hf`
adds the same agreement for transformers' `generate` in bfloat16 against float32, one prompt at a
time: how much of the difference is bfloat16's, not graphrt's.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from graphrt import LLM, SamplingParams
from graphrt.kernels.cpu.info import cpu_bf16_support, cpu_model_name

PROMPTS = [
    "What is the capital of France?",
    "Explain pipeline parallelism to a new engineer.",
    "Write a short poem about the sea.",
    "List three uses of a hash map.",
    "How do vaccines work?",
    "Give me a recipe for pancakes.",
    "What is the difference between a process and a thread?",
    "Summarize the plot of Romeo and Juliet.",
]


def decode_rate(llm: LLM, prompts: list[list[int]], tokens: int) -> float:
    stats = llm.engine.stats
    decoded, seconds = stats.decode_tokens, stats.decode_seconds
    llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    return (stats.decode_tokens - decoded) / (stats.decode_seconds - seconds)


def agreement(reference: list[int], other: list[int]) -> float:
    """The share of `reference` before the first token `other` differs in."""
    same = next((i for i, (a, b) in enumerate(zip(reference, other)) if a != b), min(len(reference), len(other)))
    return same / len(reference)


def hf_greedy(model_dir, prompts: list[list[int]], tokens: int, dtype: torch.dtype) -> list[list[int]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # EOS ignored, as graphrt's ignore_eos
    outputs = []
    for prompt in prompts:
        with torch.no_grad():
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=tokens, do_sample=False, pad_token_id=0)
        outputs.append(ids[0, len(prompt):].tolist())
    return outputs


def report_agreement(who: str, reference: list[list[int]], other: list[list[int]]) -> None:
    shares = [agreement(a, b) for a, b in zip(reference, other)]
    identical = sum(a == b for a, b in zip(reference, other))
    print(f"  {who}: tokens before the first difference " + ", ".join(f"{s:.0%}" for s in shares)
          + f" (mean {statistics.mean(shares):.0%}); whole sequences identical: {identical} of {len(reference)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder [default: SmolLM2-135M-Instruct]")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--no-speed", action="store_true", help="agreement only")
    parser.add_argument("--hf", action="store_true", help="also transformers' bfloat16 against its float32")
    args = parser.parse_args()

    engines = {dtype: LLM(model=args.model, dtype=dtype, max_batch=args.batch) for dtype in ("float32", "bfloat16")}
    reference = engines["float32"]
    prompts = [reference.chat_prompt(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    outputs = {dtype: [o.token_ids for o in llm.generate(prompts, params)] for dtype, llm in engines.items()}
    forced = engines["bfloat16"].generate(
        [p + out for p, out in zip(prompts, outputs["float32"])], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    )
    ranked_first = [
        scored.top[0][0] == scored.token_id
        for p, result in zip(prompts, forced)
        for scored in result.prompt_logprobs[len(p):]
    ]

    print(f"{cpu_model_name()}, bfloat16 instructions: {cpu_bf16_support()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"greedy agreement, bfloat16 against float32, {len(PROMPTS)} chat prompts x {args.tokens} tokens:")
    report_agreement("graphrt", outputs["float32"], outputs["bfloat16"])
    print(f"  float32's tokens that bfloat16 ranks first on float32's text: {sum(ranked_first)} of {len(ranked_first)} "
          f"({sum(ranked_first) / len(ranked_first):.1%})")
    if args.hf:
        report_agreement("transformers", *(hf_greedy(reference.model_dir, prompts, args.tokens, d) for d in (torch.float32, torch.bfloat16)))
    if args.no_speed:
        return
    batches = {1: prompts[1:2], args.batch: [prompts[i % len(prompts)] for i in range(args.batch)]}
    rates: dict[tuple[str, int], list[float]] = {}
    for llm in engines.values():
        decode_rate(llm, batches[1], 4)  # warm-up
    for _ in range(args.rounds):
        for dtype, llm in engines.items():
            for batch, batch_prompts in batches.items():
                rates.setdefault((dtype, batch), []).append(decode_rate(llm, batch_prompts, args.tokens))
    print(f"median of {args.rounds} interleaved rounds:")
    print(f"| dtype | decode tok/s at batch 1 | at batch {args.batch} | weights MB | matmuls |")
    print("|---|---|---|---|---|")
    for dtype, llm in engines.items():
        cells = [f"{statistics.median(rates[dtype, b]):.1f}" for b in batches]
        print(f"| {dtype} | {' | '.join(cells)} | {llm.engine.weight_bytes / 1e6:.0f} | {llm.engine.pipeline.matmul_summary()} |")


if __name__ == "__main__":
    main()
