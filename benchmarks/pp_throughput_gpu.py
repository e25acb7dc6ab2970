"""Throughput with pp 1, 2 and 4 on one GPU (every stage on cuda:0, on its own stream), at batch 1 and 64.

    python benchmarks/pp_throughput_gpu.py [--models 1b,tiny] [--model DIR] [--pp 1,2,4] [--batches 1,64]
                                           [--prompt-len 32] [--output-len 128] [--hbm-tb-s 4.8]
                                           [--device cuda|cpu]

Each (model, pp) is one engine, `LLM(model, pp=N, devices=["cuda:0"] * N)`, with CUDA graphs and the
default kernels and ring depth. For each batch it generates `batch` random prompts of --prompt-len
tokens, --output-len tokens each (greedy, EOS ignored), once to warm up and once timed. Printed:
the decode split (micro-batches a decode round's rows are spread over: one on one GPU, see
EngineConfig.num_decode_micro_batches), output tok/s over the whole generate call (prefill
included), decode tok/s from the engine's own decode time, the ratio to pp 1, and the weight bandwidth of decode (weight bytes per micro-batch)
with its share of the HBM peak (--hbm-tb-s, the H200's 4.8 TB/s by default) and of the device copy
rate measured at the start (profiling/bandwidth.py); then the targets.
Models as in graph_replay_gpu.py: the 1B-shaped one from --model (written there with --write-model,
or here into a temporary folder), the tiny one made here.

`--device cpu` runs the tiny model on CPU stage threads: a check of this script, not a measurement.
Without CUDA and without it, the script says so and exits 3.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from graph_replay_gpu import (
    BLOCK_SIZE,
    TINY_VARIANT,
    copy_line,
    int_list,
    parse_models,
    say_no_cuda,
    stage_device,
    write_random_model,
)

from graphrt import LLM, SamplingParams
from graphrt.profiling.bandwidth import device_copy_gb_s
from graphrt.tools.synthetic import make_tiny_model

TARGET_PP_RATIO = 0.95  # pp 2 and 4 on one GPU against pp 1, batch 64 (issue 12)
TARGET_ROOFLINE = 0.60  # share of the HBM peak at batch 1


def build_llm(model_dir: Path, pp: int, dtype: str, args) -> LLM:
    max_batch = max(args.batches)
    # Whole blocks: capture verifies with contexts as long as the block table reaches.
    max_model_len = -(-(args.prompt_len + args.output_len) // BLOCK_SIZE) * BLOCK_SIZE
    return LLM(
        model=model_dir, pp=pp, devices=[stage_device(args)] * pp, dtype=dtype, max_num_seqs=max_batch, max_batch=max_batch,
        kv_cache_tokens=2 * max_batch * max_model_len, max_model_len=max_model_len,  # room: no preemption
    )


def random_prompts(batch: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (batch, length), generator=gen).tolist()


def run_batch(llm: LLM, batch: int, args) -> dict:
    """Generate for `batch` prompts (warm-up first); the figures of the timed run."""
    engine = llm.engine
    prompts = random_prompts(batch, args.prompt_len, engine.model_config.vocab_size, seed=batch)
    llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    stats = engine.stats
    before = (stats.decode_steps, stats.decode_tokens, stats.decode_seconds)
    busy_before = sum(engine.ring.busy_s)
    start = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True))
    seconds = time.perf_counter() - start
    steps, tokens, decode_s = (now - then for now, then in zip((stats.decode_steps, stats.decode_tokens, stats.decode_seconds), before))
    weight_gb_s = engine.weight_bytes * steps / decode_s / 1e9 if decode_s else float("nan")
    return {
        # Why a pp loses against pp 1 on one device: a step's time, and how much of the run some
        # stage kept the device busy (the stages' busy time summed: on one GPU they take turns).
        "step_ms": 1e3 * decode_s / steps if steps else float("nan"),
        "busy": (sum(engine.ring.busy_s) - busy_before) / seconds,
        "output_tok_s": sum(len(o.token_ids) for o in outputs) / seconds,
        "decode_tok_s": tokens / decode_s if decode_s else float("nan"),
        "weight_gb_s": weight_gb_s,
        "roofline": weight_gb_s / (args.hbm_tb_s * 1e3),
        "of_copy": weight_gb_s / args.copy_gb_s,
    }


def say(*lines: str) -> None:
    """Print now: a step cut short by its time limit keeps every row printed so far."""
    print("\n".join(lines), flush=True)


def bench_model(name: str, model_dir: Path, dtype: str, args) -> dict:
    """Print one model's table, row by row; return (pp, batch) -> figures."""
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu stage threads: not a measurement"
    say(
        f"### {name}: pp on one device, {dtype}, prompts of {args.prompt_len} tokens, {args.output_len} out ({where})",
        "",
        "| pp | ring slots | decode split | backend | batch | output tok/s | decode tok/s | vs pp 1 | step ms | stages busy | weight GB/s | of HBM peak | of copy | eager fallbacks |",
        "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    )
    results = {}  # (pp, batch) -> figures
    for pp in args.pp:
        llm = build_llm(model_dir, pp, dtype, args)
        engine = llm.engine
        for batch in args.batches:
            figures = results[pp, batch] = run_batch(llm, batch, args)
            base = results.get((args.pp[0], batch))
            say(
                f"| {pp} | {engine.ring.num_slots} | {engine.num_decode_micro_batches} | {engine.backend} | {batch} | {figures['output_tok_s']:,.0f} "
                f"| {figures['decode_tok_s']:,.0f} | {figures['decode_tok_s'] / base['decode_tok_s']:.2f}x "
                f"| {figures['step_ms']:.2f} | {figures['busy']:.0%} | {figures['weight_gb_s']:,.0f} | {figures['roofline']:.0%} | {figures['of_copy']:.0%} | {engine.num_eager_fallbacks} |"
            )
        engine.close()
        del llm, engine
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    say("")
    return results


def target_lines(results: dict, args) -> list[str]:
    first, largest, smallest = args.pp[0], max(args.batches), min(args.batches)
    rows = []
    for pp in args.pp[1:]:
        ratio = results[pp, largest]["decode_tok_s"] / results[first, largest]["decode_tok_s"]
        rows.append((f"pp {pp} on one GPU against pp {first}, decode tok/s, batch {largest}", f"{ratio:.2f}x",
                     f">= {TARGET_PP_RATIO}x", ratio >= TARGET_PP_RATIO))
    roofline, of_copy = results[first, smallest]["roofline"], results[first, smallest]["of_copy"]
    rows.append((f"share of the HBM peak while serving, pp {first}, batch {smallest}", f"{roofline:.0%} ({of_copy:.0%} of the measured copy)",
                 f">= {TARGET_ROOFLINE:.0%}", roofline >= TARGET_ROOFLINE))
    lines = ["### targets (1B-shaped model, serving loop)", "", "| target | measured | wanted | met |", "|---|---:|---:|---|"]
    lines += [f"| {what} | {measured} | {wanted} | {'yes' if met else 'NO'} |" for what, measured, wanted, met in rows]
    return lines + [""]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=None, help="1b, tiny or both, comma-separated, in order [default: 1b,tiny; tiny on cpu]")
    parser.add_argument("--model", type=Path, help="the 1B-shaped folder (graph_replay_gpu.py --write-model)")
    parser.add_argument("--pp", type=int_list, default=[1, 2, 4], help="pipeline sizes, the first is the reference")
    parser.add_argument("--batches", type=int_list, default=[1, 64], help="requests generated at once")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--hbm-tb-s", type=float, default=4.8, help="peak HBM bandwidth in TB/s [default: H200's 4.8]")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: check this script on the tiny model")
    args = parser.parse_args(argv)
    args.models = parse_models(parser, args.models, args.device)
    if args.prompt_len < 1 or args.output_len < 2:
        parser.error("--prompt-len must be at least 1 and --output-len at least 2 (decode needs a second token)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        return say_no_cuda("pp_throughput_gpu.py")
    args.copy_gb_s = device_copy_gb_s(torch.device(stage_device(args)))  # before any engine takes its memory
    print(copy_line(args) + "\n", flush=True)
    failures = []
    with tempfile.TemporaryDirectory(prefix="graphrt-pp-") as scratch:
        for name in args.models:
            try:
                if name == "tiny":
                    model_dir, dtype = make_tiny_model(Path(scratch) / "tiny", TINY_VARIANT), "bfloat16"
                    if args.device == "cpu":
                        dtype = "float32"
                else:
                    model_dir, dtype = args.model or write_random_model(Path(scratch) / "llama-1b"), "bfloat16"
                results = bench_model(f"{name} model", model_dir, dtype, args)
                if name == "1b":
                    say(*target_lines(results, args))
            except Exception as exc:  # one model's failure must not cost the other's figures
                traceback.print_exc()
                failures.append(f"{name}: {type(exc).__name__}: {exc}")
    if failures:
        print("FAILED: " + "; ".join(failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
