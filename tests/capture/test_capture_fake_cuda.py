"""Capture on a model of torch's CUDA graph API: a capture that fails anywhere leaves the allocator
out of capture mode and its pool unshared; warm-up and recording are timed apart.

torch.cuda is replaced by a model of what torch's CUDAGraph does with the caching allocator
(aten/src/ATen/cuda/CUDAGraph.cpp): capture_begin takes the allocator into capture mode for the
pool (one reference to it) before cudaStreamBeginCapture, which can fail; capture_end runs
cudaStreamEndCapture first and raises, before taking the allocator out of capture mode, when CUDA
invalidated the capture, even if no op raised; a graph gives its pool reference back on reset()
only once capture_end got through. So these run on a CPU. The real thing: test_capture_cuda_failure.py.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import pytest
import torch

import graphrt.capture.capture as capture_module
from graphrt import LLM
from graphrt.capture.capture import GraphRecord, capture_stage, record_cuda_graph
from graphrt.capture.graphs import CudaStageGraph, EagerStageGraph, StaticInputs

DEVICE = torch.device("cuda", 0)


@dataclass
class FakeAllocator:
    references: dict = field(default_factory=dict)  # pool -> graphs and captures holding it
    recording: list = field(default_factory=list)  # pools a capture allocates into now

    def begin(self, pool) -> None:
        if pool in self.recording:
            raise RuntimeError("beginAllocateToPool: already recording to mempool_id")
        self.references[pool] = self.references.get(pool, 0) + 1
        self.recording.append(pool)

    def end(self, pool) -> None:
        if pool not in self.recording:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
        self.recording.remove(pool)

    def release(self, pool) -> None:
        self.references[pool] -= 1
        assert self.references[pool] >= 0


class FakeCuda:
    """What capture touches of torch.cuda and torch._C, with the allocator's state visible."""

    def __init__(self):
        self.allocator = FakeAllocator()
        self.capturing: FakeGraph | None = None
        self.fail_begin = False  # cudaStreamBeginCapture refuses
        self.invalidate = False  # the stage's forward invalidates the capture without raising
        self.fail_instantiate = False

    def graph(self, keep_graph: bool = False) -> FakeGraph:
        return FakeGraph(self)


class FakeGraph:
    def __init__(self, cuda: FakeCuda):
        self.cuda, self.captured, self.invalidated, self._pool = cuda, False, False, None

    def capture_begin(self, pool) -> None:
        self._pool = pool
        self.cuda.allocator.begin(pool)
        if self.cuda.fail_begin:
            raise RuntimeError("CUDA error: operation not permitted (cudaStreamBeginCapture)")
        self.cuda.capturing = self

    def capture_end(self) -> None:
        if self.cuda.capturing is not self:
            raise RuntimeError("CUDA error: cudaErrorIllegalState (the stream is not capturing)")
        self.cuda.capturing = None
        if self.invalidated:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
        self.cuda.allocator.end(self._pool)
        self.captured = True

    def instantiate(self) -> None:
        if self.cuda.fail_instantiate:
            raise RuntimeError("CUDA error: cudaGraphInstantiate failed")

    def pool(self):
        if not self.captured:
            raise RuntimeError("Called CUDAGraph::pool() without a preceding successful capture.")
        return self._pool

    def reset(self) -> None:
        if self.captured:
            self.cuda.allocator.release(self._pool)
            self.captured = False


class FakeStream:
    def wait_stream(self, other) -> None:
        pass

    def synchronize(self) -> None:
        pass


@pytest.fixture
def fake_cuda(monkeypatch) -> FakeCuda:
    cuda = FakeCuda()
    stream = FakeStream()
    monkeypatch.setattr(torch.cuda, "CUDAGraph", cuda.graph)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", lambda index, pool: cuda.allocator.end(pool), raising=False)
    monkeypatch.setattr(torch._C, "_cuda_releasePool", lambda index, pool: cuda.allocator.release(pool), raising=False)
    return cuda


class FakeStage:
    """A stage's forward as capture sees it: it runs, and may break the capture it runs in."""

    device = DEVICE

    def __init__(self, cuda: FakeCuda):
        self.cuda = cuda

    def __call__(self, x, meta, cache):
        if self.cuda.capturing is not None and self.cuda.invalidate:
            self.cuda.capturing.invalidated = True  # e.g. a sync from another thread: no op raises here
        return x * 2


def record(cuda: FakeCuda, pool=("pool", 1)):
    inputs = StaticInputs(torch.zeros(4), None)
    return CudaStageGraph.record(FakeStage(cuda), None, inputs, pool, FakeStream(), num_warmups=1)


def test_a_clean_capture_keeps_one_pool_reference_and_leaves_capture_mode(fake_cuda):
    graph = record(fake_cuda)
    assert fake_cuda.allocator.recording == [] and fake_cuda.allocator.references == {("pool", 1): 1}
    assert graph.graph.captured


@pytest.mark.parametrize("failure", ["invalidate", "fail_begin", "fail_instantiate"])
def test_a_failed_capture_leaves_the_allocator_out_of_capture_mode(fake_cuda, failure):
    """CUDA invalidates the capture and only capture_end says so; or cudaStreamBeginCapture
    refuses after the allocator began recording; or the captured graph will not instantiate."""
    setattr(fake_cuda, failure, True)
    with pytest.raises(RuntimeError):
        record(fake_cuda)
    assert fake_cuda.allocator.recording == [], "the allocator still records into the pool"
    assert fake_cuda.allocator.references == {("pool", 1): 0}, "the failed capture kept a pool reference"
    assert fake_cuda.capturing is None
    setattr(fake_cuda, failure, False)
    record(fake_cuda)  # the next capture into that pool begins: nothing is left recording into it


def test_an_op_that_raises_inside_capture_is_cleaned_up_too(fake_cuda, monkeypatch):
    def raising(self, x, meta, cache):
        if self.cuda.capturing is not None:
            self.cuda.capturing.invalidated = True
            raise RuntimeError("operation not permitted when stream is capturing")
        return x

    monkeypatch.setattr(FakeStage, "__call__", raising)
    with pytest.raises(RuntimeError, match="not permitted when stream is capturing"):
        record(fake_cuda)
    assert fake_cuda.allocator.recording == [] and fake_cuda.allocator.references == {("pool", 1): 0}


class PretendGraph(EagerStageGraph):
    """A captured graph, for capture_stage's bookkeeping: replays eagerly, so verification runs."""

    mode = "graph"


@pytest.fixture(scope="module")
def cpu_stage(tiny_model_factory):
    llm = LLM(model=tiny_model_factory(), buckets=[1, 2, 4, 8], kv_cache_tokens=1024)
    yield llm.engine
    llm.engine.close()


@pytest.mark.parametrize("broken", [8, 4], ids=["largest-bucket", "smaller-bucket"])
def test_every_bucket_after_a_failed_one_captures_into_a_fresh_pool(cpu_stage, monkeypatch, broken):
    """Largest first, into one pool; once a bucket fails (allow_eager), the rest share a new one,
    whether or not a graph already holds the old pool."""
    pools = iter(range(100))
    used: dict[int, int] = {}
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, next(pools)))
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: FakeStream())

    def fake_record(stage, cache, inputs, pool, side_stream, allow_eager):
        bucket = inputs.x.shape[0]
        used[bucket] = pool[1]
        if bucket == broken:
            return None, GraphRecord(stage.index, bucket, "eager", 0, None, None, None, "capture failed, running eagerly")
        return PretendGraph(stage, cache, inputs), GraphRecord(stage.index, bucket, "graph", 0, 0, None, None)

    monkeypatch.setattr(capture_module, "record_cuda_graph", fake_record)
    engine = cpu_stage
    max_blocks = -(-engine.max_model_len // engine.config.block_size)
    graphs, records = capture_stage(
        engine.pipeline.stages[0], engine.pipeline.caches[0], engine.plan, max_blocks, True, True, set(), show_progress=False,
    )
    assert {r.bucket: r.mode for r in records} == {b: "eager" if b == broken else "graph" for b in (1, 2, 4, 8)}
    before = [b for b in (8, 4, 2, 1) if b >= broken]
    after = [b for b in (8, 4, 2, 1) if b < broken]
    assert {used[b] for b in before} == {0}, used
    assert {used[b] for b in after} == {1}, used  # one new pool, shared by every later bucket


WARMUP_S = 0.05


class SlowFirstCalls(FakeStage):
    """A forward whose eager runs take WARMUP_S, the first one 8 * WARMUP_S more (a Triton kernel
    compiling on its first call), and whose recording is quick, as recording launches nothing."""

    calls = 0

    def __call__(self, x, meta, cache):
        if self.cuda.capturing is None:
            time.sleep(WARMUP_S * (9 if self.calls == 0 else 1))
            self.calls += 1
        return super().__call__(x, meta, cache)


def rehearse_untimed_device(stage, cache, inputs) -> list[float]:
    """rehearse_stage's two timed runs, without its checks (which need a real stage)."""
    seconds = []
    for _ in range(2):
        started = time.perf_counter()
        stage(inputs.x, inputs.meta, cache)
        seconds.append(time.perf_counter() - started)
    return seconds


def test_warm_up_and_recording_are_timed_apart(fake_cuda, monkeypatch):
    monkeypatch.setattr(capture_module, "rehearse_stage", rehearse_untimed_device)
    monkeypatch.setattr(capture_module, "pool_segment_bytes", lambda pool: 0)
    monkeypatch.setattr(capture_module, "graph_node_counts", lambda graph: (None, "not counted here"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    stage = SlowFirstCalls(fake_cuda)
    stage.index = 1
    graph, record = record_cuda_graph(stage, None, StaticInputs(torch.zeros(4), None), ("pool", 1), FakeStream(), False)
    assert record.mode == "graph" and graph.capture_ms == record.capture_ms
    # The rehearsal's two runs, two warm-ups and the host-sync check: five slow calls before
    # recording, the first of them the slowest, which the rehearsal's first run pays.
    assert record.warmup_ms >= 13 * WARMUP_S * 1000
    assert 10 * WARMUP_S * 1000 <= record.rehearsal_ms < record.warmup_ms, record
    # The first run over the second: about the extra 8 * WARMUP_S (less the second's overshoot, which
    # a loaded machine may stretch), and at most the rehearsal less twice the second run (not the
    # first run whole)
    assert 5 * WARMUP_S * 1000 <= record.first_calls_ms <= record.rehearsal_ms - 2 * WARMUP_S * 1000 + 1e-6, record
    assert record.capture_ms < WARMUP_S * 1000, record
    assert record.to_json()["first_calls_ms"] == record.first_calls_ms
