"""Recording every (stage, bucket) decode graph, verifying each against eager before it is used."""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from graphrt.batch import StepMetadata
from graphrt.capture.buckets import BucketPlan
from graphrt.capture.cuda_info import graph_node_counts, pool_segment_bytes
from graphrt.capture.graphs import CudaStageGraph, EagerStageGraph, StageGraphs, StaticInputs
from graphrt.errors import GraphrtError
from graphrt.kv_cache import StageKVCache
from graphrt.model import Stage
from graphrt.profiling.nvtx import Ranges

VERIFY_MAX_CONTEXT = 128  # verification contexts stay short so CPU capture is quick
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}  # relative


class CaptureError(GraphrtError):
    """A (stage, bucket) could not be recorded or replays differently from eager."""


@dataclass
class GraphRecord:
    stage: int
    bucket: int
    mode: str  # "graph" | "eager"
    capture_ms: float
    pool_bytes: int | None
    nodes: dict[str, int] | None
    max_abs_error: float | None
    note: str | None = None  # why a field is null, or why this pair fell back to eager

    def to_json(self) -> dict:
        return asdict(self)


@contextmanager
def frozen_gc():
    """No garbage collection while recording: a collection could free memory the graph still uses."""
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()


def random_decode_rows(stage: Stage, rows: int, num_blocks: int, block_size: int, seed: int) -> tuple[torch.Tensor, StepMetadata]:
    """Plausible decode inputs: random tokens or hidden states, each row in its own real blocks."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks_per_row = -(-VERIFY_MAX_CONTEXT // block_size)
    seq_lens = torch.randint(1, VERIFY_MAX_CONTEXT + 1, (rows,), generator=gen)
    tables = torch.randint(1, num_blocks, (rows, max_blocks_per_row), generator=gen)
    positions = seq_lens - 1
    slots = tables[torch.arange(rows), positions // block_size] * block_size + positions % block_size
    if stage.is_first:
        x = torch.randint(0, stage.cfg.vocab_size, (rows,), generator=gen)
    else:
        x = torch.randn(rows, stage.cfg.hidden_size, generator=gen).to(stage.dtype)
    meta = StepMetadata(
        positions=positions,
        slot_mapping=slots,
        block_tables=tables,
        seq_lens=seq_lens,
        logits_indices=torch.arange(rows),
        seq_lens_host=seq_lens.tolist(),
    )
    return x.to(stage.device), meta.to(stage.device)


def verify(graph, stage: Stage, cache: StageKVCache, rows: int, seed: int) -> tuple[float, float]:
    """(max abs difference, largest magnitude) between a replay and a direct eager forward on the
    same fresh rows. A different batch shape may round differently, so callers compare relatively."""
    x, meta = random_decode_rows(stage, rows, cache.k.shape[1], cache.k.shape[2], seed)
    graph.inputs.load(x, meta)
    replayed = graph.replay(meta.max_seq_len)[:rows].float().clone()
    reference = stage(x, meta, cache).float()
    return (replayed - reference).abs().max().item(), reference.abs().max().item()


def capture_stage(
    stage: Stage,
    cache: StageKVCache,
    plan: BucketPlan,
    max_blocks: int,
    use_cuda_graphs: bool,
    allow_eager: bool,
    forced_eager: set[int],
    show_progress: bool = True,
    ranges: Ranges | None = None,
) -> tuple[StageGraphs, list[GraphRecord]]:
    """Largest bucket first, so smaller graphs reuse the pool memory the largest one reserved."""
    ranges = ranges if ranges is not None else Ranges()
    pool = torch.cuda.graph_pool_handle() if use_cuda_graphs else None
    warmup_stream = torch.cuda.Stream(stage.device) if use_cuda_graphs else None
    graphs, records = {}, []
    buckets = sorted(plan.sizes, reverse=True)
    bar = tqdm(buckets, desc=f"capture stage {stage.index}", unit="bucket", disable=not show_progress, leave=False)
    for bucket in bar:
        bar.set_postfix(bucket=bucket)
        with ranges.capture(stage.index, bucket):  # record + verify, as one NVTX range
            inputs = StaticInputs.allocate(stage, bucket, max_blocks)
            start = time.perf_counter()
            graph, note, pool_bytes, nodes = None, None, None, None
            if use_cuda_graphs and bucket not in forced_eager:
                pool_before = pool_segment_bytes(pool)
                try:
                    with frozen_gc():
                        graph = CudaStageGraph.record(stage, cache, inputs, pool, warmup_stream)
                    torch.cuda.synchronize(stage.device)
                except Exception as exc:  # the op that broke capture is in the message
                    where = f"stage {stage.index}, bucket {bucket}"
                    if not allow_eager:
                        raise CaptureError(
                            f"capturing {where} failed: {exc}. A host sync or a dynamic shape inside the "
                            "stage's forward breaks capture; fix it, or pass --allow-eager to run this pair eagerly"
                        ) from None
                    note = f"capture failed, running eagerly: {str(exc).splitlines()[0]}"
                    print(f"WARNING: {where}: {note}", flush=True)
                else:
                    pool_bytes = pool_segment_bytes(pool) - pool_before  # what this graph added to the stage's pool
                    nodes, why_no_nodes = graph_node_counts(graph.graph)
                    note = why_no_nodes
            elif use_cuda_graphs:
                note = "marked eager in the graph cache (--allow-eager at capture)"
            else:
                note = "eager backend: no CUDA graph, so no pool or nodes"
            if graph is None:
                graph = EagerStageGraph(stage, cache, inputs)
            capture_ms = (time.perf_counter() - start) * 1000
            error = None
            if graph.mode == "graph" or bucket == plan.max_batch:
                # An eager pair runs the same code at every bucket; checking the largest (with padding
                # rows) covers the static-buffer path without a slow start on a CPU.
                rows = bucket if graph.mode == "graph" else max(1, bucket - 1)
                error, magnitude = verify(graph, stage, cache, rows, seed=stage.index * 1000 + bucket)
                limit = TOLERANCE[stage.dtype] * max(1.0, magnitude)
                if not error <= limit:
                    raise CaptureError(
                        f"stage {stage.index}, bucket {bucket}: replay differs from eager by {error:.3g} "
                        f"(outputs up to {magnitude:.3g}, tolerance {limit:.3g}); the graph is not safe to use"
                    )
            elif note is not None:
                note += f"; eager pairs are verified at bucket {plan.max_batch}"
            graphs[bucket] = graph
            records.append(GraphRecord(stage.index, bucket, graph.mode, capture_ms, pool_bytes, nodes, error, note))
    bar.close()
    records.sort(key=lambda r: r.bucket)
    return StageGraphs(stage, plan, graphs), records
