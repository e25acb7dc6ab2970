"""One way to build a stage (graphrt/runtime/stage_builder.py), for rank 0 and every stage process,
and a model that names no CPU-only path: the CPU wing reaches it only through its KernelSet."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

import graphrt
from graphrt.capture.buckets import BucketPlan
from graphrt.capture.capture import capture_stage
from graphrt.kernels.cpu.stage_kernels import choose_matmuls
from graphrt.kernels.torch_ops import TORCH
from graphrt.model.config import ModelConfig
from graphrt.model.kv_cache import StageKVCache
from graphrt.model.weights import WeightFiles
from graphrt.runtime.pipeline import partition_layers
from graphrt.runtime.stage_builder import choose_stage_ops, load_stage

PACKAGE = Path(graphrt.__file__).parent
CPU = torch.device("cpu")
# What only the CPU twin has: oneDNN's packed weights, the panel kernel, the compiled ops and their
# one-call decode step, OpenMP teams, the load watcher. The model sees the CPU wing only as a KernelSet.
CPU_ONLY = re.compile(r"mkldnn|onednn|panel|openmp|LoadWatch|load_watch|kernels[./]cpu|torch\.ops\.graphrt|compiled_", re.I)


def test_no_file_of_the_model_names_a_cpu_only_path():
    found = [
        f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}"
        for path in sorted((PACKAGE / "model").rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if CPU_ONLY.search(line)
    ]
    assert not found, "the model names CPU-only paths:\n" + "\n".join(found)


def calls_in(path: Path) -> set[str]:
    """The names of the functions a module calls."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            func = node.func
            names.add(func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else "")
    return names


def test_rank_0_and_every_stage_process_build_a_stage_with_the_same_functions():
    builders = {"load_stage", "choose_matmuls", "choose_stage_ops", "capture_stage"}
    worker = calls_in(PACKAGE / "distributed" / "worker.py")
    rank_0 = calls_in(PACKAGE / "runtime" / "pipeline.py") | calls_in(PACKAGE / "distributed" / "remote.py") | calls_in(
        PACKAGE / "engine" / "engine.py"
    )
    assert builders <= worker and builders <= rank_0
    for path in [*PACKAGE.rglob("*.py"), *(PACKAGE.parent / "capture").rglob("*.py")]:
        if path.name != "stage_builder.py":
            assert "Stage" not in calls_in(path), f"{path} builds a Stage itself; use graphrt.runtime.stage_builder.load_stage"


@pytest.mark.parametrize("rank", [0, 1])
def test_a_stage_built_and_captured_as_the_worker_does_leaves_its_kv_cache_zeroed(tiny_model_factory, rank):
    """Verification runs the largest bucket on random rows, which it writes into the cache; any left
    there would be read (masked) by attention in unwritten slots of live blocks."""
    model = tiny_model_factory()
    cfg = ModelConfig.from_dir(model)
    layers = partition_layers(cfg, 2)[rank]
    stage = load_stage(cfg, rank, 2, layers, CPU, torch.float32, 64, "torch", WeightFiles(model))
    chosen = choose_stage_ops(stage, choose_matmuls(stage, 4, "dense"), 4, 16, "torch")
    assert chosen.cpu is not None and set(chosen.cpu.paths.values()) == {"torch"} and stage.ops.name == TORCH.name
    cache = StageKVCache.allocate(cfg, len(layers), 8, 16, CPU, torch.float32)
    written = []
    stage_forward = type(stage).forward

    def forward(self, x, meta, kv):
        out = stage_forward(self, x, meta, kv)
        written.append(bool(kv.k.any()))  # what verification left in the cache, before capture clears it
        return out

    type(stage).forward = forward
    try:
        graphs, records = capture_stage(stage, cache, BucketPlan((1, 2, 4)), 4, False, False, set(), show_progress=False)
    finally:
        type(stage).forward = stage_forward
    assert any(written), "verification wrote nothing into the cache: this test would show nothing"
    assert [r.bucket for r in records] == [1, 2, 4] and records[-1].max_abs_error is not None
    assert not cache.k.any() and not cache.v.any()
