"""A decoder layer's elementwise ops on the CPU: the compiled kernels against the torch references.

    python benchmarks/elementwise_cpu.py [--rows 1,32,512] [--calls 200]

For each dtype, op and row count, on SmolLM2-135M's shapes (hidden 576, 9 query and 3 KV heads of
64, intermediate 1536): the median microseconds per call of each, the calls alternating. Results
go in benchmarks/results.md with the CPU they ran on.
"""

from __future__ import annotations

import argparse

import torch

from graphrt.kernels.cpu import extension as cpu_extension
from graphrt.kernels.cpu import kernel_choice as cpu_kernel_choice
from graphrt.kernels.cpu.info import cpu_model_name
from graphrt.kernels.cpu.kernel_choice import TORCH_OPS, LayerShapes, compiled_ops, timing_inputs

SMOLLM2 = LayerShapes(num_heads=9, num_kv_heads=3, head_dim=64, hidden_size=576, intermediate_size=1536)
OPS = ("rms_norm", "apply_rotary", "silu_and_mul")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,32,512")
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    if not cpu_extension.available():
        raise SystemExit(f"the compiled CPU kernels are unavailable: {cpu_extension.unavailable_reason()}")
    cpu_kernel_choice.NUM_CALLS = args.calls
    compiled = compiled_ops()
    print(f"{cpu_model_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}, {args.calls} calls each")
    print("| dtype | op | rows | torch us | compiled us | speed-up |")
    print("|---|---|---:|---:|---:|---:|")
    for dtype in (torch.float32, torch.bfloat16):
        for op in OPS:
            for rows in (int(r) for r in args.rows.split(",")):
                inputs = timing_inputs(op, SMOLLM2, rows, 16, dtype)
                seconds = cpu_kernel_choice.time_paths({"compiled": compiled[op], "torch": TORCH_OPS[op]}, inputs)
                name = str(dtype).removeprefix("torch.")
                print(f"| {name} | {op} | {rows} | {seconds['torch'] * 1e6:.1f} | {seconds['compiled'] * 1e6:.1f} | "
                      f"{seconds['torch'] / seconds['compiled']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
