"""`graphrt bench`'s workload through graphrt variants in one process, interleaved, medians reported.

    python benchmarks/cpu_decode_ab.py [--baseline fa12662] [--rounds 3] [--requests 64] [--hf] [--model DIR]

Variants: `baseline` runs the torch kernels as they were at the --baseline commit (read with `git
show`) on dense matmul weights (F.linear, MKL); `dense` the current kernels on dense weights;
`packed` the current kernels on weights packed for oneDNN (graphrt/kernels/cpu/linear.py); `auto` the
current kernels on the matmul paths measured at load (packed or compiled panels where they win),
what a CPU float32 engine runs. On a shared machine only the interleaved medians mean anything. `--hf` adds
one run of transformers' static-batch generate, as `graphrt bench --compare-hf` does.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import inspect
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from graphrt import LLM
from graphrt.kernels.cpu.linear import linear
from graphrt.kernels.torch_ops import TORCH
from graphrt.tools.bench import make_workload, run_graphrt, run_transformers

REPO = Path(__file__).resolve().parent.parent
# Imports in the baseline's kernel modules of what has moved since: old line -> the line that imports it now.
MOVED_IMPORTS = {"from graphrt.config import RopeConfig": "from graphrt.kernels.rotary import RopeConfig"}


def without_later_keywords(function):
    """`function` called with only the keyword arguments it takes: the model passes some that a
    baseline kernel predates (paged_prefill_attention's device_seq_lens, where the decode rows riding
    in a prompt chunk read their lengths; the baseline computes them from the host's list)."""
    taken = set(inspect.signature(function).parameters)

    @functools.wraps(function)
    def call(*args, **kwargs):
        return function(*args, **{key: value for key, value in kwargs.items() if key in taken})

    return call


def kernels_at(commit: str, folder: Path):
    """The torch KernelSet as it was at `commit`."""
    modules = {}
    for name in ("activation", "paged_attention", "rmsnorm", "rotary"):
        source = subprocess.run(
            ["git", "show", f"{commit}:kernels/{name}.py"], cwd=REPO, check=True, capture_output=True, text=True
        ).stdout
        for old, new in MOVED_IMPORTS.items():
            source = source.replace(old, new)
        path = folder / f"baseline_{name}.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location(f"baseline_{name}", path)
        modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(modules[name])
    functions = {
        "rms_norm": modules["rmsnorm"].rms_norm,
        "apply_rotary": modules["rotary"].apply_rotary,
        "silu_and_mul": modules["activation"].silu_and_mul,
        "write_kv": modules["paged_attention"].write_kv,
        "paged_decode_attention": modules["paged_attention"].paged_decode_attention,
        "paged_prefill_attention": modules["paged_attention"].paged_prefill_attention,
    }
    return dataclasses.replace(
        TORCH, name=f"torch@{commit}", **{op: without_later_keywords(function) for op, function in functions.items()}
    )


def gate_up_silu(silu_and_mul, x, weight):
    return silu_and_mul(linear(x, weight))


def on_every_weight_form(ops):
    """The torch kernels `ops` with graphrt's CPU matmul, which reads a weight in any form (dense,
    packed, panels), and the gate/up matmul followed by `ops`' own silu_and_mul; no one-call decode step."""
    return dataclasses.replace(
        ops, linear=linear, gate_up_silu=functools.partial(gate_up_silu, ops.silu_and_mul), decode_layers=None
    )


def load(matmuls: str, ops, model: str | None) -> LLM:
    """The model on `matmuls` (a GRAPHRT_MATMUL mode), running the torch kernels `ops`."""
    before = os.environ.get("GRAPHRT_MATMUL")
    os.environ["GRAPHRT_MATMUL"] = matmuls
    try:
        llm = LLM(model=model)
    finally:
        if before is None:
            del os.environ["GRAPHRT_MATMUL"]
        else:
            os.environ["GRAPHRT_MATMUL"] = before
    for stage in llm.engine.pipeline.stages:
        stage.use_kernels(on_every_weight_form(ops))
    return llm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="fa12662", help="commit whose torch kernels the baseline runs")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--hf", action="store_true")
    parser.add_argument("--model", default=None, help="model folder [default: SmolLM2-135M-Instruct]")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        baseline_ops = kernels_at(args.baseline, Path(tmp))
        variants = {
            "baseline": load("dense", baseline_ops, args.model),
            "dense": load("dense", TORCH, args.model),
            "packed": load("packed", TORCH, args.model),
            "auto": load("auto", TORCH, args.model),
        }
    engine = variants["auto"].engine
    workload = make_workload(args.requests, (16, 64), (16, 128), engine.model_config.vocab_size, seed=0)
    tok_s: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, llm in variants.items():
            tok_s[name].append(run_graphrt(llm, workload).output_tok_s)
            print(f"{name}: {tok_s[name][-1]:.1f} tok/s", file=sys.stderr)
    for name, values in tok_s.items():
        print(f"graphrt {name}: median {statistics.median(values):.1f} tok/s of {[round(v, 1) for v in values]}")
    if args.hf:
        model_dir, dtype, batch = engine.model_dir, engine.dtype, engine.plan.max_batch
        for llm in variants.values():
            llm.engine.close()
        hf = run_transformers(model_dir, workload, batch, dtype).output_tok_s
        print(f"transformers: {hf:.1f} tok/s")
        for name, values in tok_s.items():
            print(f"graphrt {name} / transformers: {statistics.median(values) / hf:.2f}x")


if __name__ == "__main__":
    main()
