"""Each decode hot-path Triton kernel against its torch reference: same results, and how fast.

    python benchmarks/kernels_gpu.py [--dtype bfloat16|float16|float32] [--batch-sizes 1,8,32,64]
                                     [--contexts 1024,4096] [--table-context 131072] [--repeats 25]
                                     [--eager] [--device cuda|cpu]

Shapes are Llama-3-8B's: hidden 4096, 32 heads, 8 kv heads, head_dim 128, intermediate 14336, one
token per sequence (decode), KV blocks of 16 tokens scattered at random. For each case both kernels
first run once on their own copy of the same random inputs, and the relative error of Triton's
results against the reference's (||triton - torch|| / ||torch|| in float64, over every output and
every tensor written in place) must stay under the dtype's tolerance. Then each is timed with CUDA
events around a CUDA graph of CALLS_PER_GRAPH back-to-back calls (how graphrt runs decode; `--eager`
launches from Python instead), after warm-up, median of --repeats. Achieved GB/s counts the bytes a
kernel must move at least (inputs read once, outputs written once) and is printed against the
measured device copy bandwidth (read + write of a 1 GiB tensor). Prints a markdown table for
benchmarks/results.md and exits 1 if any kernel is wrong.

`--table-context N` gives decode attention block tables N tokens wide (scratch blocks past each
context), as a graph recorded for max_model_len N holds them: the split count then comes from N, and
each sequence's live context is still cut into that many parts (docs/kernels.md).

`--device cpu` runs the kernels through Triton's interpreter (TRITON_INTERPRET=1) with host timers:
a check of this script, not a measurement (use float32 there; the interpreter gets bfloat16 wrong).
Without CUDA and without it, the script says so and exits 3.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
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
NO_CUDA_EXIT = 3  # scripts/gpu_check.sh reads this as "no CUDA device", not as a failure
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # relative, as tests/kernels/test_kernels.py


@dataclass
class Case:
    kernel: str
    shape: str
    bytes_moved: int
    inputs: tuple  # tensors (written in place by some kernels) and plain numbers
    reference: Callable  # the torch reference, called as reference(*inputs)
    triton: Callable  # the Triton kernel, same call
    # What to compare after a call, from (its result, its inputs); by default the result.
    compared: Callable = lambda result, inputs: result


def as_list(value) -> list[torch.Tensor]:
    return list(value) if isinstance(value, (tuple, list)) else [value]


def relative_error(case: Case) -> float:
    """||triton - torch|| / ||torch|| over everything `case.compared` picks, each kernel on its own
    copy of the inputs (some write in place); NaN anywhere counts as infinitely wrong."""
    copy = lambda: tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in case.inputs)  # noqa: E731
    reference_inputs, triton_inputs = copy(), copy()
    expected = as_list(case.compared(case.reference(*reference_inputs), reference_inputs))
    got = as_list(case.compared(case.triton(*triton_inputs), triton_inputs))
    worst = 0.0
    for g, e in zip(got, expected, strict=True):
        g, e = g.double(), e.double()
        if torch.isnan(g).any():
            return float("inf")
        worst = max(worst, ((g - e).norm() / e.norm().clamp_min(1e-30)).item())
    return worst


def time_us(fn: Callable[[], object], eager: bool, repeats: int, device: torch.device) -> tuple[float, bool]:
    """(median microseconds per call of `fn`, whether it ran in a CUDA graph)."""
    if device.type != "cuda":
        fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(CALLS_PER_GRAPH):
                fn()
            times.append((time.perf_counter() - start) * 1e6 / CALLS_PER_GRAPH)
        return statistics.median(times), False
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
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / CALLS_PER_GRAPH)
    return statistics.median(times), graphed


def time_cell(us: float, graphed: bool, eager: bool) -> str:
    return f"{us:.1f}" if graphed or eager else f"{us:.1f} (eager: capture failed)"


def pointwise_cases(batch: int, dtype: torch.dtype, device: torch.device) -> list[Case]:
    from graphrt.kernels import activation, activation_triton, rmsnorm, rmsnorm_triton, rotary, rotary_triton

    size = torch.finfo(dtype).bits // 8
    x, residual = (torch.randn(batch, HIDDEN_SIZE, device=device, dtype=dtype) for _ in range(2))
    weight = torch.randn(HIDDEN_SIZE, device=device, dtype=dtype)
    qkv = torch.randn(batch, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, device=device, dtype=dtype)
    q = qkv[:, : NUM_HEADS * HEAD_DIM].view(batch, NUM_HEADS, HEAD_DIM)
    k = qkv[:, NUM_HEADS * HEAD_DIM : (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM].view(batch, NUM_KV_HEADS, HEAD_DIM)
    angles = torch.rand(batch, HEAD_DIM, device=device) * 6.28  # real rotations: repeated calls keep q, k bounded
    cos, sin = angles.cos(), angles.sin()
    gate_up = torch.randn(batch, 2 * INTERMEDIATE_SIZE, device=device, dtype=dtype)
    rotated = batch * (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM
    return [
        Case(
            "rms_norm + residual", f"{batch} x {HIDDEN_SIZE}", (4 * batch + 1) * HIDDEN_SIZE * size,
            (x, weight, residual),
            lambda x, w, r: rmsnorm.rms_norm(x, w, 1e-5, r),
            lambda x, w, r: rmsnorm_triton.rms_norm(x, w, 1e-5, r),
        ),
        Case(
            # Timed on strided views of one fused qkv tensor, as in the model; the error check's copies are contiguous.
            "apply_rotary (q, k)", f"{batch} x ({NUM_HEADS}+{NUM_KV_HEADS}) x {HEAD_DIM}",
            2 * rotated * size + 2 * batch * HEAD_DIM * 4,
            (q, k, cos, sin),
            rotary.apply_rotary,  # returns rotated copies
            rotary_triton.apply_rotary,  # rotates in place and returns q, k
        ),
        Case(
            "silu_and_mul", f"{batch} x 2*{INTERMEDIATE_SIZE}", 3 * batch * INTERMEDIATE_SIZE * size,
            (gate_up,), activation.silu_and_mul, activation_triton.silu_and_mul,
        ),
    ]


def attention_cases(
    batch: int, context: int, dtype: torch.dtype, device: torch.device, table_context: int | None = None
) -> list[Case]:
    from graphrt.kernels import paged_attention, paged_attention_triton

    size = torch.finfo(dtype).bits // 8
    blocks_per_seq = context // BLOCK_SIZE
    num_blocks = 1 + batch * blocks_per_seq  # block 0 is scratch
    cache_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = (torch.randn(cache_shape, device=device, dtype=dtype) for _ in range(2))
    tables = (torch.randperm(num_blocks - 1, device=device) + 1).view(batch, blocks_per_seq)
    if table_context is not None and table_context > context:  # a graph's table: scratch block 0 past the context
        tables = torch.cat([tables, tables.new_zeros(batch, table_context // BLOCK_SIZE - blocks_per_seq)], dim=1)
    seq_lens = torch.full((batch,), context, device=device, dtype=torch.int64)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, device=device, dtype=dtype)
    k, v = (torch.randn(batch, NUM_KV_HEADS, HEAD_DIM, device=device, dtype=dtype) for _ in range(2))
    slots = tables[:, -1] * BLOCK_SIZE + BLOCK_SIZE - 1  # each sequence's last position
    scale = HEAD_DIM**-0.5
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * size
    return [
        Case(
            "write_kv", f"{batch} x {NUM_KV_HEADS} x {HEAD_DIM}",
            4 * batch * NUM_KV_HEADS * HEAD_DIM * size + 8 * batch,
            (k, v, k_cache, v_cache, slots),
            paged_attention.write_kv,
            paged_attention_triton.write_kv,
            compared=lambda result, inputs: [inputs[2], inputs[3]],  # the caches, written in place
        ),
        Case(
            "paged_decode_attention",
            f"{batch} seqs x {context} ctx{f' of {table_context}' if table_context else ''}, {NUM_HEADS}/{NUM_KV_HEADS} heads",
            kv_bytes + 2 * q.numel() * size,
            (q, k_cache, v_cache, tables, seq_lens, scale, context),
            paged_attention.paged_decode_attention,
            paged_attention_triton.paged_decode_attention,  # ignores the host length: it reads seq_lens
        ),
    ]


def parse_sizes(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--batch-sizes", type=parse_sizes, default=[1, 8, 32, 64])
    parser.add_argument("--contexts", type=parse_sizes, default=[1024, 4096])
    parser.add_argument("--table-context", type=int, default=None, help="decode attention tables this many tokens wide, as a graph's for max_model_len")
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--eager", action="store_true", help="launch from Python instead of replaying a CUDA graph")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: check this script through Triton's interpreter")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("kernels_gpu.py measures on a GPU (scripts/gpu_check.sh), or checks itself with --device cpu")
        print(f"no CUDA device: torch {torch.__version__} sees none (torch.cuda.is_available() is False)")
        return NO_CUDA_EXIT
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernel modules are first imported, just below
    import triton

    from graphrt.profiling.bandwidth import device_copy_gb_s

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    eager = args.eager or device.type != "cuda"
    copy_gb_s = device_copy_gb_s(device)  # profiling/bandwidth.py, as the other GPU benchmarks read it
    where = torch.cuda.get_device_name() if device.type == "cuda" else "cpu, Triton interpreter: not a measurement"
    print(f"{where}, torch {torch.__version__}, triton {triton.__version__}, {args.dtype}; "
          f"device copy {copy_gb_s:.0f} GB/s; {'eager launches' if eager else 'CUDA graph replay'}\n")
    print(f"| kernel | shape | rel. error (< {TOLERANCE[dtype]:g}) | torch us | triton us | speed-up | triton GB/s | of copy GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    groups = [partial(pointwise_cases, batch, dtype, device) for batch in args.batch_sizes]
    groups += [
        partial(attention_cases, batch, context, dtype, device, args.table_context)
        for batch in args.batch_sizes for context in args.contexts
    ]
    wrong = []
    for make_cases in groups:  # one shape's tensors at a time
        for case in make_cases():
            error = relative_error(case)
            ok = error < TOLERANCE[dtype]
            if not ok:
                wrong.append(f"{case.kernel} ({case.shape}): {error:.2e}")
            (torch_us, torch_graphed), (triton_us, triton_graphed) = (
                time_us(lambda: case.reference(*case.inputs), eager, args.repeats, device),
                time_us(lambda: case.triton(*case.inputs), eager, args.repeats, device),
            )
            gb_s = case.bytes_moved / triton_us / 1e3
            print(f"| {case.kernel} | {case.shape} | {error:.1e}{'' if ok else ' WRONG'} "
                  f"| {time_cell(torch_us, torch_graphed, eager)} | {time_cell(triton_us, triton_graphed, eager)} "
                  f"| {torch_us / triton_us:.2f}x | {gb_s:.0f} | {gb_s / copy_gb_s:.0%} |", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if wrong:
        print(f"FAILED: Triton differs from the torch reference beyond {TOLERANCE[dtype]:g}: " + "; ".join(wrong))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
