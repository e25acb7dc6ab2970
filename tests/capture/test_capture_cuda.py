"""CUDA graph capture on a GPU: every (stage, bucket) recorded, replayed like eager, one pool per stage.

Two stages of a tiny random model share cuda:0 (as on a one-GPU machine). kernels="torch" keeps
these tests independent of Triton; one test repeats the main checks with kernels="triton".
Everything here is skipped without CUDA (tests/conftest.py). Captures that fail are in
test_capture_cuda_failure.py, each in a fresh interpreter.
"""

from __future__ import annotations

import gc

import pytest
import torch

from graphrt import LLM, SamplingParams
from graphrt.capture.capture import random_decode_rows
from graphrt.capture.cuda_info import pool_segment_bytes
from graphrt.capture.graphs import CudaStageGraph
from graphrt.model.llama import Stage
from graphrt.tools.synthetic import make_tiny_model
from helpers import run_counting_feed_reads

pytestmark = pytest.mark.cuda

BUCKETS = [1, 2, 4, 8]
# depth=0 and both stages on one GPU: n decode rows travel as one micro-batch of up to 8 rows (the
# largest bucket), not one per ring slot (EngineConfig.num_decode_micro_batches counts GPUs).
OPTIONS = dict(pp=2, devices=["cuda:0", "cuda:0"], dtype="float32", buckets=BUCKETS, kv_cache_tokens=8192, depth=0)
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
# 1 prompt decodes in bucket 1; 3 in bucket 4 (one padding row); 6 in bucket 8 (two); 16 as two micro-batches of 8.
PROMPT_SETS = [
    [[5, 9, 2]],
    [[3 + i] * (2 + 3 * i) for i in range(3)],
    [[3 + i] * (2 + 3 * i) for i in range(6)],
    [[(7 * i) % 90 + 1] * (4 + i) for i in range(16)],
]


def build(model, kernels: str = "torch", **options) -> LLM:
    return LLM(model=model, kernels=kernels, **{**OPTIONS, **options})


@pytest.fixture(scope="module")
def graph_llm(tiny_model_factory):
    llm = build(tiny_model_factory())
    yield llm
    llm.engine.close()


@pytest.fixture(scope="module")
def eager_llm(tiny_model_factory):
    llm = build(tiny_model_factory(), use_graphs=False)
    yield llm
    llm.engine.close()


def assert_captured(engine) -> None:
    assert engine.backend == "cuda"
    assert len(engine.graph_records) == 2 * len(BUCKETS)
    for record in engine.graph_records:
        where = f"stage {record.stage} bucket {record.bucket}: {record.note}"
        assert record.mode == "graph", where
        assert record.pool_bytes is not None, where
        assert record.nodes is not None and record.nodes["kernel"] > 0, where
        assert record.max_abs_error is not None, where  # verified against eager before use


def assert_replay_matches_eager(engine) -> None:
    """Fresh decode rows through each graph, against the stage's own forward on the same rows."""
    for stage, stage_graphs, cache in zip(engine.pipeline.stages, engine.graphs, engine.pipeline.caches):
        num_blocks, block_size = cache.k.shape[1], cache.k.shape[2]
        for bucket, graph in stage_graphs.graphs.items():
            assert graph.mode == "graph"
            x, meta = random_decode_rows(stage, bucket, num_blocks, block_size, seed=100 * stage.index + bucket)
            graph.inputs.load(x, meta)
            replayed = graph.replay()[:bucket].clone()
            direct = stage(x, meta, cache)  # reads only the live blocks; the graph reads the whole table, masked
            scale = max(1.0, direct.abs().max().item())
            torch.testing.assert_close(replayed, direct, rtol=1e-5, atol=1e-5 * scale)


def generated_ids(llm: LLM) -> list[list[int]]:
    return [out.token_ids for prompts in PROMPT_SETS for out in llm.generate(prompts, GREEDY)]


def test_every_stage_and_bucket_is_captured(graph_llm):
    assert_captured(graph_llm.engine)


def test_replay_equals_eager_for_every_bucket(graph_llm):
    assert_replay_matches_eager(graph_llm.engine)


def test_greedy_generate_with_graphs_equals_without(graph_llm, eager_llm):
    assert eager_llm.engine.backend == "eager"
    with_graphs = generated_ids(graph_llm)
    assert with_graphs == generated_ids(eager_llm)
    assert all(len(ids) == GREEDY.max_tokens for ids in with_graphs)
    assert graph_llm.engine.num_eager_fallbacks == 0



@pytest.fixture
def slow_stages(monkeypatch):
    """Each stage's forward also spins about a millisecond on its GPU (recorded into its graphs), so
    the host launches the next micro-batch before this one's tokens are back, as with a real model:
    an H200 ran the tiny model's steps faster than the host took them, and nothing read the feed."""
    forward = Stage.forward

    def slow(self, x, *args, **kwargs):
        torch.cuda._sleep(2_000_000)  # cycles, on the stage's current stream
        return forward(self, x, *args, **kwargs)

    monkeypatch.setattr(Stage, "forward", slow)


@pytest.mark.parametrize("devices", [["cuda:0", "cuda:0"], ["cuda:0", "cuda:1"]], ids=["one-gpu", "two-gpus"])
def test_async_scheduling_on_cuda_streams_gives_the_host_loops_tokens(tiny_model_factory, slow_stages, devices):
    """The token feed on the device: stage 0's stream waits for the last stage's event and reads
    the tokens it wrote, on one GPU (two streams) and across two GPUs. Seeded sampling on a model
    whose outputs depend on their inputs, so a stale or wrong fed token changes what follows."""
    if len(set(devices)) > torch.cuda.device_count():
        pytest.skip(f"needs {len(set(devices))} GPUs")
    prompts = [[(11 * i) % 90 + 1] * (3 + i) for i in range(12)]
    outputs = {}
    for async_scheduling in (True, False):
        llm = build(tiny_model_factory("llama3-rope"), devices=devices, async_scheduling=async_scheduling)
        engine = llm.engine
        params = [SamplingParams(max_tokens=20, temperature=1.0, seed=i) for i in range(len(prompts))]
        seqs, feed_reads = run_counting_feed_reads(engine, prompts, params)
        assert (feed_reads > 0) == async_scheduling
        assert engine.num_eager_fallbacks == 0
        outputs[async_scheduling] = [s.output_ids for s in seqs]
        engine.close()
    assert outputs[True] == outputs[False]


@pytest.fixture
def pool_growth(monkeypatch) -> dict:
    """(stage, bucket) -> bytes the stage's graph pool grew by while that graph was recorded,
    read from the allocator's segments of that pool (nothing else's memory is counted)."""
    growth = {}
    record = CudaStageGraph.record

    def measured_record(stage, cache, inputs, pool, *args, **kwargs):
        before = pool_segment_bytes(pool)
        graph = record(stage, cache, inputs, pool, *args, **kwargs)
        growth[stage.index, inputs.x.shape[0]] = pool_segment_bytes(pool) - before
        return graph

    monkeypatch.setattr(CudaStageGraph, "record", staticmethod(measured_record))
    gc.collect()
    torch.cuda.empty_cache()  # memory freed by earlier tests must not blur the numbers
    return growth


def test_graphs_of_a_stage_share_one_pool(tiny_model_factory, pool_growth):
    """Largest bucket first: it reserves the stage's pool, and the smaller graphs fit in what it freed."""
    engine = build(tiny_model_factory()).engine
    largest, smaller = BUCKETS[-1], BUCKETS[:-1]
    pools = []
    for stage_graphs in engine.graphs:
        stage = stage_graphs.stage.index
        stage_pools = {tuple(graph.graph.pool()) for graph in stage_graphs.graphs.values()}
        assert len(stage_pools) == 1, f"stage {stage}'s graphs use {len(stage_pools)} pools"
        pools += stage_pools
        assert pool_growth[stage, largest] > 0
        for bucket in smaller:
            assert pool_growth[stage, bucket] <= pool_growth[stage, largest] / 4, (stage, bucket, pool_growth)
    assert len(set(pools)) == 2, "each stage has its own pool"
    engine.close()


def test_recorded_pool_bytes_show_the_reuse(tiny_model_factory, pool_growth):
    """What the manifest reports as each graph's pool_bytes must tell the same story."""
    engine = build(tiny_model_factory()).engine
    largest, smaller = BUCKETS[-1], BUCKETS[:-1]
    for stage in range(2):
        records = {r.bucket: r for r in engine.graph_records if r.stage == stage}
        assert records[largest].pool_bytes > 0, (records[largest], pool_growth)
        for bucket in smaller:
            assert records[bucket].pool_bytes <= records[largest].pool_bytes / 4, (records[bucket], pool_growth)
    engine.close()


def test_triton_kernels_capture_and_replay(tiny_model_factory):
    pytest.importorskip("graphrt.kernels.triton_ops")
    model = tiny_model_factory()
    graphs = build(model, kernels="triton")
    eager = build(model, kernels="triton", use_graphs=False)
    assert graphs.engine.pipeline.stages[0].ops.name == "triton"
    assert_captured(graphs.engine)
    assert_replay_matches_eager(graphs.engine)
    assert generated_ids(graphs) == generated_ids(eager)
    graphs.engine.close()
    eager.engine.close()


def test_verify_steps_replay_graphs_and_keep_the_greedy_tokens(tmp_path):
    """Speculative decoding on graphs: a verify step's tokens are rows of the decode graph of its
    width, so the buckets reach max_num_seqs * (1 + k); tokens equal eager decoding without
    speculation (float64: no near tie a wider matmul could round the other way), drafts kept and
    rejected, and no step fell back to eager."""
    model = make_tiny_model(tmp_path / "looping", "llama-gqa-tied", weight_scale=0.6)  # its greedy output loops
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    options = dict(pp=2, devices=["cuda:0", "cuda:0"], dtype="float64", kernels="torch", kv_cache_tokens=8192, max_num_seqs=4)
    prompts = [[5, 9, 2, 5, 9], [3] * 7, [11, 12, 13, 11, 12, 13, 11], [40, 41]]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    speculating = LLM(model=model, speculative_config=ngram, **options)
    eager = LLM(model=model, use_graphs=False, **options)
    try:
        engine = speculating.engine
        assert engine.backend == "cuda" and max(engine.plan.sizes) >= 4 * (1 + 3)
        engine.scheduler.speculation.step_costs = None  # every draft proposed is verified
        got = [out.token_ids for out in speculating.generate(prompts, params)]
        assert got == [out.token_ids for out in eager.generate(prompts, params)]
        spec = engine.stats.spec
        assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens, spec.describe()
        assert engine.num_eager_fallbacks == 0
    finally:
        speculating.engine.close()
        eager.engine.close()
