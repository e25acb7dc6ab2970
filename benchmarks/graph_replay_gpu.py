"""Decode step time per bucket: CUDA-graph replay against eager, on a tiny and a Llama-3.2-1B-shaped model.

    python benchmarks/graph_replay_gpu.py [--models 1b,tiny] [--pp 1] [--buckets 1,8,32,64]
                                          [--kernels auto|torch|triton] [--context 512]
                                          [--max-model-len 1024] [--repeats 20] [--hbm-tb-s 4.8]
                                          [--model DIR | --write-model DIR] [--device cuda|cpu]

The 1B model has Llama-3.2-1B's shapes (hidden 2048, 16 layers, 32 heads, 8 kv heads, head_dim 64,
intermediate 8192, vocab 128256, tied embeddings, llama3 RoPE) and random bfloat16 weights, made on
the GPU and written once (nothing is downloaded); `--write-model DIR` writes it and exits, `--model
DIR` reuses such a folder. The tiny model is graphrt.tools.synthetic's random 4-layer Llama, in float32.

For each model and pp (every stage on the one device) one engine records graphs and one runs with
use_graphs=False. Each bucket's decode step, `engine.pipeline.forward(token_ids, meta,
engine.graphs)`, is timed (CUDA events, 3 warm-ups, median of --repeats) on the same rows: `bucket`
sequences of `--context` tokens in distinct KV blocks, inputs already on the device, KV caches filled
with the same random values in both engines. Printed per model: that table (with the weight
bandwidth and its share of the HBM peak, --hbm-tb-s, the H200's 4.8 TB/s by default, and of the
device copy rate measured at the start, profiling/bandwidth.py), capture time,
pool bytes and kernels per (stage, bucket), and whether greedy generation gives the same tokens with
graphs and without; then the targets, met or not. With kernels=torch a graph's attention reads the
whole block table (max_model_len tokens, masked), eager only the live blocks; Triton (the default on
CUDA) reads the lengths on the device.

`--device cpu` runs the same code on the tiny model with the eager backend (no graphs, host timers):
a check of this script, not a measurement. Without CUDA and without it, the script says so and exits 3.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import struct
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from graphrt import LLM, SamplingParams
from graphrt.engine.sequence import Sequence
from graphrt.profiling.bandwidth import device_copy_gb_s
from graphrt.runtime.ring import build_inputs
from graphrt.runtime.step import ScheduledStep
from graphrt.tools.synthetic import make_tiny_model

BLOCK_SIZE = 16
WARMUPS = 3
NO_CUDA_EXIT = 3  # scripts/gpu_check.sh reads this as "no CUDA device", not as a failure
TINY_VARIANT = "llama3-rope"
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
TARGETS = {  # issue 12: what the 1B-shaped model should reach on one H200
    "speed_up": 2.0,  # graph replay against eager per decode step, batch 1
    "roofline": 0.60,  # share of the HBM peak at batch 1
    "capture_s": 5.0,  # all of a stage's buckets
}
LLAMA_3_2_1B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 128256,
    "max_position_embeddings": 4096,  # the real model has 131072; a shorter context keeps the KV cache small
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}


def tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """The tensors of a tied-embedding Llama checkpoint, named as transformers names them."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q_size = config["num_attention_heads"] * config["head_dim"]
    kv_size = config["num_key_value_heads"] * config["head_dim"]
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], hidden)}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q_size, hidden),
            p + "self_attn.k_proj.weight": (kv_size, hidden),
            p + "self_attn.v_proj.weight": (kv_size, hidden),
            p + "self_attn.o_proj.weight": (hidden, q_size),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    shapes["model.norm.weight"] = (hidden,)
    return shapes


def random_chunks(name: str, shape: tuple[int, ...], gen: torch.Generator, device: str, max_elements: int = 1 << 26):
    """bfloat16 pieces of one tensor along its first dimension: norms near 1, matrices N(0, 0.02)."""
    rows_per_chunk = max(1, max_elements // math.prod(shape[1:]))
    for start in range(0, shape[0], rows_per_chunk):
        piece = torch.randn((min(rows_per_chunk, shape[0] - start), *shape[1:]), generator=gen, device=device)
        piece = 1 + 0.1 * piece if name.endswith("norm.weight") else 0.02 * piece
        yield piece.to(torch.bfloat16)


def write_random_model(folder: Path, config: dict = LLAMA_3_2_1B, device: str = "cuda", seed: int = 0) -> Path:
    """config.json + one model.safetensors, generated on `device` and streamed to disk piece by piece,
    so the host never holds more than one piece."""
    folder.mkdir(parents=True, exist_ok=True)
    shapes = tensor_shapes(config)
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = math.prod(shape) * torch.bfloat16.itemsize
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    gen = torch.Generator(device).manual_seed(seed)
    with open(folder / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for name, shape in shapes.items():
            for piece in random_chunks(name, shape, gen, device):
                f.write(piece.view(torch.uint8).cpu().numpy())
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def decode_rows(engine, rows: int, context: int, seed: int):
    """`rows` sequences, each `context` tokens long in its own KV blocks, decoding their next token;
    built by the ring's own step builder, then moved to the first stage's device."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_row = -(-context // BLOCK_SIZE)
    # Distinct blocks for every row, none of them the scratch block 0.
    blocks = torch.randperm(engine.allocator.num_blocks - 1, generator=gen)[: rows * blocks_per_row] + 1
    seqs = []
    for row in range(rows):
        prompt = torch.randint(0, engine.model_config.vocab_size, (context,), generator=gen).tolist()
        seq = Sequence(request_id=row, prompt_ids=prompt, params=SamplingParams(), max_tokens=1)
        seq.block_ids = blocks[row * blocks_per_row : (row + 1) * blocks_per_row].tolist()
        seq.num_computed = context - 1  # the last prompt token is this step's query
        seqs.append(seq)
    token_ids, meta = build_inputs(ScheduledStep(seqs, [1] * rows, is_prefill=False), BLOCK_SIZE)
    device = engine.devices[0]
    return token_ids.to(device), meta.to(device)


def median_ms(step, repeats: int, device: torch.device) -> float:
    """Median time of `step`: CUDA events around it on a GPU, the host clock after a sync elsewhere."""
    for _ in range(WARMUPS):
        step()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(repeats):
            start = time.perf_counter()
            step()
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def stage_device(args) -> str:
    """Every stage on the one device: cuda:0 (an index, as the engine's devices name them) or cpu."""
    return "cuda:0" if args.device == "cuda" else "cpu"


def build_llm(model_dir: Path, pp: int, args, dtype: str, use_graphs: bool) -> tuple[LLM, float]:
    start = time.perf_counter()
    llm = LLM(
        model=model_dir, pp=pp, devices=[stage_device(args)] * pp, dtype=dtype, kernels=args.kernels,
        buckets=args.buckets, kv_cache_tokens=max(args.buckets) * -(-args.context // BLOCK_SIZE) * BLOCK_SIZE,
        max_model_len=args.max_model_len, use_graphs=use_graphs,
    )
    torch.manual_seed(0)  # the same cache contents in both engines, so their outputs can be compared
    for cache in llm.engine.pipeline.caches:
        cache.k.normal_()
        cache.v.normal_()
    return llm, time.perf_counter() - start


def say(*lines: str) -> None:
    """Print now: a step cut short by its time limit keeps every row printed so far."""
    print("\n".join(lines), flush=True)


def bench_model(name: str, model_dir: Path, dtype: str, pp: int, args) -> dict:
    """Print the step table, the capture table and the greedy check of one model; return the
    figures the targets are judged on."""
    graphed, graphed_s = build_llm(model_dir, pp, args, dtype, use_graphs=True)
    eager, eager_s = build_llm(model_dir, pp, args, dtype, use_graphs=False)
    device = torch.device(stage_device(args))
    on_cuda = device.type == "cuda"
    where = torch.cuda.get_device_name(device) if on_cuda else "cpu, eager backend: not a measurement"
    engine = graphed.engine
    context = min(args.context, engine.max_model_len - BLOCK_SIZE)  # the tiny model's context is 256
    say(
        f"### {name}: pp={pp}, kernels {engine.pipeline.stages[0].ops.name}, {dtype}, context {context}, "
        f"max_model_len {engine.max_model_len}, backend {engine.backend} ({where})",
        "",
        "| bucket | eager ms | graph ms | speed-up | graph tok/s | weight GB/s | of HBM peak | of copy | max rel. diff |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    )
    figures = {}
    for bucket in args.buckets:
        token_ids, meta = decode_rows(engine, bucket, context, seed=bucket)
        steps = {
            kind: (lambda e=llm.engine: e.pipeline.forward(token_ids, meta, e.graphs))
            for kind, llm in (("eager", eager), ("graph", graphed))
        }
        eager_ms = median_ms(steps["eager"], args.repeats, device)
        graph_ms = median_ms(steps["graph"], args.repeats, device)
        reference = steps["eager"]().float()
        diff = (steps["graph"]().float() - reference).abs().max().item() / reference.abs().max().item()
        gb_s = engine.weight_bytes / graph_ms / 1e6
        roofline, of_copy = gb_s / (args.hbm_tb_s * 1e3), gb_s / args.copy_gb_s
        say(
            f"| {bucket} | {eager_ms:.3f} | {graph_ms:.3f} | {eager_ms / graph_ms:.2f}x | {bucket / graph_ms * 1e3:,.0f} "
            f"| {gb_s:,.0f} | {roofline:.0%} | {of_copy:.0%} | {diff:.1e} |"
        )
        if bucket == 1:
            figures |= {"speed_up": eager_ms / graph_ms, "roofline": roofline, "of_copy": of_copy}
    capture_lines, figures["capture_s"] = capture_table(engine, graphed_s, eager_s)
    greedy_line, figures["greedy_equal"] = greedy_check(graphed, eager, engine.model_config.vocab_size)
    say("", *capture_lines, "", greedy_line, "")
    for llm in (graphed, eager):
        llm.engine.close()
    return figures


def capture_table(engine, graphed_s: float, eager_s: float) -> tuple[list[str], float]:
    """Per (stage, bucket), from engine.graph_records: what warming up (first calls compile the
    Triton kernels: the rehearsal's first run over its second) and recording the graph cost. Also returns the slowest stage's total of both,
    what its start paid."""
    lines = [
        f"start-up with graphs {graphed_s:.1f} s, without {eager_s:.1f} s (load + capture + verify)",
        "",
        "| stage | layers | bucket | mode | warm-up ms | of which first calls | capture ms | pool MiB | kernels |",
        "|---:|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    stage_seconds = []
    for stage in engine.pipeline.stages:
        records = sorted((r for r in engine.graph_records if r.stage == stage.index), key=lambda r: r.bucket)
        stage_seconds.append(sum(r.warmup_ms + r.capture_ms for r in records) / 1e3)
        for r in records:
            pool = "-" if r.pool_bytes is None else f"{r.pool_bytes / 2**20:.1f}"
            lines.append(
                f"| {stage.index} | {stage.layer_ids.start}-{stage.layer_ids.stop - 1} | {r.bucket} | {r.mode} "
                f"| {r.warmup_ms:.1f} | {r.first_calls_ms:.1f} | {r.capture_ms:.1f} | {pool} | {(r.nodes or {}).get('kernel', '-')} |"
            )
    return lines, max(stage_seconds)


def greedy_check(graphed: LLM, eager: LLM, vocab_size: int) -> tuple[str, bool]:
    """Greedy tokens of a few prompts with graphs and without; where they part, if they do."""
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, vocab_size, (8 + 5 * i,), generator=gen).tolist() for i in range(6)]
    with_graphs = [o.token_ids for o in graphed.generate(prompts, GREEDY)]
    without = [o.token_ids for o in eager.generate(prompts, GREEDY)]
    if with_graphs == without:
        return f"greedy tokens with graphs equal eager: yes ({len(prompts)} prompts x {GREEDY.max_tokens} tokens)", True
    prompt, first = next(
        (p, next(i for i, (a, b) in enumerate(zip(g, e)) if a != b)) for p, (g, e) in enumerate(zip(with_graphs, without)) if g != e
    )
    return (
        f"greedy tokens with graphs equal eager: NO, prompt {prompt} parts at token {first} "
        f"({sum(g == e for g, e in zip(with_graphs, without))}/{len(prompts)} prompts equal; "
        "in bfloat16 a near-tie can round either way)",
        False,
    )


def target_lines(figures: dict) -> list[str]:
    rows = [
        ("graph replay against eager, decode step, batch 1", f"{figures['speed_up']:.2f}x", f">= {TARGETS['speed_up']:.0f}x",
         figures["speed_up"] >= TARGETS["speed_up"]),
        ("share of the HBM peak, batch 1 (weight bytes / step time)",
         f"{figures['roofline']:.0%} ({figures['of_copy']:.0%} of the measured copy)", f">= {TARGETS['roofline']:.0%}",
         figures["roofline"] >= TARGETS["roofline"]),
        ("capture of the benchmark's buckets, slowest stage", f"{figures['capture_s']:.2f} s", f"< {TARGETS['capture_s']:.0f} s",
         figures["capture_s"] < TARGETS["capture_s"]),
    ]
    lines = ["### targets (1B-shaped model)", "", "| target | measured | wanted | met |", "|---|---:|---:|---|"]
    lines += [f"| {what} | {measured} | {wanted} | {'yes' if met else 'NO'} |" for what, measured, wanted, met in rows]
    return lines


def copy_line(args) -> str:
    """The two rates the weight bandwidth is read against (the "device copy" line gpu_check.sh keeps)."""
    return f"device copy {args.copy_gb_s:,.0f} GB/s measured here, HBM peak {args.hbm_tb_s * 1e3:,.0f} GB/s (--hbm-tb-s)"


def int_list(text: str) -> list[int]:
    return sorted({int(part) for part in text.split(",") if part.strip()})


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=None, help="1b, tiny or both, comma-separated, in order [default: 1b,tiny; tiny on cpu]")
    parser.add_argument("--pp", type=int_list, default=[1], help="pipeline sizes to run, e.g. 1,2")
    parser.add_argument("--buckets", type=int_list, default=[1, 8, 32, 64], help="decode batch sizes")
    parser.add_argument("--kernels", choices=["auto", "torch", "triton"], default="auto", help="auto: triton on CUDA")
    parser.add_argument("--context", type=int, default=512, help="tokens of context per decoding sequence")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--hbm-tb-s", type=float, default=4.8, help="peak HBM bandwidth in TB/s [default: H200's 4.8]")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: check this script on the tiny model")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--model", type=Path, help="reuse a 1B-shaped folder written by --write-model")
    where.add_argument("--write-model", type=Path, help="write the random 1B-shaped model to this folder and exit")
    args = parser.parse_args(argv)
    if args.context >= args.max_model_len:
        parser.error(f"--context {args.context} must be below --max-model-len {args.max_model_len}")
    args.models = parse_models(parser, args.models, args.device)
    return args


def parse_models(parser: argparse.ArgumentParser, models: str | None, device: str) -> list[str]:
    """--models: tiny and 1b on a GPU by default, only tiny on the CPU."""
    names = [m.strip() for m in (models or ("tiny" if device == "cpu" else "1b,tiny")).split(",")]
    if not set(names) <= {"tiny", "1b"}:
        parser.error(f"--models takes tiny and 1b, got {','.join(names)}")
    if device == "cpu" and "1b" in names:
        parser.error("--device cpu runs the tiny model only (the 1B-shaped one is made on a GPU)")
    return names


def say_no_cuda(script: str) -> int:
    print(f"{script} measures on a GPU (scripts/gpu_check.sh), or checks itself with --device cpu")
    print(f"no CUDA device: torch {torch.__version__} sees none (torch.cuda.is_available() is False)")
    return NO_CUDA_EXIT


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        return say_no_cuda("graph_replay_gpu.py")
    if args.write_model is not None:
        start = time.perf_counter()
        write_random_model(args.write_model)
        print(f"wrote a random Llama-3.2-1B-shaped model to {args.write_model} in {time.perf_counter() - start:.1f} s")
        return 0
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    args.copy_gb_s = device_copy_gb_s(torch.device(stage_device(args)))  # before any engine takes its memory
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {where}; {copy_line(args)}\n", flush=True)
    failures = []
    with tempfile.TemporaryDirectory(prefix="graphrt-replay-") as scratch:
        for name in args.models:
            try:
                if name == "tiny":
                    model_dir, dtype = make_tiny_model(Path(scratch) / "tiny", TINY_VARIANT), "float32"
                else:
                    model_dir, dtype = args.model or write_random_model(Path(scratch) / "llama-1b"), "bfloat16"
                for pp in args.pp:
                    figures = bench_model(f"{name} model", model_dir, dtype, pp, args)
                    if name == "1b" and pp == args.pp[0]:
                        say(*target_lines(figures), "")
                    if name == "tiny" and not figures["greedy_equal"]:  # float32: no near-ties to excuse
                        failures.append(f"{name} pp={pp}: greedy tokens differ with graphs")
            except Exception as exc:  # one model's failure must not cost the other's figures
                traceback.print_exc()
                failures.append(f"{name}: {type(exc).__name__}: {exc}")
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
    if failures:
        print("FAILED: " + "; ".join(failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
