"""Graph backends: one replayable decode step per (stage, bucket) over static buffers.

`CudaStageGraph` records a `torch.cuda.CUDAGraph`; `EagerStageGraph` runs the stage's forward over
the very same buffers (CPU, `--no-graphs`, and the reference that capture verifies against).
`StageGraphs` holds one stage's graphs and does what replay needs around them: copy the rows in,
reset the padding rows, replay, hand back the rows out.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from graphrt.capture.buckets import BucketPlan
from graphrt.model import SCRATCH_BLOCK
from graphrt.model.batch import StepMetadata
from graphrt.model.kv_cache import StageKVCache
from graphrt.model.llama import Stage


@dataclass
class StaticInputs:
    """The buffers a (stage, bucket) graph reads; their addresses never change after capture."""

    x: torch.Tensor  # (bucket,) token ids on stage 0, else (bucket, hidden_size)
    meta: StepMetadata  # decode metadata over static tensors, seq_lens_host=None

    @staticmethod
    def allocate(stage: Stage, bucket: int, max_blocks: int) -> StaticInputs:
        device = stage.device
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.int64, device=device)  # noqa: E731
        if stage.is_first:
            x = zeros(bucket)
        else:
            x = torch.zeros(bucket, stage.cfg.hidden_size, dtype=stage.dtype, device=device)
        meta = StepMetadata(
            positions=zeros(bucket),
            slot_mapping=zeros(bucket),
            block_tables=zeros(bucket, max_blocks),
            seq_lens=torch.ones(bucket, dtype=torch.int64, device=device),
            logits_indices=torch.arange(bucket, device=device),
            seq_lens_host=None,
        )
        return StaticInputs(x, meta)

    def load(self, x: torch.Tensor, meta: StepMetadata) -> None:
        """Copy `rows` real rows in; padding rows read and write only the scratch block."""
        rows, width = meta.block_tables.shape
        static = self.meta
        self.x[:rows].copy_(x, non_blocking=True)
        static.positions[:rows].copy_(meta.positions, non_blocking=True)
        static.slot_mapping[:rows].copy_(meta.slot_mapping, non_blocking=True)
        static.block_tables[:rows, :width].copy_(meta.block_tables, non_blocking=True)
        static.block_tables[:rows, width:].fill_(SCRATCH_BLOCK)
        static.seq_lens[:rows].copy_(meta.seq_lens, non_blocking=True)
        self.pad(rows)

    def pad(self, first: int = 0) -> None:
        """Make rows `first` on padding: they read and write only the scratch block."""
        static = self.meta
        self.x[first:].zero_()
        static.positions[first:].zero_()
        static.slot_mapping[first:].fill_(SCRATCH_BLOCK)  # slot 0 lies in the scratch block
        static.block_tables[first:].fill_(SCRATCH_BLOCK)
        static.seq_lens[first:].fill_(1)


class EagerStageGraph:
    """The eager twin: the same static buffers, the stage's forward run directly."""

    mode = "eager"

    def __init__(self, stage: Stage, cache: StageKVCache, inputs: StaticInputs):
        self.stage, self.cache, self.inputs = stage, cache, inputs
        self.output: torch.Tensor | None = None

    def replay(self, max_seq_len: int | None = None) -> torch.Tensor:
        # Eagerly the host may say how long the longest context is, so attention reads only live blocks.
        meta = self.inputs.meta
        if max_seq_len is not None:
            meta = StepMetadata(**{**meta.__dict__, "seq_lens_host": [max_seq_len]})
        self.output = self.stage(self.inputs.x, meta, self.cache)
        return self.output


class CudaStageGraph:
    """A recorded CUDA graph of the stage's decode forward for one bucket."""

    mode = "graph"

    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: StaticInputs, output: torch.Tensor, capture_ms: float = 0.0):
        self.graph, self.inputs, self.output = graph, inputs, output
        self.capture_ms = capture_ms  # capture_begin to instantiated: the warm-ups before it are not counted

    @staticmethod
    def record(
        stage: Stage, cache: StageKVCache, inputs: StaticInputs, pool, side_stream: torch.cuda.Stream, num_warmups: int = 2
    ) -> CudaStageGraph:
        """Warm up and capture on `side_stream`, one per stage: every new stream would get its own
        cuBLAS workspace, and graphs sharing a pool should be captured on the same stream.

        The graph is kept (`keep_graph=True`) so its nodes can be counted, and instantiated here
        rather than on the first replay, which would otherwise pay for it while serving."""
        with torch.cuda.device(stage.device):  # capture follows the current device, not the tensors'
            caller = torch.cuda.current_stream()
            side_stream.wait_stream(caller)
            with torch.cuda.stream(side_stream):
                for _ in range(num_warmups):  # lazy initialisation (cuBLAS handles, autotuning) happens here
                    stage(inputs.x, inputs.meta, cache)
                with host_syncs_raise():  # a sync inside capture is a bare CUDA error; here it names its op
                    stage(inputs.x, inputs.meta, cache)
            side_stream.synchronize()
            capture_from = time.perf_counter()
            graph, kept = new_cuda_graph()
            # Begin and end inside the try: capture_begin puts the allocator in capture mode before
            # cudaStreamBeginCapture can fail, and capture_end raises when CUDA invalidated the
            # capture without the op that did it raising (a sync from another thread, say); both
            # would leave the allocator recording into the pool.
            with torch.cuda.stream(side_stream):
                try:
                    graph.capture_begin(pool=pool)
                    output = stage(inputs.x, inputs.meta, cache)
                    graph.capture_end()
                    if kept:  # otherwise capture_end instantiated it
                        graph.instantiate()
                except BaseException:
                    abandon_capture(graph, stage.device, pool)
                    raise
            capture_ms = (time.perf_counter() - capture_from) * 1000
            caller.wait_stream(side_stream)
        return CudaStageGraph(graph, inputs, output, capture_ms)

    def replay(self, max_seq_len: int | None = None) -> torch.Tensor:
        self.graph.replay()
        return self.output


def new_cuda_graph() -> tuple[torch.cuda.CUDAGraph, bool]:
    """A graph kept after capture, so its nodes can be counted (torch 2.8 and newer), and whether
    it was; an older torch instantiates it at capture_end and keeps nothing to count."""
    try:
        return torch.cuda.CUDAGraph(keep_graph=True), True
    except TypeError:
        return torch.cuda.CUDAGraph(), False


@contextmanager
def host_syncs_raise():
    """Any op that makes the host wait for the device raises, naming itself (a warm-up's check)."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def abandon_capture(graph: torch.cuda.CUDAGraph, device: torch.device, pool) -> None:
    """Undo what a failed capture left behind, wherever it failed, so later captures in this
    process still work. The exception already raised is the one the caller sees; the ones from
    cleaning up are dropped.

    torch's CUDAGraph (aten/src/ATen/cuda/CUDAGraph.cpp) takes the allocator into capture mode for
    the pool (beginAllocateToPool, a reference to the pool) before cudaStreamBeginCapture, and out
    of it (endAllocateToPool) only after cudaStreamEndCapture succeeded; a graph counts as captured,
    and gives its pool reference back on reset(), only once capture_end got through. So:
    - the stream may still be capturing (the op raised): end it, which fails when CUDA invalidated
      the capture and ends it anyway;
    - a graph that counts as captured (a failed instantiate, or an op that raised without CUDA
      noticing) is reset, which returns its pool reference;
    - otherwise, if the allocator is still recording into the pool, that is ended and the pool
      reference it took is returned; if torch already ended it ("Invalid capture." after a
      successful end), the reference is left, and the pool is never used again (capture_stage
      starts a new one after any failure).
    The next `empty_cache()` would assert on an allocator left in capture mode. (The pinned host
    allocator's record of the capture, torch >= 2.9, has no Python binding to end; it routes by
    capture id, which no stream carries once the capture has ended.)
    """
    try:
        graph.capture_end()
    except RuntimeError:
        pass
    try:
        graph.pool()  # raises unless the graph counts as captured
    except RuntimeError:
        pass
    else:
        graph.reset()
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        torch._C._cuda_endAllocateToPool(index, pool)
    except RuntimeError:  # not recording into the pool: torch ended it, or never began
        return
    torch._C._cuda_releasePool(index, pool)


class StageGraphs:
    """One stage's graphs, one per bucket, sharing a memory pool (CUDA) and the stage's KV cache."""

    def __init__(self, stage: Stage, plan: BucketPlan, graphs: dict[int, CudaStageGraph | EagerStageGraph]):
        self.stage = stage
        self.plan = plan
        self.graphs = graphs

    def run(self, x: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        """Decode rows (x, meta) through the smallest bucket that holds them; returns their outputs."""
        rows = meta.block_tables.shape[0]
        graph = self.graphs[self.plan.bucket_for(rows)]
        graph.inputs.load(x, meta.to(self.stage.device))
        return graph.replay(meta.max_seq_len)[:rows]

    def mode(self, bucket: int) -> str:
        return self.graphs[bucket].mode
