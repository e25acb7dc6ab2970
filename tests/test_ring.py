"""The micro-batch ring: exact tokens under concurrency, aborts that free everything, busy stages."""

from __future__ import annotations

import random

import pytest

from graphrt import LLM, SamplingParams
from graphrt.errors import RequestError
from graphrt.synthetic import make_synthetic, predicted_busy_fraction
from helpers import run_counting_feed_reads

NUM_REQUESTS = 40


def make_workload(seed: int):
    rng = random.Random(seed)
    return [
        dict(
            prompt=[rng.randrange(1, 97) for _ in range(rng.randint(1, 40))],
            max_tokens=rng.randint(1, 24),
            arrival_tick=rng.randint(0, 60),
        )
        for _ in range(NUM_REQUESTS)
    ]


def run_arrivals(llm: LLM, workload) -> list[list[int]]:
    """Add each request at its arrival tick while the engine keeps stepping."""
    engine = llm.engine
    seqs = [None] * len(workload)
    tick = 0
    while tick <= 60 or engine.has_work():
        for i, request in enumerate(workload):
            if request["arrival_tick"] == tick:
                params = SamplingParams(max_tokens=request["max_tokens"], temperature=0, ignore_eos=True)
                seqs[i] = engine.add_request(request["prompt"], params)
        engine.step()
        tick += 1
    return [seq.output_ids for seq in seqs]


# Greedy outputs of this variant vary from token to token (the tied ones mostly echo their input),
# so a step fed a wrong or stale token shows.
VARIED = "llama3-rope"


@pytest.fixture(scope="module")
def alone(tiny_model_factory):
    """Each request's tokens when it runs by itself: one stage, nothing else in the batch."""
    llm = LLM(model=tiny_model_factory(VARIED), dtype="float64", kv_cache_tokens=4096, depth=0, async_scheduling=False)
    workload = make_workload(seed=7)
    reference = [
        llm.generate(r["prompt"], SamplingParams(max_tokens=r["max_tokens"], temperature=0, ignore_eos=True))[0].token_ids
        for r in workload
    ]
    return workload, reference


@pytest.mark.parametrize("depth", [0, 1, 2])
@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_concurrent_requests_get_the_tokens_they_get_alone(tiny_model_factory, alone, pp, depth):
    workload, reference = alone
    llm = LLM(
        model=tiny_model_factory(VARIED), pp=pp, depth=depth, dtype="float64",
        kv_cache_tokens=2048, prefill_chunk_size=24, buckets=[1, 2, 4, 8],
    )
    assert llm.engine.ring.num_slots == pp + depth
    assert run_arrivals(llm, workload) == reference
    allocator = llm.engine.allocator
    assert allocator.num_free == allocator.num_blocks - 1
    llm.engine.close()


@pytest.mark.parametrize("pp,depth", [(1, 0), (2, 0), (3, 1)])
def test_async_scheduling_stops_where_the_host_loop_stops(tiny_model_factory, pp, depth):
    """Steps launched before the host has seen the previous token: sequences that end on EOS end
    exactly where they end without async scheduling, the token sampled after it is dropped, and
    the next steps really took their input from the device feed. Seeded sampling, so each
    request's tokens do not depend on the batch it shares."""
    prompts = [request["prompt"] for request in make_workload(seed=11)]

    def run(async_scheduling: bool, eos: int | None):
        llm = LLM(
            model=tiny_model_factory(VARIED), pp=pp, depth=depth, dtype="float64", kv_cache_tokens=2048,
            prefill_chunk_size=24, buckets=[1, 2, 4, 8], async_scheduling=async_scheduling,
        )
        engine = llm.engine
        engine.eos_ids = {eos} if eos is not None else set()
        params = [SamplingParams(max_tokens=24, temperature=1.0, seed=i) for i in range(len(prompts))]
        seqs, feed_reads = run_counting_feed_reads(engine, prompts, params)
        assert (feed_reads > 0) == async_scheduling
        assert engine.allocator.num_free == engine.allocator.num_blocks - 1
        engine.close()
        return [(s.output_ids, s.finish_reason.value) for s in seqs]

    # An EOS that the model samples after the first token in as many outputs as possible.
    counts = {}
    for tokens, _ in run(False, eos=None):
        for token in set(tokens[1:]) - {tokens[0]}:
            counts[token] = counts.get(token, 0) + 1
    eos = max(counts, key=counts.get)
    with_async = run(True, eos)
    stopped = [ids for ids, reason in with_async if reason == "stop"]
    assert len(stopped) >= 5 and all(len(ids) > 1 and ids[-1] == eos and eos not in ids[:-1] for ids in stopped)
    assert with_async == run(False, eos)


@pytest.mark.parametrize("pp, depth, num_requests", [(2, 0, 1), (4, 0, 3), (1, 1, 1), (2, 1, 2)])
def test_async_scheduling_launches_ahead_with_fewer_rows_than_slots(tiny_model_factory, alone, pp, depth, num_requests):
    """Fewer decode rows than slots (one request at pp 2, the tail of every batch): the next step
    still goes into the slot whose micro-batch samples its input, not wait for an empty one."""
    workload, reference = alone
    llm = LLM(model=tiny_model_factory(VARIED), pp=pp, depth=depth, dtype="float64", kv_cache_tokens=2048, buckets=[1, 2, 4, 8])
    engine = llm.engine
    params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0, ignore_eos=True) for r in workload[:num_requests]]
    seqs, feed_reads = run_counting_feed_reads(engine, [r["prompt"] for r in workload[:num_requests]], params)
    assert feed_reads > 0
    assert [s.output_ids for s in seqs] == reference[:num_requests]
    engine.close()


@pytest.fixture(scope="module")
def long_outputs(tiny_model_factory):
    """Requests that together need far more KV cache than a small one holds (each fits alone), and
    the tokens each gets alone with a large cache."""
    rng = random.Random(3)
    requests = [([rng.randrange(1, 97) for _ in range(rng.randint(3, 20))], rng.randint(30, 80)) for _ in range(10)]
    llm = LLM(model=tiny_model_factory(VARIED), dtype="float64", kv_cache_tokens=4096, async_scheduling=False)
    reference = [llm.generate(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0].token_ids for p, n in requests]
    llm.engine.close()
    return requests, reference


@pytest.mark.parametrize("pp, depth, async_scheduling", [(1, 0, True), (2, 0, True), (2, 1, False), (3, 1, True)])
def test_preempted_requests_are_recomputed_and_get_their_tokens(tiny_model_factory, long_outputs, pp, depth, async_scheduling):
    """KV blocks are taken as sequences grow; when none is left the youngest sequence gives its
    blocks back and is prefilled again later, and still gets exactly its tokens."""
    requests, reference = long_outputs
    llm = LLM(
        model=tiny_model_factory(VARIED), pp=pp, depth=depth, dtype="float64", kv_cache_tokens=160, prefill_chunk_size=32,
        buckets=[1, 2, 4, 8], async_scheduling=async_scheduling,
    )
    engine = llm.engine
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in requests]
    seqs, _ = run_counting_feed_reads(engine, [p for p, _ in requests], params)
    assert engine.scheduler.num_preemptions > 0
    assert [s.output_ids for s in seqs] == reference
    assert engine.allocator.num_free == engine.allocator.num_blocks - 1
    engine.close()


def test_aborting_mid_flight_returns_every_block(tiny_model_factory):
    llm = LLM(model=tiny_model_factory(), pp=3, depth=1, kv_cache_tokens=2048, buckets=[1, 2, 4])
    engine = llm.engine
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    seqs = [engine.add_request([i + 1] * (5 + 3 * i), params) for i in range(12)]
    for tick in range(40):
        engine.step()
        if tick % 4 == 0:
            victim = seqs[tick // 4]
            engine.abort(victim)  # some are queued, some prefilling, some decoding, some in flight
    while engine.has_work():
        engine.step()
    assert [s.finish_reason.value for s in seqs[:10]] == ["abort"] * 10
    assert all(len(s.output_ids) == 50 for s in seqs[10:])
    assert engine.allocator.num_free == engine.allocator.num_blocks - 1
    assert all(s.block_ids == [] for s in seqs)
    engine.close()


def test_a_request_that_can_never_fit_fails_alone(tiny_model_factory):
    llm = LLM(model=tiny_model_factory(), pp=2, kv_cache_tokens=64)
    engine = llm.engine
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    first = engine.add_request([1, 2, 3], params)
    with pytest.raises(RequestError, match="needs 108 tokens of KV cache but the whole cache holds 64"):
        engine.add_request([5] * 100, params)
    with pytest.raises(RequestError, match="the prompt is 300 tokens but the context holds 256"):
        engine.add_request([5] * 300, params)
    last = engine.add_request([4, 5], params)
    while engine.has_work():
        engine.step()
    assert len(first.output_ids) == 8 and len(last.output_ids) == 8
    engine.close()


def busy_shares(
    pp: int, depth: int, model_dir, stage_ms: float, host_ms: float, async_scheduling: bool = True,
) -> tuple[list[float], float, float]:
    llm = LLM(
        model=model_dir, pp=pp, depth=depth, kv_cache_tokens=4096, buckets=[1, 2, 4, 8], timeline=True,
        async_scheduling=async_scheduling,
    )
    engine = make_synthetic(llm.engine, stage_ms=stage_ms, host_ms=host_ms)
    llm.generate([[i + 1, 2, 3] for i in range(16)], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    timeline = engine.timeline
    decode = [s for s in timeline.slices if s.kind == "decode"]
    start, end = min(s.start for s in decode), max(s.end for s in decode)
    window = (start + 0.25 * (end - start), end - 0.25 * (end - start))  # steady state: no fill, no drain
    mean_stage_s = sum(s.end - s.start for s in decode) / len(decode)
    engine.close()
    return [timeline.busy_fraction(stage, window) for stage in range(pp)], mean_stage_s, host_ms / 1000


@pytest.mark.parametrize("depth", [1, 2])
def test_ring_keeps_every_stage_busy(tiny_model_factory, depth):
    """The seed problem: one micro-batch walking 4 stages alone keeps each busy a quarter of the time."""
    shares, _, _ = busy_shares(4, depth, tiny_model_factory("llama-gqa-tied"), stage_ms=20, host_ms=10)
    assert min(shares) >= 0.90, shares


def test_depth_zero_matches_the_pipeline_formula(tiny_model_factory):
    """Without async scheduling, the host's turnaround is a bubble at depth 0."""
    shares, stage_s, host_s = busy_shares(4, 0, tiny_model_factory("llama-gqa-tied"), stage_ms=20, host_ms=10, async_scheduling=False)
    expected = predicted_busy_fraction(pp=4, depth=0, stage_s=stage_s, host_s=host_s, async_scheduling=False)
    assert expected < 0.92  # the host turnaround shows at depth 0
    for share in shares:
        assert abs(share - expected) <= 0.05, (shares, expected)


@pytest.mark.parametrize("host_ms", [10, 30])
def test_async_scheduling_hides_the_host_at_depth_zero(tiny_model_factory, host_ms):
    """With the next step launched before the tokens are read back, only the host's rate shows:
    10 ms per micro-batch hides behind 20 ms stages, 30 ms caps them at two thirds."""
    shares, stage_s, host_s = busy_shares(4, 0, tiny_model_factory("llama-gqa-tied"), stage_ms=20, host_ms=host_ms)
    expected = predicted_busy_fraction(pp=4, depth=0, stage_s=stage_s, host_s=host_s, async_scheduling=True)
    for share in shares:
        assert abs(share - expected) <= 0.05, (shares, expected)


def test_a_failing_stage_ends_only_the_requests_in_flight(tiny_model_factory):
    """One exception in a stage: the micro-batches in flight are lost, their requests end with an
    error, every KV block comes back, and the engine serves the next request."""
    from graphrt.errors import StageError

    llm = LLM(model=tiny_model_factory(), pp=2, depth=1, kv_cache_tokens=1024, buckets=[1, 2, 4])
    engine = llm.engine
    stage = engine.pipeline.stages[1]
    forward, calls = stage.forward, []

    def flaky(x, meta, cache):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected fault")
        return forward(x, meta, cache)

    stage.forward = flaky
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    seqs = [engine.add_request([i + 1] * 6, params) for i in range(4)]
    with pytest.raises(StageError, match="injected fault"):
        while engine.has_work():
            engine.step()
    assert any(s.finish_reason is not None and s.finish_reason.value == "error" for s in seqs)
    while engine.has_work():  # requests that were not in flight go on
        engine.step()
    assert engine.allocator.num_free == engine.allocator.num_blocks - 1
    again = llm.generate([[3, 4, 5]], params)[0]
    assert len(again.token_ids) == 20
    engine.close()


def test_always_on_busy_time_agrees_with_the_timeline(tiny_model_factory):
    llm = LLM(model=tiny_model_factory(), pp=2, kv_cache_tokens=1024, timeline=True)
    engine = make_synthetic(llm.engine, stage_ms=5)
    llm.generate([[i + 1, 2, 3] for i in range(6)], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    for stage in range(2):
        from_timeline = sum(s.end - s.start for s in engine.timeline.slices if s.stage == stage)
        assert from_timeline > 0
        assert abs(engine.ring.busy_s[stage] - from_timeline) <= 0.05 * from_timeline
    engine.close()
