"""Each CPU matmul path on the default model's weight shapes, weights read from memory as in a step.

    python benchmarks/matmul_cpu.py [--dtype bfloat16] [--rows 1,8,32,512] [--repeats 5]

For each shape (q/k/v, o, gate/up, down, LM head) it makes 30 weights (2 of the LM head), more
than the L3 cache holds, in every form this machine runs (F.linear's dense weight, oneDNN's packed
one, graphrt's panels), and times a sweep over all of them at each row count, paths one after the
other, keeping the median of --repeats sweeps. Prints microseconds per matmul, the rate the weight
was read at and GFLOP/s; and, first, the rate torch's threads read a 256 MB tensor at, for scale.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from graphrt.kernels.cpu.linear import convert, linear
from graphrt.kernels.cpu.matmul_choice import available_paths
from graphrt.tools.doctor import DEFAULT_MODEL_MATMULS


def read_rate() -> float:
    big = torch.ones(64 << 20)  # 256 MB of float32
    big.sum()
    start = time.perf_counter()
    for _ in range(5):
        big.sum()
    return 5 * big.numel() * 4 / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rows", default="1,8,32,512")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    rows_list = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    print(f"{torch.get_num_threads()} threads, {args.dtype}; reading a 256 MB tensor: {read_rate():.1f} GB/s")
    for name, (out_features, in_features, _) in DEFAULT_MODEL_MATMULS.items():
        dense = [torch.randn(out_features, in_features).mul_(0.05).to(dtype) for _ in range(30 if out_features < 10000 else 2)]
        paths = available_paths(torch.device("cpu"), dtype, (out_features, in_features))
        if name == next(iter(DEFAULT_MODEL_MATMULS)):
            print("| shape | rows | " + " | ".join(f"{path}: us, GB/s, GFLOP/s" for path in paths) + " |")
            print("|---|---|" + "---|" * len(paths))
        forms = {path: [convert(path, w) for w in dense] for path in paths}
        weight_bytes = out_features * in_features * dense[0].element_size()
        for rows in rows_list:
            x = torch.randn(rows, in_features).to(dtype)
            cells = []
            for path, weights in forms.items():
                for w in weights[:2]:  # first calls: oneDNN builds its primitive
                    linear(x, w)
                sweeps = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    for w in weights:
                        linear(x, w)
                    sweeps.append((time.perf_counter() - start) / len(weights))
                s = statistics.median(sweeps)
                cells.append(f"{s * 1e6:.1f}, {weight_bytes / s / 1e9:.1f}, {2 * out_features * in_features * rows / s / 1e9:.0f}")
            print(f"| {name} | {rows} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
