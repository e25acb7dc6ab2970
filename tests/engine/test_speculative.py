"""Speculative decoding with the ngram drafter: exact under every schedule, blocks given back,
the target's distribution when sampling.

The tiny models here are made with smaller weights (`weight_scale`), so their greedy output falls
into loops now and then: drafts are kept for long runs and rejected where a loop breaks, and
both must leave the output exactly what it is without speculation.
"""

from __future__ import annotations

import random

import pytest
import torch

from graphrt import LLM, SamplingParams
from graphrt.config import EngineConfig
from graphrt.engine.block_allocator import BlockAllocator
from graphrt.engine.drafter import Acceptance, NgramDrafter, StepCosts, drafts_that_pay
from graphrt.engine.scheduler import Scheduler
from graphrt.engine.sequence import FinishReason, Sequence
from graphrt.engine.speculation import HOST_GAP_WEIGHT, Speculation, accept_drafts
from graphrt.engine.stats import SpecStats
from graphrt.runtime.sampler import Sampler
from graphrt.speculative import SpeculativeConfig
from graphrt.tools.synthetic import make_tiny_model
from helpers import assert_draws_follow, reference_distribution, run_aborting_one_mid_verify
from helpers import generate_all as generate

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


# -- the drafter and the acceptance rule ------------------------------------------------------------


def test_ngram_proposes_what_followed_the_latest_occurrence_of_the_longest_match():
    drafter = NgramDrafter(num_tokens=3, min_n=1, max_n=3)
    # [7, 8, 9] occurs at 0 and 5 (the latest before the end wins); [8, 9] alone would match too.
    assert drafter.propose([7, 8, 9, 1, 2, 7, 8, 9, 4, 5, 6, 7, 8, 9], limit=3) == [4, 5, 6]
    # Only n = 1 matches: 3 was last followed by 4.
    assert drafter.propose([3, 4, 1, 2, 3], limit=3) == [4, 1, 2]
    assert drafter.propose([1, 2, 3, 4], limit=3) == []  # nothing repeats
    assert drafter.propose([5, 6, 5, 6], limit=1) == [5]  # the caller's limit (max_tokens) wins
    assert drafter.propose([5], limit=3) == []


def test_ngram_goes_on_repeating_a_short_loop():
    drafter = NgramDrafter(num_tokens=5, min_n=2, max_n=2)
    # The last match of [1, 2] is two tokens back: what follows it is [1, 2] itself, and so on.
    assert drafter.propose([9, 1, 2, 1, 2], limit=5) == [1, 2, 1, 2, 1]
    assert drafter.propose([4, 4, 4], limit=5) == [4, 4, 4, 4, 4]


def test_drafts_are_verified_while_their_expected_tokens_outrun_the_larger_bucket():
    flat = StepCosts({1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0})
    assert drafts_that_pay(1, [(0.5, 3)], 7, flat) == [3], "a free bucket takes every draft"
    assert drafts_that_pay(1, [(0.5, 3)], 7, None) == [3], "without costs every draft goes"
    assert drafts_that_pay(1, [(0.9, 3)], 2, flat) == [2], "never more than the largest bucket holds"
    # Twice the cost from 1 to 2 tokens: one draft kept at 0.9 adds 0.9 < 1 token, so none pays;
    # from 2 to 4 tokens the same again.
    doubling = StepCosts({1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0})
    assert drafts_that_pay(1, [(0.9, 3)], 7, doubling) == [0]
    # A step of 3 rows (bucket 4) has room for one draft at no extra cost; the surer row gets it.
    steps = StepCosts({1: 1.0, 2: 1.0, 4: 1.0, 8: 3.0})
    assert drafts_that_pay(3, [(0.3, 2), (0.8, 2)], 7, steps) == [0, 1]
    # 8 tokens cost 3x 4 tokens: 3 rows + 5 drafts at 0.99 add about 4.9 tokens, 8 < 3 * 3 so no.
    assert drafts_that_pay(3, [(0.99, 3), (0.99, 2)], 7, steps) == [1, 0]
    assert drafts_that_pay(1, [], 7, steps) == []


def test_a_step_launched_ahead_waits_for_verify_rows_when_two_steps_cost_more_than_one():
    speculation = Speculation(NgramDrafter(3, 1, 3), SpecStats())
    assert not speculation.waits_for_verify_rows(4, 4), "without costs it never waits"
    speculation.step_costs = StepCosts({1: 1.0, 2: 1.0, 4: 1.1, 8: 1.3})  # a weight read, and little per row
    assert speculation.waits_for_verify_rows(4, 4)  # 1.1 + 1.1 > 1.3
    assert not speculation.waits_for_verify_rows(4, 0) and not speculation.waits_for_verify_rows(0, 4)
    speculation.record_host_gap(10.0)  # the caller held the engine: counted as the dearest step
    assert speculation.host_gap == pytest.approx(HOST_GAP_WEIGHT * 1.3)
    speculation.host_gap = 1.0
    assert not speculation.waits_for_verify_rows(4, 4)
    speculation.host_gap = 0.0
    speculation.step_costs = StepCosts({1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0})  # cost by the row: splitting is free
    assert not speculation.waits_for_verify_rows(4, 4) and not speculation.waits_for_verify_rows(2, 2)


@pytest.mark.parametrize("num_slots", [1, 2])
def test_a_step_launched_ahead_waits_for_the_verify_row_before_it(num_slots):
    """A looping row verifies drafts and a row without a match does not; the step launched ahead
    after theirs waits for the verify row, whether the rows go to one decode micro-batch or are
    spread over two (whose step could not hold both: waiting still lets them come back together),
    and launches ahead with the other row where splitting costs nothing."""
    scheduler = Scheduler(BlockAllocator(num_blocks=16, block_size=4), 4, 16, 64, 8, drafter=NgramDrafter(3, 1, 3))
    scheduler.speculation.step_costs = StepCosts({1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0})  # one step costs what two do
    looping = Sequence(0, [1, 2, 3, 1, 2], SamplingParams(max_tokens=20, temperature=0), max_tokens=20)
    plain = Sequence(1, [10, 11, 12], SamplingParams(max_tokens=20, temperature=0), max_tokens=20)
    for seq in (looping, plain):
        scheduler.add(seq)
    prefill = scheduler.schedule()
    scheduler.update_from_output(prefill, [3, 13], now=0.0)
    first = scheduler.schedule()
    assert first.draft_ids == [[], [1, 2, 3]] and first.seqs == [plain, looping]
    assert scheduler.schedule(num_slots, follows=first.id) is None
    scheduler.speculation.step_costs = StepCosts({1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0})  # by the row: two steps cost one
    ahead = scheduler.schedule(num_slots, follows=first.id)
    assert ahead is not None and ahead.seqs == [plain] and not ahead.is_prefill


def test_drafts_a_model_must_make_pay_for_its_rounds_of_guesses_too():
    flat = StepCosts({1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0})
    # Each round of guesses costs a fifth of a step: three drafts at 0.9 add 2.44 tokens for 0.6
    # of a step more, 3.44 / 1.6 beats 1 / 1.
    assert drafts_that_pay(1, [(0.9, 3)], 7, flat, StepCosts({1: 0.2})) == [3]
    # A round costs a whole step: the first draft adds 0.9 tokens for a step's time, 1.9 / 2 < 1.
    assert drafts_that_pay(1, [(0.9, 3)], 7, flat, StepCosts({1: 1.0})) == [0]
    # Rounds are paid by depth: two rows drafting one each cost one round, so at 0.5 a round
    # (rows 1 or 2 alike) two shallow drafts pay where a second round for one row would not.
    assert drafts_that_pay(2, [(0.6, 3), (0.6, 3)], 7, flat, StepCosts({1: 0.5, 2: 0.5})) == [1, 1]


def test_acceptance_counts_each_draft_tried_up_to_the_first_miss():
    acceptance = Acceptance()
    assert acceptance.rate == 0.5
    acceptance.record(num_drafts=4, num_accepted=4)  # four tried, four kept
    assert (acceptance.kept, acceptance.tried) == (5, 6)
    acceptance.record(num_drafts=4, num_accepted=1)  # the second missed: two tried, one kept
    assert (acceptance.kept, acceptance.tried) == (6, 8)
    for _ in range(100):
        acceptance.record(num_drafts=3, num_accepted=0)
    assert acceptance.rate < 0.1, "recent misses outweigh old hits"
    assert acceptance.tried <= 64


def test_accept_drafts_keeps_the_drafts_up_to_the_first_miss_and_the_token_sampled_there():
    assert accept_drafts([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all kept, and the token after
    assert accept_drafts([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # the miss's sampled token ends it
    assert accept_drafts([5, 6, 7], [4, 6, 7, 8]) == [4]
    assert accept_drafts([], [3]) == [3]


@pytest.mark.parametrize(
    "value, message",
    [
        ("{not json", "not valid JSON"),
        ('["ngram"]', "must be a JSON object"),
        ({"method": "eagle"}, "must be one of ngram, draft_model"),
        ({"method": "draft_model"}, "needs the draft model.s folder"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens must be a positive integer"),
        ({"prompt_lookup_min": 5, "prompt_lookup_max": 2}, "give min <= max"),
        ({"num_spec_tokens": 4}, "unknown speculative config field 'num_spec_tokens'"),
    ],
)
def test_a_bad_speculative_config_says_what_is_wrong(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)


def test_a_speculative_config_given_as_json_is_parsed_at_the_edge():
    assert EngineConfig(speculative_config='{"method": "ngram"}').speculative_config == SpeculativeConfig()


def test_a_speculative_method_is_read_in_any_case_as_sglang_spells_it():
    assert SpeculativeConfig.parse({"method": "NGRAM"}) == SpeculativeConfig()


def test_the_banner_says_speculation_is_on(tiny_model_factory):
    config = {"method": "ngram", "num_speculative_tokens": 2}
    llm = LLM(model=tiny_model_factory(), dtype="float32", kernels="torch", use_graphs=False, speculative_config=config)
    assert llm.engine.describe().endswith("scheduling, speculative decoding (ngram, 2 tokens)")
    assert "speculative" not in LLM(model=tiny_model_factory(), dtype="float32", kernels="torch", use_graphs=False).engine.describe()


# -- the scheduler's side: what a verify row keeps and gives back -----------------------------------


def verify_once(sampled_after: list[int], max_tokens: int = 20, eos: int = 99, drafts: list[int] = (1, 2, 3)):
    """A scheduler with one decoding sequence whose tokens so far repeat [1, 2, 3]; schedules its
    verify step (expecting `drafts`) and hands it back with `sampled_after` as the tokens sampled at
    its 1 + len(drafts) positions."""
    allocator = BlockAllocator(num_blocks=9, block_size=4)
    scheduler = Scheduler(
        allocator, max_num_seqs=4, prefill_chunk_size=16, max_model_len=64, max_decode_batch=4,
        eos_ids=frozenset({eos}), drafter=NgramDrafter(3, 1, 3),
    )
    seq = Sequence(0, [1, 2, 3, 1, 2], SamplingParams(max_tokens=max_tokens, temperature=0), max_tokens=max_tokens)
    scheduler.add(seq)
    prefill = scheduler.schedule()
    scheduler.update_from_output(prefill, [3], now=0.0)  # the prompt's token: the output is [3]
    step = scheduler.schedule()
    assert step.draft_ids == [list(drafts)], "the drafter should have guessed the loop"
    assert step.query_lens == [1 + len(drafts)]
    outputs = scheduler.update_from_output(step, sampled_after, now=0.0)
    return scheduler, seq, outputs


def test_a_verify_row_takes_blocks_for_its_drafts():
    allocator = BlockAllocator(num_blocks=9, block_size=4)
    scheduler = Scheduler(allocator, 4, 16, 64, 4, drafter=NgramDrafter(3, 1, 3))
    seq = Sequence(0, [1, 2, 3, 1, 2], SamplingParams(max_tokens=20, temperature=0), max_tokens=20)
    scheduler.add(seq)
    scheduler.update_from_output(scheduler.schedule(), [3], now=0.0)
    scheduler.schedule()
    assert seq.num_computed == 9 and len(seq.block_ids) == 3  # positions 5..8: a third block, for drafts only


def test_a_verify_row_keeps_its_matching_drafts_and_gives_back_the_blocks_of_the_rest():
    scheduler, seq, outputs = verify_once([1, 7, 3, 1])  # the second draft missed: 7 was sampled there
    assert outputs[0].new_token_ids == [1, 7] and seq.output_ids == [3, 1, 7]
    assert seq.num_computed == 7 and seq.num_tokens == 8  # positions 5 and 6 computed; 7 (the 7) next
    assert len(seq.block_ids) == 2, "the block taken only for the rejected drafts must go back"
    assert scheduler.allocator.num_free == 9 - 1 - 2
    assert (scheduler.spec.num_drafts, scheduler.spec.num_draft_tokens, scheduler.spec.num_accepted_tokens) == (1, 3, 1)
    assert scheduler.spec.accepted_per_position == [1, 0, 0]


def test_eos_inside_an_accepted_run_ends_the_row_there():
    scheduler, seq, outputs = verify_once([1, 2, 3, 1], eos=2)
    assert outputs[0].new_token_ids == [1, 2] and outputs[0].finish_reason is FinishReason.STOP
    assert seq.output_ids == [3, 1, 2] and seq.block_ids == []  # finished: every block back
    assert scheduler.allocator.num_free == 9 - 1


def test_a_row_whose_newest_token_is_on_the_device_still_gets_every_draft():
    """With async scheduling a row drafts after a guess of its newest token, which is not a draft:
    the drafter is asked for one more guess, so the row still carries num_speculative_tokens."""
    allocator = BlockAllocator(num_blocks=9, block_size=4)
    scheduler = Scheduler(allocator, 4, 16, 64, 8, drafter=NgramDrafter(3, 1, 3))
    seq = Sequence(0, [1, 2, 3, 1, 2], SamplingParams(max_tokens=20, temperature=0), max_tokens=20)
    scheduler.add(seq)
    prefill = scheduler.schedule()  # its token (a 3, by the loop) is not read back yet
    step = scheduler.schedule(follows=prefill.id)
    assert seq.awaits_token and step.draft_ids == [[1, 2, 3]], "a guess of 3, then three drafts"


def test_drafts_that_pay_count_the_round_that_guesses_a_token_still_on_the_device():
    flat = StepCosts({1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0})
    # Drafts at 0.9 add 0.9, 1.71 and 2.44 tokens. A row whose newest token is on the device pays
    # a round more: at 0.3 a round, three drafts still pay (3.44 tokens / 2.2 steps beats 1 / 1);
    # at 0.7, two pay without that round (2.71 / 2.4) and none with it (3.44 / 3.8 is the best).
    assert drafts_that_pay(1, [(0.9, 3)], 7, flat, StepCosts({1: 0.3}), leads=[1]) == [3]
    assert drafts_that_pay(1, [(0.9, 3)], 7, flat, StepCosts({1: 0.7})) == [2]
    assert drafts_that_pay(1, [(0.9, 3)], 7, flat, StepCosts({1: 0.7}), leads=[1]) == [0]


def test_drafts_never_reach_past_max_tokens():
    # One token out, three to go: one draft at most, so the row's 1 + 1 tokens end at max_tokens.
    scheduler, seq, outputs = verify_once([1, 2], max_tokens=3, drafts=[1])
    assert seq.output_ids == [3, 1, 2] and seq.finish_reason is FinishReason.LENGTH


# -- the whole engine: the same tokens as without speculation ---------------------------------------


@pytest.fixture(scope="module")
def looping_models(tmp_path_factory) -> dict[float, object]:
    """Tiny models whose greedy output loops often (0.6) or now and then (0.8)."""
    return {
        scale: make_tiny_model(tmp_path_factory.mktemp(f"looping-{scale}") / "model", "llama-gqa-tied", weight_scale=scale)
        for scale in (0.6, 0.8)
    }


def workload(seed: int = 0, num_requests: int = 6) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts, params = [], []
    for _ in range(num_requests):
        phrase = [rng.randrange(97) for _ in range(rng.randrange(3, 8))]
        prompts.append((phrase * 4)[: rng.randrange(6, 24)])  # some prompts repeat a phrase
        params.append(SamplingParams(max_tokens=rng.randrange(5, 70), temperature=0, ignore_eos=True))
    return prompts, params


@pytest.fixture(scope="module")
def reference(looping_models) -> dict[float, list[list[int]]]:
    prompts, params = workload()
    return {scale: generate(model, prompts, params, pp=1, depth=0)[0] for scale, model in looping_models.items()}


SCHEDULES = [(pp, depth, async_scheduling) for pp in (1, 2, 3) for depth in (0, 1, 2) for async_scheduling in (True, False)]
# Costs under which a step is worth some of its drafts and not all: a row starts with one draft
# (kept at 1/2 until it is verified) and verifies more once its drafts are kept more often.
SOME_DRAFTS = StepCosts({1: 1.0, 2: 1.2, 4: 1.9, 8: 2.6, 16: 4.0, 24: 6.0, 32: 8.0})


@pytest.mark.parametrize(
    "pp, depth, async_scheduling, step_costs",
    [(*schedule, None) for schedule in SCHEDULES] + [(2, 1, True, SOME_DRAFTS), (1, 0, False, SOME_DRAFTS)],
    ids=lambda value: "some-drafts" if value is SOME_DRAFTS else None,
)
def test_greedy_output_with_speculation_is_the_output_without(
    looping_models, reference, pp, depth, async_scheduling, step_costs
):
    prompts, params = workload()
    drafted = accepted = num_drafts = 0
    for scale, model in looping_models.items():
        got, llm = generate(
            model, prompts, params, step_costs, pp=pp, depth=depth, async_scheduling=async_scheduling, speculative_config=NGRAM,
        )
        assert got == reference[scale], f"weight scale {scale}: speculation changed the greedy output"
        spec = llm.engine.stats.spec
        num_drafts, drafted, accepted = num_drafts + spec.num_drafts, drafted + spec.num_draft_tokens, accepted + spec.num_accepted_tokens
        assert llm.engine.allocator.num_free == llm.engine.allocator.num_blocks - 1, "KV blocks leaked"
        if step_costs is not None:  # the costs held some drafts back that would otherwise have gone
            _, every = generate(
                model, prompts, params, None, pp=pp, depth=depth, async_scheduling=async_scheduling, speculative_config=NGRAM,
            )
            assert spec.num_draft_tokens < every.engine.stats.spec.num_draft_tokens, (spec.describe(), every.engine.stats.spec.describe())
    # Both kinds of verify outcome happened: drafts kept, and drafts rejected.
    assert 0 < accepted < drafted, (num_drafts, drafted, accepted)


# A weight read that dwarfs each row's cost and any host gap: two steps always cost more than one.
FIXED_COST = StepCosts({size: 1.0 + size / 1000 for size in (1, 2, 4, 8, 16, 24, 32)})


@pytest.mark.parametrize("step_costs", [FIXED_COST, None], ids=["fixed-cost", "no-costs"])
def test_launching_ahead_waits_for_verify_rows_only_where_splitting_the_batch_costs_more(looping_models, reference, step_costs):
    """pp 1 with async scheduling: a verify row's next input is known only once read back, so a
    step launched ahead before then would carry only the other rows. Where a step's cost is
    mostly the weight read (CPU and GPU decode), the engine waits and keeps the batch whole;
    without costs to weigh it launches ahead as before. The tokens are the same either way."""
    prompts, params = workload()
    llm = LLM(model=looping_models[0.6], dtype="float64", pp=1, depth=0, speculative_config=NGRAM, max_num_seqs=8)
    engine, ring = llm.engine, llm.engine.ring
    engine.scheduler.speculation.step_costs = step_costs
    split_launches, launch = [], ring.launch

    def watching_launch(slot, step):
        rows = set(map(id, step.seqs))  # this step's own verify rows have their drafts already
        verifying = [seq for seq in engine.scheduler.running if seq.draft_ids and id(seq) not in rows]
        if not step.is_prefill and verifying:
            split_launches.append(len(verifying))
        return launch(slot, step)

    ring.launch = watching_launch
    try:
        seqs = [engine.add_request(prompt, p) for prompt, p in zip(prompts, params)]
        while engine.has_work():
            engine.step()
        assert [seq.output_ids for seq in seqs] == reference[0.6]
        assert engine.stats.spec.num_drafts > 0
        if step_costs is FIXED_COST:
            assert split_launches == []
            assert 0 < engine.scheduler.speculation.host_gap < 1.0  # measured after each wait
        else:
            assert split_launches
    finally:
        engine.close()


def tokens_and_logprobs(model, prompts, params, **options) -> tuple[list, list, LLM]:
    """Each request's tokens and logprobs, every draft verified (no step costs)."""
    llm = LLM(model=model, dtype="float64", **options)
    engine = llm.engine
    if engine.scheduler.speculation is not None:
        engine.scheduler.speculation.step_costs = None
    try:
        seqs = [engine.add_request(prompt, p) for prompt, p in zip(prompts, params)]
        while engine.has_work():
            engine.step()
        return [seq.output_ids for seq in seqs], [seq.logprobs for seq in seqs], llm
    finally:
        engine.close()


@pytest.mark.parametrize("pp, async_scheduling, procs", [(1, False, False), (2, True, False), (2, True, True)])
def test_drafted_rows_report_the_logprobs_of_the_tokens_they_keep(looping_models, pp, async_scheduling, procs):
    """A verify row scores every token it verifies and reports those it keeps: the same tokens,
    logprobs and alternatives as without speculation (float64: equal to rounding)."""
    from dataclasses import replace

    prompts, params = workload()
    params = [replace(p, logprobs=2 + i % 3) for i, p in enumerate(params)]
    options = dict(pp=pp, async_scheduling=async_scheduling, procs=procs)
    plain_ids, plain, _ = tokens_and_logprobs(looping_models[0.6], prompts, params, **options)
    ids, got, llm = tokens_and_logprobs(looping_models[0.6], prompts, params, speculative_config=NGRAM, **options)
    spec = llm.engine.stats.spec
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens  # runs kept and drafts rejected, with logprobs
    assert ids == plain_ids
    for tokens, entries, expected in zip(ids, got, plain):
        assert [e.token_id for e in entries] == tokens and len(entries) == len(expected)
        for entry, want in zip(entries, expected):
            assert entry.logprob == pytest.approx(want.logprob, abs=1e-6)
            assert [t for t, _ in entry.top] == [t for t, _ in want.top]
            assert [v for _, v in entry.top] == pytest.approx([v for _, v in want.top], abs=1e-6)


def test_preemption_and_aborts_with_speculation(looping_models, reference):
    """A cache too small for all the requests at once: rows are preempted and recomputed; one
    request is aborted while a verify step of it is in flight. The rest get their tokens."""
    prompts, params = workload()
    llm = LLM(
        model=looping_models[0.6], dtype="float64", pp=2, kv_cache_tokens=100, block_size=4, speculative_config=NGRAM,
    )
    engine = llm.engine
    try:
        run_aborting_one_mid_verify(engine, prompts, params, reference[0.6])
        assert engine.stats.spec.num_accepted_tokens > 0
    finally:
        engine.close()


def test_the_engine_times_each_bucket_at_start_up_only_with_speculation(looping_models):
    """And its buckets hold a verify step of every row with all its drafts, tokens being rows."""
    with_drafts, without = (
        LLM(model=looping_models[0.6], dtype="float64", pp=2, max_num_seqs=3, speculative_config=config)
        for config in (NGRAM, None)
    )
    try:
        assert with_drafts.engine.plan.max_batch == 3 * (1 + NGRAM["num_speculative_tokens"])
        assert without.engine.plan.max_batch == 3
        costs = with_drafts.engine.scheduler.speculation.step_costs
        assert sorted(costs.seconds) == list(with_drafts.engine.plan.sizes)
        assert all(seconds > 0 for seconds in costs.seconds.values())
        assert costs(3) == costs.seconds[4] and costs(1000) == costs.seconds[max(costs.seconds)]
        assert without.engine.scheduler.speculation is None
    finally:
        with_drafts.engine.close()
        without.engine.close()


def test_seeded_sampling_with_speculation_repeats_itself_without_async_scheduling(looping_models):
    """A seeded request draws once per position it samples, so its tokens depend on where it
    drafted. Without async scheduling a row drafts from its own tokens only (with it, from a guess
    of a token still on the device, depending on timing), here no row rides along with a prompt
    chunk (every prompt fits the first), and every draft is verified (the step costs timed at
    start-up would decide otherwise from one start to the next): another pipeline gives the same tokens."""
    prompts, _ = workload()
    params = [SamplingParams(max_tokens=40, temperature=0.3, seed=index, ignore_eos=True) for index in range(len(prompts))]
    first, llm = generate(
        looping_models[0.6], prompts, params, None, pp=2, async_scheduling=False, speculative_config=NGRAM
    )
    assert llm.engine.stats.spec.num_accepted_tokens > 0
    again, _ = generate(
        looping_models[0.6], prompts, params, None, pp=1, depth=1, async_scheduling=False, speculative_config=NGRAM
    )
    assert first == again, "a seeded request must get the same tokens under another pipeline"


# -- sampling: the target's distribution --------------------------------------------------------------


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 4, 0.9)])
def test_verifying_a_draft_by_sampling_gives_the_target_distribution(temperature, top_k, top_p):
    """Two tokens from a known two-step model, drawn as a verify step draws them (the token at
    the first position, and one at the second given the draft in place of the first), with a
    fresh draw for the second where the draft was rejected. The pairs must follow the target's
    joint distribution p(t0) p(t1 | t0), whatever the draft."""
    torch.manual_seed(0)
    vocab, num_draws = 5, 20_000
    first_logits = torch.randn(vocab)  # (vocab,)
    draft = int(first_logits.argmax())  # a draft the target takes often, and not always
    next_logits = torch.randn(vocab, vocab) * 1.5  # (vocab, vocab): row t0 gives t1's logits
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    sampler = Sampler(torch.device("cpu"), seed=3)
    # One verify row per draw: sampled at its two positions in one call, as the ring does.
    logits = torch.stack([first_logits, next_logits[draft]]).repeat(num_draws, 1)  # (2 * draws, vocab)
    sampled = sampler(logits, [params] * (2 * num_draws), [None] * (2 * num_draws)).view(num_draws, 2).tolist()
    kept = [accept_drafts([draft], pair) for pair in sampled]
    rejected = [row for row, tokens in enumerate(kept) if len(tokens) == 1]
    fresh = sampler(next_logits[[kept[row][0] for row in rejected]], [params] * len(rejected), [None] * len(rejected))
    for row, token in zip(rejected, fresh.tolist()):
        kept[row].append(token)
    pairs = torch.tensor([t0 * vocab + t1 for t0, t1 in kept])
    p_first = reference_distribution(first_logits, temperature, top_k, top_p)
    p_next = torch.stack([reference_distribution(next_logits[t], temperature, top_k, top_p) for t in range(vocab)])
    assert_draws_follow(pairs, (p_first[:, None] * p_next).flatten())
    assert 0 < len(rejected) < num_draws  # both branches ran


def test_the_timeline_shows_verify_steps(looping_models):
    from graphrt.profiling.report import summarize

    prompts, params = workload()
    llm = LLM(model=looping_models[0.6], dtype="float64", pp=2, timeline=True, speculative_config=NGRAM)
    try:
        seqs = [llm.engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        while llm.engine.has_work():
            llm.engine.step()
        timeline = llm.engine.timeline
        verify = [piece for piece in timeline.slices if piece.kind == "verify"]
        # Every verify micro-batch crossed both stages.
        assert verify and {piece.stage for piece in verify} == {0, 1}
        assert all(seq.finished for seq in seqs)
        assert sum(use.num_verify for use in summarize(timeline, 2, llm.engine.depth).stages) == len(verify)
    finally:
        llm.engine.close()
