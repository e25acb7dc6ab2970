"""Each decode hot-path Triton kernel against its torch reference, on Llama-3-8B-sized shapes.

    python benchmarks/kernels_gpu.py [--dtype bfloat16|float16] [--batch-sizes 1,8,32,64]
                                     [--contexts 1024,4096] [--eager]

Needs a CUDA GPU. Shapes: hidden 4096, 32 heads, 8 kv heads, head_dim 128, intermediate 14336,
one token per sequence (decode), KV blocks of 16 tokens scattered at random. Each kernel is timed
with CUDA events around a CUDA graph of CALLS_PER_GRAPH back-to-back calls (how graphrt runs
decode; `--eager` launches from Python instead), after warm-up, median of REPEATS. Achieved GB/s
counts the bytes a kernel must move at least (inputs read once, outputs written once) and is
printed against the measured device copy bandwidth (read + write of a 1 GiB tensor). Prints a
markdown table for benchmarks/results.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

HIDDEN_SIZE = 4096
NUM_HEADS = 32
NUM_KV_HEADS = 8
HEAD_DIM = 128
INTERMEDIATE_SIZE = 14336
BLOCK_SIZE = 16
CALLS_PER_GRAPH = 20
REPEATS = 25
DEVICE = "cuda"


@dataclass
class Case:
    kernel: str
    shape: str
    bytes_moved: int
    torch_fn: Callable[[], object]
    triton_fn: Callable[[], object]


def time_us(fn: Callable[[], object], eager: bool) -> tuple[float, bool]:
    """(median microseconds per call of `fn` measured with CUDA events, whether it ran in a graph)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream: compile, allocate, pick algorithms
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    run = lambda: [fn() for _ in range(CALLS_PER_GRAPH)]  # noqa: E731
    graphed = not eager
    if graphed:
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run()
            run = graph.replay
        except RuntimeError as error:  # report it and measure eagerly rather than lose the row
            print(f"capture failed, timing eagerly: {error}", file=sys.stderr)
            torch.cuda.synchronize()
            graphed = False
    run()
    times = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / CALLS_PER_GRAPH)
    return statistics.median(times), graphed


def time_cell(us: float, graphed: bool, eager: bool) -> str:
    return f"{us:.1f}" if graphed or eager else f"{us:.1f} (eager: capture failed)"


def copy_bandwidth_gb_s() -> float:
    """Device-to-device copy of 1 GiB: bytes read plus bytes written per second."""
    source = torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE)
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(source)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return 2 * source.numel() / statistics.median(times) / 1e9


def pointwise_cases(batch: int, dtype: torch.dtype) -> list[Case]:
    from graphrt.kernels import activation, activation_triton, rmsnorm, rmsnorm_triton, rotary, rotary_triton

    size = torch.finfo(dtype).bits // 8
    x, residual = (torch.randn(batch, HIDDEN_SIZE, device=DEVICE, dtype=dtype) for _ in range(2))
    weight = torch.randn(HIDDEN_SIZE, device=DEVICE, dtype=dtype)
    qkv = torch.randn(batch, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, device=DEVICE, dtype=dtype)
    q = qkv[:, : NUM_HEADS * HEAD_DIM].view(batch, NUM_HEADS, HEAD_DIM)
    k = qkv[:, NUM_HEADS * HEAD_DIM : (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM].view(batch, NUM_KV_HEADS, HEAD_DIM)
    angles = torch.rand(batch, HEAD_DIM, device=DEVICE) * 6.28  # real rotations: repeated calls keep q, k bounded
    cos, sin = angles.cos(), angles.sin()
    gate_up = torch.randn(batch, 2 * INTERMEDIATE_SIZE, device=DEVICE, dtype=dtype)
    rotated = batch * (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM
    return [
        Case(
            "rms_norm + residual", f"{batch} x {HIDDEN_SIZE}", (4 * batch + 1) * HIDDEN_SIZE * size,
            lambda: rmsnorm.rms_norm(x, weight, 1e-5, residual),
            lambda: rmsnorm_triton.rms_norm(x, weight, 1e-5, residual),
        ),
        Case(
            "apply_rotary (q, k)", f"{batch} x ({NUM_HEADS}+{NUM_KV_HEADS}) x {HEAD_DIM}",
            2 * rotated * size + 2 * batch * HEAD_DIM * 4,
            lambda: rotary.apply_rotary(q, k, cos, sin),
            lambda: rotary_triton.apply_rotary(q, k, cos, sin),
        ),
        Case(
            "silu_and_mul", f"{batch} x 2*{INTERMEDIATE_SIZE}", 3 * batch * INTERMEDIATE_SIZE * size,
            lambda: activation.silu_and_mul(gate_up),
            lambda: activation_triton.silu_and_mul(gate_up),
        ),
    ]


def attention_cases(batch: int, context: int, dtype: torch.dtype) -> list[Case]:
    from graphrt.kernels import paged_attention, paged_attention_triton

    size = torch.finfo(dtype).bits // 8
    blocks_per_seq = context // BLOCK_SIZE
    num_blocks = 1 + batch * blocks_per_seq  # block 0 is scratch
    cache_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = (torch.randn(cache_shape, device=DEVICE, dtype=dtype) for _ in range(2))
    tables = (torch.randperm(num_blocks - 1, device=DEVICE) + 1).view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, device=DEVICE, dtype=torch.int64)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(batch, NUM_KV_HEADS, HEAD_DIM, device=DEVICE, dtype=dtype) for _ in range(2))
    slots = tables[:, -1] * BLOCK_SIZE + BLOCK_SIZE - 1  # each sequence's last position
    scale = HEAD_DIM**-0.5
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * size
    return [
        Case(
            "write_kv", f"{batch} x {NUM_KV_HEADS} x {HEAD_DIM}",
            4 * batch * NUM_KV_HEADS * HEAD_DIM * size + 8 * batch,
            lambda: paged_attention.write_kv(k, v, k_cache, v_cache, slots),
            lambda: paged_attention_triton.write_kv(k, v, k_cache, v_cache, slots),
        ),
        Case(
            "paged_decode_attention", f"{batch} seqs x {context} ctx, {NUM_HEADS}/{NUM_KV_HEADS} heads",
            kv_bytes + 2 * q.numel() * size,
            lambda: paged_attention.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale, context),
            lambda: paged_attention_triton.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale),
        ),
    ]


def parse_sizes(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--batch-sizes", type=parse_sizes, default=[1, 8, 32, 64])
    parser.add_argument("--contexts", type=parse_sizes, default=[1024, 4096])
    parser.add_argument("--eager", action="store_true", help="launch from Python instead of replaying a CUDA graph")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels_gpu.py needs a CUDA GPU and this torch sees none; run it on a GPU host")
    import triton

    dtype = getattr(torch, args.dtype)
    copy_gb_s = copy_bandwidth_gb_s()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, {args.dtype}; "
          f"device copy {copy_gb_s:.0f} GB/s; {'eager launches' if args.eager else 'CUDA graph replay'}\n")
    print("| kernel | shape | torch us | triton us | speed-up | triton GB/s | of copy GB/s |")
    print("|---|---|---|---|---|---|---|")
    groups = [partial(pointwise_cases, batch, dtype) for batch in args.batch_sizes]
    groups += [
        partial(attention_cases, batch, context, dtype) for batch in args.batch_sizes for context in args.contexts
    ]
    for make_cases in groups:  # one shape's tensors at a time
        for case in make_cases():
            (torch_us, torch_graphed), (triton_us, triton_graphed) = (
                time_us(case.torch_fn, args.eager), time_us(case.triton_fn, args.eager)
            )
            gb_s = case.bytes_moved / triton_us / 1e3
            print(f"| {case.kernel} | {case.shape} | {time_cell(torch_us, torch_graphed, args.eager)} "
                  f"| {time_cell(triton_us, triton_graphed, args.eager)} | {torch_us / triton_us:.2f}x "
                  f"| {gb_s:.0f} | {gb_s / copy_gb_s:.0%} |", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
