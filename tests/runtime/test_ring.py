"""The micro-batch ring: exact tokens under concurrency, aborts that free everything, as many
micro-batches in flight as the ring has slots."""

from __future__ import annotations

import random
import threading
import time

import pytest

from graphrt import LLM, SamplingParams
from graphrt.errors import RequestError
from graphrt.tools.synthetic import make_synthetic
from helpers import fail_at_call, run_counting_feed_reads

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


def run_alone(model_dir, workload) -> list[list[int]]:
    """Each request's tokens when it runs by itself: one stage, nothing else in the batch."""
    llm = LLM(model=model_dir, dtype="float64", kv_cache_tokens=4096, depth=0, async_scheduling=False)
    return [
        llm.generate(r["prompt"], SamplingParams(max_tokens=r["max_tokens"], temperature=0, ignore_eos=True))[0].token_ids
        for r in workload
    ]


@pytest.fixture(scope="module")
def alone(tiny_model_factory):
    workload = make_workload(seed=7)
    return workload, run_alone(tiny_model_factory(VARIED), workload)


# A mixture of experts with latent attention: the experts a row reads depend on the other rows of its
# micro-batch in no way, and the latent cache goes through the same blocks.
MOE_MLA = "deepseek-v3"


@pytest.fixture(scope="module")
def alone_moe_mla(tiny_model_factory):
    workload = make_workload(seed=7)[:16]
    return workload, run_alone(tiny_model_factory(MOE_MLA), workload)


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


@pytest.mark.parametrize("depth", [0, 1, 2])
@pytest.mark.parametrize("pp", [1, 2, 3])
def test_a_moe_model_with_latent_attention_gets_the_tokens_it_gets_alone(tiny_model_factory, alone_moe_mla, pp, depth):
    workload, reference = alone_moe_mla
    llm = LLM(
        model=tiny_model_factory(MOE_MLA), pp=pp, depth=depth, dtype="float64",
        kv_cache_tokens=2048, prefill_chunk_size=24, buckets=[1, 2, 4, 8],
    )
    assert run_arrivals(llm, workload) == reference
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_blocks - 1
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

    # An EOS that the model samples after the first token in as many outputs as possible, and
    # never as the first token of any (those would stop at once, before async scheduling matters).
    outputs = run(False, eos=None)
    firsts = {tokens[0] for tokens, _ in outputs}
    counts = {}
    for tokens, _ in outputs:
        for token in set(tokens[1:]) - firsts:
            counts[token] = counts.get(token, 0) + 1
    eos = max(counts, key=counts.get)
    with_async = run(True, eos)
    stopped = [ids for ids, reason in with_async if reason == "stop"]
    assert len(stopped) >= 5 and all(len(ids) > 1 and ids[-1] == eos and eos not in ids[:-1] for ids in stopped)
    assert with_async == run(False, eos)


@pytest.mark.parametrize("pp, depth, num_requests", [(2, 0, 1), (4, 0, 3), (1, 1, 1), (2, 1, 2)])
def test_async_scheduling_launches_ahead_with_fewer_rows_than_slots(tiny_model_factory, alone, pp, depth, num_requests):
    """Fewer decode rows than slots (one request at pp 2, the tail of every batch): the next step
    still goes into the slot whose micro-batch samples its input, not wait for an empty one.

    The requests with the most tokens: whether a step launches ahead depends on whether the one
    before it is still running when the host polls, so a request of 2 tokens gives it one chance
    (CI once saw none taken), one of 20 gives it 19."""
    workload, reference = alone
    chosen = sorted(range(len(workload)), key=lambda i: -workload[i]["max_tokens"])[:num_requests]
    llm = LLM(model=tiny_model_factory(VARIED), pp=pp, depth=depth, dtype="float64", kv_cache_tokens=2048, buckets=[1, 2, 4, 8])
    engine = llm.engine
    params = [SamplingParams(max_tokens=workload[i]["max_tokens"], temperature=0, ignore_eos=True) for i in chosen]
    seqs, feed_reads = run_counting_feed_reads(engine, [workload[i]["prompt"] for i in chosen], params)
    assert feed_reads > 0
    assert [s.output_ids for s in seqs] == [reference[i] for i in chosen]
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
    with pytest.raises(RequestError, match="maximum context length is 256 tokens, and the prompt is 300 tokens"):
        engine.add_request([5] * 300, params)
    last = engine.add_request([4, 5], params)
    while engine.has_work():
        engine.step()
    assert len(first.output_ids) == 8 and len(last.output_ids) == 8
    engine.close()


class HeldRing:
    """A clock the test controls: which micro-batches each stage has started and finished, with
    the last stage's decode work, or the host's handling of a read-back, held until released.

    The counts it gives depend on the ring's scheduling alone, never on how fast the machine is:
    every wait is for an event, with a timeout only a broken ring reaches. (Wall-clock shares
    are measured in benchmarks/ring_utilization.py.)
    """

    def __init__(self, engine):
        self.engine = engine
        self.last_stage = len(engine.pipeline.stages) - 1
        self.ended: dict[int, set[int]] = {stage: set() for stage in range(self.last_stage + 1)}  # stage -> decode mb ids
        self.started: dict[int, set[int]] = {stage: set() for stage in range(self.last_stage + 1)}
        self.last_stage_free = threading.Event()
        self.host_waits_on_held = threading.Event()  # the host can launch nothing and waits for held work
        self.hold_host = False
        self.host_held_on = None  # the micro-batch whose read-back the host is held in
        self.host_free = threading.Event()
        self._wrap_stages(engine.ring)
        self._wrap_host(engine)

    def _wrap_stages(self, ring) -> None:
        run_stage = ring._run_stage

        def run(index, slot, mb, *rest):
            decode = not mb.step.is_prefill
            if decode and index == self.last_stage:
                self.last_stage_free.wait(WAIT_S)
            if decode:
                self.started[index].add(mb.id)
            run_stage(index, slot, mb, *rest)
            if decode:
                self.ended[index].add(mb.id)

        ring._run_stage = run

    def _wrap_host(self, engine) -> None:
        poll, account = engine._poll, engine._account

        def held_poll(block):
            in_flight = engine.ring.in_flight
            oldest = in_flight[0] if in_flight else None
            if block and oldest is not None and not oldest.step.is_prefill and not self.last_stage_free.is_set():
                self.host_waits_on_held.set()  # nothing could launch, and the oldest can't finish yet
            return poll(block)

        def held_account(mb, now, new_tokens):
            if self.hold_host and not mb.step.is_prefill:
                self.hold_host, self.host_held_on = False, mb
                self.host_free.wait(WAIT_S)
            account(mb, now, new_tokens)

        engine._poll, engine._account = held_poll, held_account

    def fill(self, llm: LLM) -> threading.Thread:
        """Start 16 requests on a thread with the last stage's decode work held; return once the
        host can launch nothing more."""
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        run = threading.Thread(target=lambda: self.outputs.extend(llm.generate([[i + 1, 2, 3] for i in range(16)], params)), daemon=True)
        self.outputs: list = []
        run.start()
        assert self.host_waits_on_held.wait(WAIT_S), "the host never ran out of work to launch"
        return run

    def finish(self, run: threading.Thread) -> None:
        self.last_stage_free.set()
        self.host_free.set()
        run.join(WAIT_S)
        assert [len(out.token_ids) for out in self.outputs] == [24] * 16
        self.engine.close()


def eventually(predicate) -> bool:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


WAIT_S = 30  # only a broken ring waits this long
SETTLE_S = 0.2  # how long a count must stay put to be called final


RING_SHAPES = [(4, 0, False), (4, 1, False), (4, 2, False), (4, 0, True), (4, 1, True), (2, 1, True), (3, 2, True)]


@pytest.mark.parametrize("pp, depth, async_scheduling", RING_SHAPES)
def test_the_ring_runs_pp_plus_depth_micro_batches_ahead_of_the_last_stage(tiny_model_factory, pp, depth, async_scheduling):
    """The seed problem: with one micro-batch walking the stages alone, each is busy 1/pp of the
    time. With the last stage held on its first decode micro-batch, stage 0 goes on and starts
    exactly L = pp + depth of them (one per ring slot): depth 1 starts micro-batch k + pp before
    the last stage has finished micro-batch k, depth 0 does not. Async scheduling launches more
    (a second one per slot), but those wait on the device for their slot to come back."""
    llm = LLM(
        model=tiny_model_factory("llama-gqa-tied"), pp=pp, depth=depth, kv_cache_tokens=4096, buckets=[1, 2, 4, 8],
        async_scheduling=async_scheduling,
    )
    held = HeldRing(llm.engine)
    run = held.fill(llm)
    slots = pp + depth
    reached = eventually(lambda: len(held.started[0]) >= slots)
    time.sleep(SETTLE_S)  # were it to start more, it would do so now
    started, finished = len(held.started[0]), len(held.ended[held.last_stage])
    held.finish(run)
    assert reached and started == slots, f"stage 0 started {started} decode micro-batches ahead of the last stage; the ring has {slots} slots"
    assert finished == 0


HOST_SHAPES = [(4, 0, False), (4, 1, False), (2, 2, False), (4, 0, True), (2, 0, True), (3, 1, True)]


@pytest.mark.parametrize("pp, depth, async_scheduling", HOST_SHAPES)
def test_work_the_stages_have_while_the_host_reads_one_back(tiny_model_factory, pp, depth, async_scheduling):
    """The host holds a read-back for as long as it likes (detokenizing, stop checks); meanwhile the
    stages run what was launched before it. Without async scheduling that is the other L - 1
    slots' micro-batches, and the slot being read back stays empty: a bubble of one stage time
    per host turnaround at depth 0, which a deeper ring covers. With async scheduling that slot's
    next micro-batch was launched before the read-back: a whole ring's worth, L or more."""
    llm = LLM(
        model=tiny_model_factory("llama-gqa-tied"), pp=pp, depth=depth, kv_cache_tokens=4096, buckets=[1, 2, 4, 8],
        async_scheduling=async_scheduling,
    )
    held = HeldRing(llm.engine)
    run = held.fill(llm)
    held.hold_host = True
    held.last_stage_free.set()  # the oldest finishes; the host reads it back and is held there
    assert eventually(lambda: held.host_held_on is not None)
    oldest = held.host_held_on.id
    slots = pp + depth
    expected = slots if async_scheduling else slots - 1

    def done_behind() -> int:
        return sum(mb > oldest for mb in held.ended[held.last_stage])

    reached = eventually(lambda: done_behind() >= expected)
    time.sleep(SETTLE_S)
    behind = done_behind()
    held.finish(run)
    assert reached, f"while the host read one micro-batch back, the stages finished {behind}; expected {expected}"
    if not async_scheduling:
        assert behind == slots - 1


def test_a_failing_stage_ends_only_the_requests_in_flight(tiny_model_factory):
    """One exception in a stage: the micro-batches in flight are lost, their requests end with an
    error, every KV block comes back, and the engine serves the next request."""
    from graphrt.errors import StageError

    llm = LLM(model=tiny_model_factory(), pp=2, depth=1, kv_cache_tokens=1024, buckets=[1, 2, 4])
    engine = llm.engine
    fail_at_call(engine.pipeline.stages[1], 3)
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
    """The always-on busy time (/metrics) brackets the same work as the timeline, inside it: never
    more than the timeline's sum, never less than the stages' known sleeps."""
    stage_ms = 5
    llm = LLM(model=tiny_model_factory(), pp=2, kv_cache_tokens=1024, timeline=True)
    engine = make_synthetic(llm.engine, stage_ms=stage_ms)
    llm.generate([[i + 1, 2, 3] for i in range(6)], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    for stage in range(2):
        slices = [s for s in engine.timeline.slices if s.stage == stage]
        from_timeline = sum(s.end - s.start for s in slices)
        assert len(slices) >= 10
        assert len(slices) * stage_ms / 1000 <= engine.ring.busy_s[stage] <= from_timeline + 1e-9
    engine.close()


def test_without_async_scheduling_a_tick_that_blocked_refills_the_slot_it_freed(tiny_model_factory):
    """The tick that waits for the oldest micro-batch launches into the slot it freed before it
    returns: the ring is never left empty between ticks while requests still decode. It used to be,
    so that the next tick first read back another micro-batch (host time) while that slot idled."""
    llm = LLM(model=tiny_model_factory(), pp=2, depth=0, async_scheduling=False, kv_cache_tokens=1024)
    engine = make_synthetic(llm.engine, stage_ms=5)  # slower than a tick's host work: every tick that waits, blocks
    for i in range(4):
        engine.add_request([i + 1, 2, 3], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    emptied = 0
    while engine.has_work():
        engine.step()
        emptied += engine.scheduler.has_work() and not engine.ring.busy
    assert emptied == 0
    engine.close()
