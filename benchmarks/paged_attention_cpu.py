"""Paged decode attention on the CPU: the compiled kernel against the torch reference.

    python benchmarks/paged_attention_cpu.py [--batch 32] [--rounds 15] [--calls 10] [--threads 1,2]

SmolLM2-135M shapes (9 query heads, 3 KV heads, head_dim 64, 16-token blocks), --batch rows whose
contexts are drawn uniformly from each range, blocks shuffled through the cache. For every dtype,
context range and thread count, each round times --calls calls of the reference, then of the
kernel (interleaved, so a busy machine slows both alike); the table gives the medians over rounds
of the time per call, and the kernel's K/V read rate (each live K/V byte read once).

glibc is told to keep freed memory: by default it hands the reference's gathered K/V (up to 10 MB
a call) back to the OS after each call, and page-faulting it in again made the reference 2-4x
slower here, by an amount that depended on which shapes ran before. Pinned, the reference is
timed at its best, so the speed-ups are conservative.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch

from graphrt.kernels import paged_attention
from graphrt.kernels.cpu import extension as cpu_extension
from graphrt.kernels.cpu import paged_attention as paged_attention_cpu
from graphrt.kernels.cpu.info import cpu_model_name

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
CONTEXTS = [(20, 200), (120, 382)]
DTYPES = [torch.float32, torch.bfloat16]
ATTENTIONS = (paged_attention.paged_decode_attention, paged_attention_cpu.paged_decode_attention)  # reference first


def decode_inputs(batch: int, shortest: int, longest: int, dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    seq_lens = torch.randint(shortest, longest + 1, (batch,), generator=generator)
    max_blocks = -(-longest // BLOCK_SIZE)
    num_blocks = 1 + batch * max_blocks  # block 0 is scratch, as in the engine
    block_tables = (torch.randperm(num_blocks - 1, generator=generator) + 1).view(batch, max_blocks)
    cache_shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(cache_shape, generator=generator).to(dtype)
    v_cache = torch.randn(cache_shape, generator=generator).to(dtype)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=generator).to(dtype)
    return q, k_cache, v_cache, block_tables, seq_lens, HEAD_DIM**-0.5, int(seq_lens.max())


def keep_freed_memory() -> None:
    """glibc: serve allocations up to 32 MB from the heap and never trim it (no-op without glibc)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # mallopt parameters, from malloc.h
    libc.mallopt(m_mmap_threshold, 32 << 20)  # the largest glibc allows
    libc.mallopt(m_trim_threshold, 1 << 30)


def seconds_per_call(attention, inputs, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        attention(*inputs)
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=10, help="calls per timing")
    parser.add_argument("--threads", default="1,2")
    args = parser.parse_args()
    if not cpu_extension.available():
        raise SystemExit(f"the CPU kernel is unavailable: {cpu_extension.unavailable_reason()}")
    keep_freed_memory()

    print(f"{cpu_model_name()}, torch {torch.__version__}, batch {args.batch}, heads {HEADS}/{KV_HEADS}, "
          f"head_dim {HEAD_DIM}, block {BLOCK_SIZE}; median of {args.rounds} interleaved rounds of {args.calls} calls")
    print("| dtype | context | threads | reference ms | kernel ms | speed-up | kernel K/V GB/s |")
    print("|---|---|---|---|---|---|---|")
    for dtype in DTYPES:
        for shortest, longest in CONTEXTS:
            inputs = decode_inputs(args.batch, shortest, longest, dtype)
            torch.testing.assert_close(  # a wrong kernel is fast for nothing
                paged_attention_cpu.paged_decode_attention(*inputs), paged_attention.paged_decode_attention(*inputs),
                atol=2e-2, rtol=2e-2,
            )
            kv_bytes = 2 * int(inputs[4].sum()) * KV_HEADS * HEAD_DIM * inputs[1].element_size()
            for threads in map(int, args.threads.split(",")):
                torch.set_num_threads(threads)
                times = {attention: [] for attention in ATTENTIONS}
                for _ in range(args.rounds):
                    for attention in ATTENTIONS:
                        times[attention].append(seconds_per_call(attention, inputs, args.calls))
                reference, kernel = (statistics.median(times[attention]) for attention in ATTENTIONS)
                print(f"| {str(dtype).removeprefix('torch.')} | {shortest}-{longest} | {threads} "
                      f"| {reference * 1e3:.3f} | {kernel * 1e3:.3f} | {reference / kernel:.2f}x "
                      f"| {kv_bytes / kernel / 1e9:.1f} |")


if __name__ == "__main__":
    main()
