"""Prefill attention on the CPU: the compiled kernel against the torch reference (SDPA per prompt).

    python benchmarks/prefill_attention_cpu.py [--chunks 4x128,1x512,8x64,2x256] [--rounds 9]

SmolLM2-135M shapes (9 query heads, 3 KV heads, head_dim 64, 16-token blocks shuffled through the
cache). A chunk PxL is P whole prompts of L tokens. For each dtype and chunk, each round calls the
reference, then the kernel (interleaved, so a busy machine slows both alike); the table gives the
median time per call over rounds and the causal attention's rate (4 * heads * head_dim * L^2 / 2
FLOPs per prompt).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from graphrt.kernels import paged_attention
from graphrt.kernels.cpu import extension as cpu_extension
from graphrt.kernels.cpu import paged_attention as paged_attention_cpu
from graphrt.kernels.cpu.info import cpu_model_name

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def chunk_inputs(prompts: int, tokens: int, dtype: torch.dtype, seed: int = 0) -> tuple:
    generator = torch.Generator().manual_seed(seed)
    width = -(-tokens // BLOCK_SIZE)
    num_blocks = 1 + prompts * width
    tables = (torch.randperm(num_blocks - 1, generator=generator) + 1).view(prompts, width)
    cache = lambda: torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=generator).to(dtype)  # noqa: E731
    q = torch.randn(prompts * tokens, HEADS, HEAD_DIM, generator=generator).to(dtype)
    lens = [tokens] * prompts
    return q, cache(), cache(), tables, lens, lens, HEAD_DIM**-0.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", default="4x128,1x512,8x64,2x256")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    reason = cpu_extension.unavailable_reason()
    if reason is not None:
        raise SystemExit(f"the compiled kernels can't run here: {reason}")
    print(f"{cpu_model_name()}, {torch.get_num_threads()} threads; median of {args.rounds} interleaved rounds")
    print("| dtype | prompts x tokens | reference ms | kernel ms | speed-up | kernel GFLOP/s |")
    print("|---|---|---:|---:|---:|---:|")
    paths = {"reference": paged_attention.paged_prefill_attention, "kernel": paged_attention_cpu.paged_prefill_attention}
    for dtype in (torch.float32, torch.bfloat16):
        for chunk in args.chunks.split(","):
            prompts, tokens = (int(n) for n in chunk.split("x"))
            inputs = chunk_inputs(prompts, tokens, dtype)
            seconds: dict[str, list[float]] = {name: [] for name in paths}
            for attention in paths.values():
                attention(*inputs)  # first calls allocate
            for _ in range(args.rounds):
                for name, attention in paths.items():
                    start = time.perf_counter()
                    attention(*inputs)
                    seconds[name].append(time.perf_counter() - start)
            ref, kernel = (statistics.median(seconds[name]) for name in paths)
            flops = prompts * 4 * HEADS * HEAD_DIM * tokens * tokens / 2
            print(f"| {str(dtype).removeprefix('torch.')} | {prompts}x{tokens} | {ref * 1e3:.3f} | {kernel * 1e3:.3f} | "
                  f"{ref / kernel:.1f}x | {flops / kernel / 1e9:.0f} |")


if __name__ == "__main__":
    main()
