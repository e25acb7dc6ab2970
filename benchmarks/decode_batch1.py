"""Decode tokens/s at batch 1: graphrt against transformers' `generate`, in the same process.

    python benchmarks/decode_batch1.py [--model DIR] [--pp 1] [--tokens 128] [--repeats 3]

Both run the same chat prompt greedily for the same number of new tokens (EOS ignored). Decode
rate excludes the prompt: graphrt's from its step timers, transformers' from the difference
between a 1-token and an N-token `generate`. A roofline is a measured bandwidth divided by the
bytes of weights one decode step reads: the memory's (a plain streaming read), and what a batch-1
matmul streams, with `F.linear` on dense weights (transformers' path, MKL on x86) and with
graphrt's CPU matmul on weights packed for oneDNN (graphrt/kernels/cpu/linear.py).
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
import transformers

from graphrt import LLM, SamplingParams
from graphrt.kernels.cpu.linear import can_pack, linear, pack_weight

PROMPT = "Explain pipeline parallelism to a new engineer."


def read_bandwidth_gb_s(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Plain streaming read (torch.sum over 1 GiB): what the memory system gives at best."""
    data = torch.ones(num_bytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return num_bytes / best / 1e9


def gemv_bandwidth_gb_s(packed: bool, hidden: int = 576, num_bytes: int = 512 << 20, repeats: int = 5) -> float:
    """Batch-1 matmuls over 512 MB of (4 * hidden, hidden) matrices, far beyond the caches: the
    rate at which `F.linear` (dense) or graphrt's `linear` (packed) streams weights."""
    matrices = [torch.randn(4 * hidden, hidden) for _ in range(num_bytes // (16 * hidden * hidden))]
    if packed:
        matrices = [pack_weight(m) for m in matrices]
    x = torch.randn(1, hidden)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for weight in matrices:
            linear(x, weight)
        best = min(best, time.perf_counter() - start)
    return sum(m.numel() * 4 for m in matrices) / best / 1e9


def graphrt_decode(llm: LLM, prompt_ids: list[int], tokens: int, repeats: int) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate(prompt_ids, SamplingParams(max_tokens=4, temperature=0))  # warm-up
    rates = []
    for _ in range(repeats):
        stats = llm.engine.stats
        steps, seconds = stats.decode_tokens, stats.decode_seconds
        llm.generate(prompt_ids, params)
        rates.append((stats.decode_tokens - steps) / (stats.decode_seconds - seconds))
    return max(rates)


def hf_decode(model, prompt_ids: list[int], tokens: int, repeats: int) -> float:
    ids = torch.tensor([prompt_ids])

    def timed(new_tokens: int) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        return time.perf_counter() - start

    timed(4)  # warm-up
    rates = []
    for _ in range(repeats):
        rates.append((tokens - 1) / (timed(tokens) - timed(1)))
    return max(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder [default: SmolLM2-135M-Instruct]")
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    llm = LLM(model=args.model, pp=args.pp, dtype="float32")
    prompt_ids = llm.chat_prompt(PROMPT)
    ours = graphrt_decode(llm, prompt_ids, args.tokens, args.repeats)
    weight_bytes = llm.engine.weight_bytes
    model_dir = llm.model_dir
    del llm
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    theirs = hf_decode(model, prompt_ids, args.tokens, args.repeats)
    bandwidths = {"streaming read": read_bandwidth_gb_s(), "batch-1 F.linear, dense": gemv_bandwidth_gb_s(packed=False)}
    if can_pack(torch.device("cpu"), torch.float32):
        bandwidths["batch-1 linear, packed for oneDNN"] = gemv_bandwidth_gb_s(packed=True)
    memory_roofline = bandwidths["streaming read"] * 1e9 / weight_bytes

    print(f"machine: {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"weights read per step: {weight_bytes / 1e6:.0f} MB")
    for name, gb_s in bandwidths.items():
        print(f"{name}: {gb_s:.1f} GB/s -> roofline {gb_s * 1e9 / weight_bytes:.1f} tok/s")
    print("| engine | decode tok/s | weight GB/s | share of the memory roofline |")
    print("|---|---|---|---|")
    for name, rate in ((f"graphrt pp={args.pp}", ours), ("transformers generate", theirs)):
        print(f"| {name} | {rate:.1f} | {rate * weight_bytes / 1e9:.1f} | {rate / memory_roofline:.0%} |")
    print(f"ratio graphrt / transformers: {ours / theirs:.2f}x")


if __name__ == "__main__":
    main()
