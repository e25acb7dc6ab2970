"""Recording every (stage, bucket) decode graph, verifying each against eager before it is used."""

from __future__ import annotations

import gc
import logging
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace

import torch
from tqdm import tqdm

from graphrt.capture.buckets import BucketPlan
from graphrt.capture.cuda_info import graph_node_counts, pool_segment_bytes
from graphrt.capture.graphs import CudaStageGraph, EagerStageGraph, StageGraphs, StaticInputs
from graphrt.capture.rehearsal import RehearsalError, rehearse_stage
from graphrt.errors import GraphrtError
from graphrt.model import SCRATCH_BLOCK
from graphrt.model.batch import StepMetadata
from graphrt.model.kv_cache import StageKVCache
from graphrt.model.llama import Stage
from graphrt.profiling.nvtx import Ranges

logger = logging.getLogger("graphrt")

VERIFY_MAX_CONTEXT = 128  # verification contexts stay short so CPU capture is quick
# Relative to the largest output. A recorded graph and its reference run the same rows.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}
# An eager pair is checked with a padding row, so its reference runs one row fewer, which BLAS
# rounds otherwise: SmolLM2 in float32 with every matmul on F.linear (MKL) differed by 1.25e-4 of
# its largest logit at bucket 4, 1.5e-5 at 8 (the hidden states it amplifies reach 1.5e3 to 2.2e4),
# and under load the timing picks that path for some shapes. A fault in the static-buffer path (a
# wrong row, length or block) moves outputs by a good part of their size.
PADDED_TOLERANCE = {**TOLERANCE, torch.float32: 1e-3}


class CaptureError(GraphrtError):
    """A (stage, bucket) could not be recorded or replays differently from eager."""


@dataclass
class GraphRecord:
    stage: int
    bucket: int
    mode: str  # "graph" | "eager"
    capture_ms: float  # recording and instantiating the graph (a failed attempt: all of it)
    pool_bytes: int | None
    nodes: dict[str, int] | None
    max_abs_error: float | None
    note: str | None = None  # why a field is null, or why this pair fell back to eager
    # The rehearsal and warm-up runs before recording: first calls compile and autotune the Triton
    # kernels (a start with a warm TRITON_CACHE_DIR skips the compile) and set up cuBLAS.
    warmup_ms: float = 0.0
    # Of warmup_ms: the rehearsal's two runs, and its first run over the second's (what first calls
    # cost beyond a run: compiles, cache loads, lazy set-up; about 0 once an earlier pair paid them).
    rehearsal_ms: float = 0.0
    first_calls_ms: float = 0.0
    max_abs_error_allowed: float | None = None  # the tolerance max_abs_error was held to (it scales with the outputs)

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


def random_decode_rows(
    stage: Stage, rows: int, num_blocks: int, block_size: int, seed: int, max_context: int = VERIFY_MAX_CONTEXT
) -> tuple[torch.Tensor, StepMetadata]:
    """Plausible decode inputs: random tokens or hidden states, each row in its own real blocks,
    with contexts of at most `max_context` tokens."""
    gen = torch.Generator().manual_seed(seed)
    max_context = min(max_context, VERIFY_MAX_CONTEXT)
    max_blocks_per_row = -(-max_context // block_size)
    seq_lens = torch.randint(1, max_context + 1, (rows,), generator=gen)
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
    block_size = cache.k.shape[2]
    # The static block table's reach, but no position past the rotary table (max_model_len need
    # not be a whole number of blocks).
    longest = min(graph.inputs.meta.block_tables.shape[1] * block_size, stage.cos.shape[0])
    x, meta = random_decode_rows(stage, rows, cache.k.shape[1], block_size, seed, longest)
    with flushed_denormals(stage.device):
        return _compare(graph, stage, cache, x, meta, rows)


@contextmanager
def flushed_denormals(device: torch.device):
    """Random verification rows produce denormal floats, which x86 handles ~100x slower: on the
    CPU this made start-up 3x slower (6.8 s vs 2.3 s for SmolLM2). Off again afterwards, since the
    setting belongs to the caller's thread."""
    if device.type != "cpu" or not torch.set_flush_denormal(True):
        yield
        return
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def _compare(graph, stage: Stage, cache: StageKVCache, x: torch.Tensor, meta: StepMetadata, rows: int) -> tuple[float, float]:
    graph.inputs.load(x, meta)
    # Compared in float64: a float64 stage's differences are far below float32's step, where they
    # could only read as 0 or as a whole float32 step (5e-7 at 6, against a tolerance of 6e-10).
    replayed = graph.replay(meta.max_seq_len)[:rows].double().clone()
    if graph.mode == "graph":
        # The reference reads the rows as the graph does (its width, no host lengths) but not from
        # the graph's buffers: at another context width CUDA's attention rounds differently, which 8
        # bfloat16 layers of a random model grew past the tolerance on an H200 (bucket 32, 0.266
        # where 0.254 was allowed) with no fault at all. Widths agreeing is the kernels' tests' part.
        meta = as_read_by_graph(meta, graph.inputs.meta.block_tables.shape[1])
    reference = stage(x, meta, cache).double()
    return (replayed - reference).abs().max().item(), reference.abs().max().item()


def as_read_by_graph(meta: StepMetadata, width: int) -> StepMetadata:
    """`meta` as a graph reads it after StaticInputs.load: the block table padded with the scratch
    block to the graph's `width`, and no host lengths (a graph cannot take them)."""
    rows, narrow = meta.block_tables.shape
    tables = torch.full((rows, width), SCRATCH_BLOCK, dtype=meta.block_tables.dtype, device=meta.block_tables.device)
    tables[:, :narrow] = meta.block_tables
    return replace(meta, block_tables=tables, seq_lens_host=None)


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
    """Record (or set up eagerly) and verify a graph per bucket of `stage`; the cache is left zeroed.
    Largest bucket first, so smaller graphs reuse the pool memory the largest one reserved. Rank 0
    and every stage process capture their stages here."""
    ranges = ranges if ranges is not None else Ranges()
    pool = torch.cuda.graph_pool_handle() if use_cuda_graphs else None
    side_stream = torch.cuda.Stream(stage.device) if use_cuda_graphs else None
    graphs, records = {}, []
    bar = tqdm(sorted(plan.sizes, reverse=True), desc=f"capture stage {stage.index}", unit="bucket", disable=not show_progress, leave=False)
    for bucket in bar:
        bar.set_postfix(bucket=bucket)
        with ranges.capture(stage.index, bucket):  # record + verify, as one NVTX range
            inputs = StaticInputs.allocate(stage, bucket, max_blocks)
            if not use_cuda_graphs:
                graph, record = None, GraphRecord(stage.index, bucket, "eager", 0, None, None, None, "eager backend: no CUDA graph, so no pool or nodes")
            elif bucket in forced_eager:
                graph, record = None, GraphRecord(stage.index, bucket, "eager", 0, None, None, None, "marked eager in the graph cache (--allow-eager at capture)")
            else:
                graph, record = record_cuda_graph(stage, cache, inputs, pool, side_stream, allow_eager)
                if graph is None:
                    # A new pool after any failure: the failed graph may have held the pool's only
                    # reference (torch refuses a pool whose count fell to 0), and what a broken
                    # capture allocated or left recording there is not for later graphs to share.
                    pool = torch.cuda.graph_pool_handle()
            graph = graph or EagerStageGraph(stage, cache, inputs)
            record.max_abs_error, record.max_abs_error_allowed = verify_bucket(graph, stage, cache, plan, bucket)
            if record.max_abs_error is None and record.note is not None:
                record.note += f"; eager pairs are verified at bucket {plan.max_batch}"
            graphs[bucket] = graph
            records.append(record)
    bar.close()
    # Verification wrote random rows into the cache; unwritten slots of live blocks are read
    # (masked) by attention, and leftovers there could be NaN or slow denormals.
    cache.k.zero_()
    cache.v.zero_()
    stage.zero_expert_tokens()  # nor are its rows tokens any expert served
    records.sort(key=lambda r: r.bucket)
    return StageGraphs(stage, plan, graphs), records


def record_cuda_graph(stage, cache, inputs, pool, side_stream, allow_eager: bool) -> tuple[CudaStageGraph | None, GraphRecord]:
    """Record one (stage, bucket); on failure raise CaptureError, or with allow_eager return None."""
    bucket = inputs.x.shape[0]
    pool_before = pool_segment_bytes(pool)
    started = time.perf_counter()
    try:
        rehearsal = rehearse_stage(stage, cache, inputs)  # names the op; a failed capture would only say CUDA refused
        with frozen_gc():
            graph = CudaStageGraph.record(stage, cache, inputs, pool, side_stream)
        torch.cuda.synchronize(stage.device)
    except Exception as exc:  # the op that broke capture is in the message
        where = f"stage {stage.index}, bucket {bucket}"
        if isinstance(exc, RehearsalError):  # it names the pair, the op, its line and the fix
            cause = str(exc)
        elif isinstance(exc, RuntimeError):  # what CUDA and torch raise when capture breaks
            cause = f"capturing {where} failed: {exc}. A host sync or a dynamic shape inside the stage's forward breaks capture"
        else:
            cause = f"capturing {where} failed: {type(exc).__name__}: {exc}"
        if not allow_eager:
            raise CaptureError(f"{cause}; fix it, or pass --allow-eager to run this pair eagerly") from None
        note = f"capture failed, running eagerly: {str(exc).splitlines()[0]}"
        logger.warning("%s: %s", where, note)
        return None, GraphRecord(stage.index, bucket, "eager", (time.perf_counter() - started) * 1000, None, None, None, note)
    total_ms = (time.perf_counter() - started) * 1000
    pool_bytes = pool_segment_bytes(pool) - pool_before  # what this graph added to the stage's pool
    nodes, why_no_nodes = graph_node_counts(graph.graph)
    record = GraphRecord(stage.index, bucket, "graph", graph.capture_ms, pool_bytes, nodes, None, why_no_nodes)
    record.warmup_ms = total_ms - graph.capture_ms
    record.rehearsal_ms = sum(rehearsal) * 1000
    record.first_calls_ms = max(0.0, rehearsal[0] - rehearsal[1]) * 1000
    return graph, record


def verify_bucket(graph, stage: Stage, cache: StageKVCache, plan: BucketPlan, bucket: int) -> tuple[float | None, float | None]:
    """Replay against eager; raise CaptureError beyond tolerance. Returns the max abs error and the
    tolerance it was held to (None, None for a pair not checked).

    An eager pair runs the same code at every bucket, so only the largest is checked (with
    padding rows): that covers the static-buffer path without a slow start on a CPU.
    """
    if graph.mode != "graph" and bucket != plan.max_batch:
        return None, None
    rows = bucket if graph.mode == "graph" else max(1, bucket - 1)
    error, magnitude = verify(graph, stage, cache, rows, seed=stage.index * 1000 + bucket)
    limit = (TOLERANCE if graph.mode == "graph" else PADDED_TOLERANCE)[stage.dtype] * max(1.0, magnitude)
    if not error <= limit:
        raise CaptureError(
            f"stage {stage.index}, bucket {bucket}: replay differs from eager by {error:.3g} "
            f"(outputs up to {magnitude:.3g}, tolerance {limit:.3g}); the graph is not safe to use"
        )
    return error, limit
