"""KV block accounting under a fuzzed workload: after every engine step, whatever stage of its life
a request is aborted in, every block is free, cached (unreferenced, kept for the prefix cache) or
referenced exactly as many times as live requests hold it.

Half the prompts start with one of two shared prefixes, so requests take cached blocks, share them
while running and leave them cached when they end (prefix caching, on in all but one config).

A quarter of the requests are constrained by a grammar (structured output), which changes when their
rows may run again and masks their drafts.

Requests arrive at random ticks with prompts of several prefill chunks, into a cache small enough
that some wait in the queue and some are preempted; some stop at EOS, the rest at max_tokens.
Each tick, for each life stage (queued, mid-prefill, decoding, preempted...), one request in that
stage may be aborted, so rare stages are hit too; the test counts the hits, so it cannot quietly
stop covering one. Survivors must get exactly the tokens they get alone.

When a micro-batch reads as done is set by the test's clock (`TickClock`), not by how the stage
threads race, so with fixed seeds every run is the same run.
"""

from __future__ import annotations

import json
import random
import shutil
from collections import Counter
from dataclasses import dataclass

import pytest

from graphrt import LLM, SamplingParams
from graphrt.engine.sequence import FinishReason, Sequence
from graphrt.model import SCRATCH_BLOCK
from graphrt.sampling_params import StructuredOutput
from graphrt.tools.synthetic import write_char_tokenizer

# Greedy outputs of this variant vary from token to token, so a wrong or stale token shows.
VARIED = "llama3-rope"
# A token the tiny model's greedy outputs produce now and then, made its EOS.
EOS_ID = 44
BLOCK_SIZE = 4
PREFILL_CHUNK_SIZE = 8  # prompts of up to 30 tokens take up to 4 chunks
KV_CACHE_TOKENS = 64  # 16 blocks: a handful of requests fill it
NUM_REQUESTS = 24
LAST_ARRIVAL_TICK = 30
# Per tick and life stage, the chance one request in that stage is aborted; a request is preempted
# only for a few ticks, so that stage gets a larger chance.
ABORT_CHANCE = {"preempted": 0.5, "mid-prefill": 0.15, "queued": 0.02, "ended": 0.02}
DEFAULT_ABORT_CHANCE = 0.04
SEEDS = (0, 1, 2, 3)
# (pp, depth, async scheduling): one to three stages, rings of 1 to 4 slots. The scheduler sees the
# number of slots, not of stages, so no two of these schedule alike.
# Then prefix caching on (1) or off (0), and the drafts per verify step of speculative decoding
# (ngram; 0: off), whose verify rows take blocks for drafts and give back those of rejected ones.
CONFIGS = [
    (1, 0, False, 1, 0), (1, 0, True, 1, 0), (1, 1, True, 1, 0), (2, 0, False, 1, 0), (2, 1, True, 1, 0), (2, 1, True, 0, 0),
    (3, 0, False, 1, 0), (3, 1, True, 1, 0), (1, 0, True, 1, 3), (2, 1, True, 1, 4), (3, 0, False, 0, 2),
]

# Counted apart too: the abort whose blocks only the micro-batch's read-back can free (issue 14).
MID_PREFILL_IN_FLIGHT = "mid-prefill, a chunk in flight"
# Life stages an abort must hit (see `life_stage`).
REQUIRED_STAGES = ("queued", "mid-prefill", MID_PREFILL_IN_FLIGHT, "decoding", "preempted", "ended")


# A share of the requests are constrained by a grammar (structured output): their rows wait for their
# tokens to be read back before running again, and their drafts are masked along the verify row.
CONSTRAINED_SHARE = 0.25
GRAMMARS = (StructuredOutput(regex=r"[a-m ]{2,40}"), StructuredOutput(json={"type": "array", "items": {"type": "integer"}}))


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams
    arrival_tick: int


# Of 9 and 13 tokens: two whole blocks and three, each with a token past the boundary.
SHARED_PREFIXES = ([3, 14, 15, 92, 65, 35, 89, 79, 32], [27, 18, 28, 18, 28, 45, 90, 45, 23, 53, 60, 28, 74])


def make_workload(seed: int) -> list[Request]:
    rng = random.Random(seed)

    def prompt() -> list[int]:
        prefix = list(rng.choice(SHARED_PREFIXES)) if rng.random() < 0.5 else []
        return (prefix + [rng.randrange(1, 97) for _ in range(rng.randint(1, 30))])[:30]

    def params() -> SamplingParams:
        max_tokens = rng.randint(1, 32)
        if rng.random() < CONSTRAINED_SHARE:
            return SamplingParams(max_tokens=max_tokens, temperature=0, structured_output=rng.choice(GRAMMARS))
        return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=rng.random() < 0.3)

    return [Request(prompt=prompt(), params=params(), arrival_tick=rng.randint(0, LAST_ARRIVAL_TICK)) for _ in range(NUM_REQUESTS)]


@pytest.fixture(scope="module")
def eos_model(tiny_model_factory, tmp_path_factory):
    """The tiny model with EOS_ID as its end-of-sequence token, and a tokenizer."""
    path = tmp_path_factory.mktemp("eos-model") / "model"
    shutil.copytree(tiny_model_factory(VARIED), path)
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = EOS_ID
    (path / "config.json").write_text(json.dumps(config))
    return write_char_tokenizer(path)  # for the grammars; its EOS (2) ends requests too


@pytest.fixture(scope="module")
def alone(eos_model) -> dict[int, list[list[int]]]:
    """Per seed, each request's tokens when it runs by itself: one stage, a cache with room to spare."""
    llm = LLM(model=eos_model, dtype="float64", kv_cache_tokens=4096, depth=0, async_scheduling=False, buckets=[1], prefix_caching=False)
    reference = {
        seed: [llm.generate(r.prompt, r.params)[0].token_ids for r in make_workload(seed)] for seed in SEEDS
    }
    llm.engine.close()
    return reference


def free_blocks(allocator) -> list[int]:
    return list(allocator._free)  # the free list itself: a block in it twice is a double free


def assert_blocks_accounted(engine, seqs: list[Sequence], when: str, aborted_at: dict[int, str]) -> None:
    """Every usable block is free, cached or referenced once per request holding it; finished
    requests with nothing in flight hold none (an aborted one keeps its blocks only while a
    micro-batch still writes them). `aborted_at`: request id -> the life stage it was aborted in."""
    allocator, scheduler = engine.allocator, engine.scheduler
    for seq in seqs:
        if seq.finished and seq.num_in_flight == 0:
            how = f"aborted {aborted_at[seq.request_id]}" if seq.request_id in aborted_at else seq.finish_reason.value
            assert seq.block_ids == [], (
                f"{when}: KV blocks leaked: request {seq.request_id} ended ({how}) with nothing in flight but "
                f"still owns blocks {seq.block_ids}"
            )
        if seq.finished:
            assert seq not in scheduler.running and seq not in scheduler.waiting, (
                f"{when}: request {seq.request_id} ended ({seq.finish_reason.value}) but is still scheduled"
            )
    for seq in scheduler.waiting:
        assert seq.block_ids == [], f"{when}: request {seq.request_id} waits in the queue but owns blocks {seq.block_ids}"
    owners: dict[int, list[int]] = {}
    for seq in seqs:
        assert len(set(seq.block_ids)) == len(seq.block_ids), f"{when}: request {seq.request_id} holds a block twice: {seq.block_ids}"
        for block in seq.block_ids:
            owners.setdefault(block, []).append(seq.request_id)
    for block in range(allocator.num_blocks):
        held = len(owners.get(block, []))
        assert allocator._refs[block] == held, (
            f"{when}: block {block} has {allocator._refs[block]} references but {held} requests hold it ({owners.get(block)})"
        )
    free, cached = free_blocks(allocator), list(allocator._evictable)
    twice = sorted(block for block, count in Counter(free).items() if count > 1)
    assert not twice, f"{when}: blocks {twice} are in the free list twice (freed twice)"
    both = sorted((set(free) | set(cached)) & owners.keys())
    assert not both, f"{when}: blocks {both} are free or cached and held (by requests {[owners[b] for b in both]})"
    assert not set(free) & set(cached), f"{when}: blocks {sorted(set(free) & set(cached))} are both free and cached"
    assert set(cached) <= allocator._key_of.keys(), f"{when}: unregistered blocks are kept as cached"
    assert SCRATCH_BLOCK not in owners and SCRATCH_BLOCK not in free + cached, f"{when}: the scratch block was handed out"
    lost = sorted(set(range(1, allocator.num_blocks)) - set(free) - set(cached) - owners.keys())
    assert not lost, f"{when}: KV blocks leaked: {lost} are neither free, cached nor held by any request"


def life_stage(seq: Sequence, engine, ever_admitted: set[int]) -> str:
    """Where a request is in its life, for picking and counting aborts."""
    if seq.finished:
        return "ended"  # aborting it again must change nothing
    if seq in engine.scheduler.waiting:
        # A preempted request gave its blocks back and waits to be prefilled again.
        return "preempted" if seq.output_ids or seq.request_id in ever_admitted else "queued"
    if seq.num_computed == 0:
        return "admitted"  # blocks taken, no prompt chunk launched yet
    if seq.in_prefill:
        # At least one chunk launched and the last one not yet (a recompute after preemption included).
        return "mid-prefill"
    if not seq.output_ids:
        return "last chunk in flight"
    return "decoding"


class TickClock:
    """A clock the test controls: a micro-batch launched at tick t reads as done (its event's query())
    from tick t + d on, with d drawn from the run's rng, whatever the stage threads' speed. The
    micro-batches due are waited for before each step, so the step reads back what the clock says;
    when every slot is busy the host's own wait is the real one. Every run is the same run.
    (It replaces query() on each CPU event; the stage threads wait on the event itself.)"""

    def __init__(self, engine, rng: random.Random):
        self.engine, self.rng = engine, rng
        self.max_ticks = engine.ring.num_slots + 1  # up to a whole ring's worth of ticks
        self.due: dict[int, int] = {}  # micro-batch id -> the tick from which it reads as done
        self.now = 0

    def before_step(self, tick: int) -> None:
        self.now = tick
        for mb in self.engine.ring.in_flight:
            pending = mb.logits_plan.pending if mb.logits_plan is not None else None
            if pending is not None and not pending.ready.is_set():
                break  # its mask, and so it and all after it, waits for a read-back this step makes
            if self.due[mb.id] <= tick:
                mb.done.synchronize()

    def after_step(self, tick: int) -> None:
        for mb in self.engine.ring.in_flight:
            if mb.id not in self.due:
                self.due[mb.id] = tick + self.rng.randint(1, self.max_ticks)
                mb.done.query = lambda mb=mb: self.due[mb.id] <= self.now


@dataclass
class FuzzRun:
    seqs: list[Sequence]
    aborted: set[int]  # indices into the workload
    aborts_by_stage: Counter
    feed_reads: int  # micro-batches launched before the tokens they read were back (async scheduling)
    max_in_flight: int


def run_fuzz(engine, workload: list[Request], seed: int) -> FuzzRun:
    """Step the engine through the workload, aborting at random; check the blocks after every step
    and every abort."""
    rng = random.Random(1000 + seed)
    clock = TickClock(engine, rng)
    seqs: list[Sequence | None] = [None] * len(workload)
    aborted: set[int] = set()
    aborted_at: dict[int, str] = {}  # request id -> life stage
    ever_admitted: set[int] = set()
    aborts_by_stage: Counter = Counter()
    feed_reads = max_in_flight = 0
    tick = 0
    while tick <= LAST_ARRIVAL_TICK or engine.has_work():
        for index, request in enumerate(workload):
            if request.arrival_tick == tick:
                seqs[index] = engine.add_request(request.prompt, request.params)
        live = [seq for seq in seqs if seq is not None]
        clock.before_step(tick)
        known = set(clock.due)
        engine.step()
        clock.after_step(tick)
        feed_reads += sum(mb.reads_feed for mb in engine.ring.in_flight if mb.id not in known)
        max_in_flight = max(max_in_flight, len(engine.ring.in_flight))
        assert_blocks_accounted(engine, live, f"seed {seed}, tick {tick}, after the step", aborted_at)
        ever_admitted.update(seq.request_id for seq in engine.scheduler.running)
        by_stage: dict[str, list[int]] = {}
        for index, seq in enumerate(seqs):
            if seq is not None:
                by_stage.setdefault(life_stage(seq, engine, ever_admitted), []).append(index)
        for stage, indices in sorted(by_stage.items()):
            if rng.random() < ABORT_CHANCE.get(stage, DEFAULT_ABORT_CHANCE):
                index = rng.choice(indices)
                seq = seqs[index]
                reason = seq.finish_reason
                engine.abort(seq)
                aborts_by_stage[stage] += 1
                if stage == "ended":
                    assert seq.finish_reason is reason, f"seed {seed}: aborting ended request {index} changed it"
                else:
                    aborted.add(index)
                    aborted_at[seq.request_id] = stage
                if stage == "mid-prefill" and seq.num_in_flight:
                    aborted_at[seq.request_id] = MID_PREFILL_IN_FLIGHT
                    aborts_by_stage[MID_PREFILL_IN_FLIGHT] += 1
                when = f"seed {seed}, tick {tick}, after aborting request {index} ({stage})"
                assert_blocks_accounted(engine, live, when, aborted_at)
        tick += 1
        assert tick < 2000, f"seed {seed}: the engine still has work after {tick} ticks"
    return FuzzRun(seqs, aborted, aborts_by_stage, feed_reads, max_in_flight)


@pytest.mark.parametrize("pp, depth, async_scheduling, caching, num_drafts", CONFIGS)
def test_every_block_is_free_or_owned_once_through_aborts_at_every_stage(
    eos_model, alone, pp, depth, async_scheduling, caching, num_drafts
):
    speculative = {"method": "ngram", "num_speculative_tokens": num_drafts, "prompt_lookup_min": 1} if num_drafts else None
    llm = LLM(
        model=eos_model, pp=pp, depth=depth, async_scheduling=async_scheduling, dtype="float64", prefix_caching=bool(caching),
        block_size=BLOCK_SIZE, kv_cache_tokens=KV_CACHE_TOKENS, prefill_chunk_size=PREFILL_CHUNK_SIZE, buckets=[1, 2, 4, 8],
        speculative_config=speculative,
    )
    engine = llm.engine
    if num_drafts:
        engine.scheduler.speculation.step_costs = None  # every draft proposed is verified, whatever the timed steps say
    assert engine.allocator.num_blocks == KV_CACHE_TOKENS // BLOCK_SIZE + 1
    aborts_by_stage: Counter = Counter()
    finish_reasons: Counter = Counter()
    num_preemptions = feed_reads = max_in_flight = num_constrained = 0
    try:
        for grammar in GRAMMARS:  # compiled before the runs, so every constrained request is admitted on the tick it would be
            engine.grammars.compile(grammar).wait(60)
        for seed in SEEDS:
            preemptions_before = engine.scheduler.num_preemptions
            run = run_fuzz(engine, make_workload(seed), seed)
            num_preemptions += engine.scheduler.num_preemptions - preemptions_before
            aborts_by_stage += run.aborts_by_stage
            feed_reads += run.feed_reads
            max_in_flight = max(max_in_flight, run.max_in_flight)
            assert engine.allocator.num_free == engine.allocator.num_blocks - 1, f"seed {seed}: blocks missing at the end"
            assert all(seq.block_ids == [] for seq in run.seqs)
            for index, (seq, reference) in enumerate(zip(run.seqs, alone[seed])):
                if index in run.aborted:
                    assert seq.finish_reason is FinishReason.ABORT
                    assert seq.output_ids == reference[: len(seq.output_ids)], f"seed {seed}: aborted request {index}"
                else:
                    assert seq.output_ids == reference, f"seed {seed}: request {index} got other tokens than alone"
                    finish_reasons[seq.finish_reason] += 1
                    num_constrained += seq.grammar is not None
    finally:
        engine.close()
    spec = engine.stats.spec
    print(
        f"pp={pp} depth={depth} async={async_scheduling} caching={caching} drafts={num_drafts}: "
        f"verify rows {spec.num_drafts}, drafts {spec.num_draft_tokens}, accepted {spec.num_accepted_tokens}; prefix-cache hits "
        f"{engine.allocator.num_hit_tokens} of {engine.allocator.num_queried_tokens} tokens, aborts by stage {dict(sorted(aborts_by_stage.items()))}, "
        f"survivors {dict((r.value, n) for r, n in finish_reasons.items())}, preemptions {num_preemptions}, "
        f"feed reads {feed_reads}, max in flight {max_in_flight}"
    )
    # What the fuzz must keep covering, or it would pass without testing.
    missing = [stage for stage in REQUIRED_STAGES if aborts_by_stage[stage] == 0]
    assert not missing, f"no abort hit a request in the life stages {missing}: {dict(aborts_by_stage)}"
    assert finish_reasons[FinishReason.STOP] > 0 and finish_reasons[FinishReason.LENGTH] > 0, finish_reasons
    assert num_preemptions > 0
    assert num_constrained > 0  # constrained requests ran to their end, with the tokens they get alone
    # Prefix caching was exercised: prompts found their shared prefixes cached (and only then).
    assert (engine.allocator.num_hit_tokens > 0) == bool(caching)
    # Every slot was busy at once, and with async scheduling some slot held two micro-batches.
    assert max_in_flight >= engine.ring.num_slots and (max_in_flight > engine.ring.num_slots) == async_scheduling
    assert (feed_reads > 0) == async_scheduling
    if num_drafts:  # drafts were verified, some kept (their blocks stay) and some not (theirs go back)
        assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens, (spec.num_draft_tokens, spec.num_accepted_tokens)
