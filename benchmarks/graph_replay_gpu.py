"""Decode step time per bucket: CUDA-graph replay against eager, on a Llama-3.2-1B-shaped model.

    python benchmarks/graph_replay_gpu.py [--pp 1,2] [--buckets 1,8,32,64] [--kernels torch|triton]
                                          [--context 512] [--max-model-len 1024] [--repeats 20]
                                          [--model DIR | --write-model DIR]

Needs a CUDA GPU. The model has Llama-3.2-1B's shapes (hidden 2048, 16 layers, 32 heads, 8 kv heads,
head_dim 64, intermediate 8192, vocab 128256, tied embeddings, llama3 RoPE) and random bfloat16
weights, written once to a temporary folder (nothing is downloaded); `--write-model DIR` writes it
and exits, `--model DIR` reuses such a folder. For each pp (every stage on cuda:0) one engine
records graphs and one runs with use_graphs=False; each bucket's decode step,
`engine.pipeline.forward(token_ids, meta, engine.graphs)`, is timed with CUDA events (3 warm-ups,
median of --repeats) on the same rows: `bucket` sequences of `--context` tokens in distinct KV
blocks, inputs already on the GPU, KV cache filled with the same random values in both engines.

With kernels=torch a graph's attention reads the whole block table (max_model_len tokens, masked)
because a host-side length cannot change between replays, while eager reads only the live blocks;
hence --max-model-len 1024 for a context of 512. The Triton kernel reads the lengths on the device.
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
from pathlib import Path

import torch

BLOCK_SIZE = 16
WARMUPS = 3
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
    built by the scheduler's own step builder, then moved to the first stage's device."""
    from graphrt.sampling import SamplingParams
    from graphrt.scheduler import ScheduledStep
    from graphrt.sequence import Sequence

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
    token_ids, meta = ScheduledStep(seqs, [1] * rows, is_prefill=False).build(BLOCK_SIZE)
    device = engine.devices[0]
    return token_ids.to(device), meta.to(device)


def median_ms(step, repeats: int) -> float:
    for _ in range(WARMUPS):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def build_engine(model_dir: Path, pp: int, args, use_graphs: bool):
    from graphrt import LLM

    start = time.perf_counter()
    llm = LLM(
        model=model_dir, pp=pp, devices=["cuda:0"] * pp, dtype="bfloat16", kernels=args.kernels,
        buckets=args.buckets, kv_cache_tokens=max(args.buckets) * -(-args.context // BLOCK_SIZE) * BLOCK_SIZE,
        max_model_len=args.max_model_len, use_graphs=use_graphs,
    )
    engine = llm.engine
    torch.manual_seed(0)  # the same cache contents in both engines, so their outputs can be compared
    for cache in engine.pipeline.caches:
        cache.k.normal_()
        cache.v.normal_()
    return engine, time.perf_counter() - start


def bench_pp(model_dir: Path, pp: int, args) -> list[str]:
    graphed, graphed_s = build_engine(model_dir, pp, args, use_graphs=True)
    eager, eager_s = build_engine(model_dir, pp, args, use_graphs=False)
    lines = [
        f"### pp={pp}, kernels {args.kernels}, bfloat16, context {args.context}, max_model_len {args.max_model_len} "
        f"({torch.cuda.get_device_name()})",
        "",
        "| bucket | eager ms | graph ms | speed-up | graph tok/s | graph weight GB/s | max rel. diff |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for bucket in args.buckets:
        token_ids, meta = decode_rows(graphed, bucket, args.context, seed=bucket)
        steps = {
            name: (lambda e=engine: e.pipeline.forward(token_ids, meta, e.graphs))
            for name, engine in (("eager", eager), ("graph", graphed))
        }
        eager_ms = median_ms(steps["eager"], args.repeats)
        graph_ms = median_ms(steps["graph"], args.repeats)
        reference = steps["eager"]().float()
        diff = (steps["graph"]().float() - reference).abs().max().item() / reference.abs().max().item()
        lines.append(
            f"| {bucket} | {eager_ms:.2f} | {graph_ms:.2f} | {eager_ms / graph_ms:.2f}x | {bucket / graph_ms * 1e3:,.0f} "
            f"| {graphed.weight_bytes / graph_ms / 1e6:,.0f} | {diff:.1e} |"
        )
    lines += ["", *capture_table(graphed, graphed_s, eager_s), ""]
    for engine in (graphed, eager):
        engine.close()
    return lines


def capture_table(engine, graphed_s: float, eager_s: float) -> list[str]:
    """Per stage, from engine.graph_records: what recording its graphs cost."""
    lines = [
        f"start-up with graphs {graphed_s:.1f} s, without {eager_s:.1f} s (load + capture + verify)",
        "",
        "| stage | layers | graphs | capture s | pool MiB | kernels per graph |",
        "|---:|---|---:|---:|---:|---|",
    ]
    for stage in engine.pipeline.stages:
        records = [r for r in engine.graph_records if r.stage == stage.index]
        pool = sum(r.pool_bytes or 0 for r in records) / 2**20
        kernels = ", ".join(str((r.nodes or {}).get("kernel", "-")) for r in records)
        lines.append(
            f"| {stage.index} | {stage.layer_ids.start}-{stage.layer_ids.stop - 1} | "
            f"{sum(r.mode == 'graph' for r in records)}/{len(records)} | "
            f"{sum(r.capture_ms for r in records) / 1e3:.2f} | {pool:.1f} | {kernels} |"
        )
    return lines


def int_list(text: str) -> list[int]:
    return sorted({int(part) for part in text.split(",") if part.strip()})


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int_list, default=[1, 2], help="pipeline sizes to run, e.g. 1,2")
    parser.add_argument("--buckets", type=int_list, default=[1, 8, 32, 64], help="decode batch sizes")
    parser.add_argument("--kernels", choices=["torch", "triton"], default="torch")
    parser.add_argument("--context", type=int, default=512, help="tokens of context per decoding sequence")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=20)
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--model", type=Path, help="reuse a folder written by --write-model")
    where.add_argument("--write-model", type=Path, help="write the random model to this folder and exit")
    args = parser.parse_args(argv)
    if args.context >= args.max_model_len:
        parser.error(f"--context {args.context} must be below --max-model-len {args.max_model_len}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit(
            f"graph_replay_gpu.py needs a CUDA GPU, and torch {torch.__version__} sees none here "
            "(torch.cuda.is_available() is False). Run it on a GPU machine, e.g. through scripts/gpu_check.sh."
        )
    if args.write_model is not None:
        start = time.perf_counter()
        write_random_model(args.write_model)
        print(f"wrote a random Llama-3.2-1B-shaped model to {args.write_model} in {time.perf_counter() - start:.1f} s")
        return
    with tempfile.TemporaryDirectory(prefix="graphrt-llama1b-") as scratch:
        model_dir = args.model
        if model_dir is None:
            start = time.perf_counter()
            model_dir = write_random_model(Path(scratch))
            print(f"random model written in {time.perf_counter() - start:.1f} s", file=sys.stderr)
        print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}\n")
        for pp in args.pp:
            print("\n".join(bench_pp(model_dir, pp, args)), flush=True)
            gc.collect()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
