"""Speculative decoding with a draft model: its guesses are its own greedy continuation, its cache
follows the rows through rejections, and the target's greedy output is unchanged under every
schedule, whether the draft agrees with the target (the target drafting for itself) or mostly not
(a one-layer model of its own).
"""

from __future__ import annotations

import random

import pytest
import torch

from graphrt import LLM, SamplingParams
from graphrt.engine import engine as engine_module
from graphrt.engine.draft_model import DraftModelDrafter, common_prefix
from graphrt.engine.drafter import StepCosts
from graphrt.model.config import ModelConfig
from graphrt.tools.synthetic import make_tiny_model
from helpers import generate_all, run_aborting_one_mid_verify


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, object]:
    """A target whose greedy output loops now and then, and a one-layer draft with its vocabulary."""
    root = tmp_path_factory.mktemp("draft-model")
    return {
        "target": make_tiny_model(root / "target", "llama-gqa-tied", weight_scale=0.6),
        "small": make_tiny_model(root / "small", "llama-gqa-tied", seed=1, num_layers=1, weight_scale=0.6),
    }


def drafter_for(model, num_tokens: int = 3, num_blocks: int = 64) -> DraftModelDrafter:
    vocab = ModelConfig.from_dir(model).vocab_size
    drafter = DraftModelDrafter(model, num_tokens, torch.device("cpu"), torch.float64, 256, vocab)
    drafter.allocate(num_blocks, block_size=4, max_rows=4)
    return drafter


def greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    llm = LLM(model=model, dtype="float64", pp=1)
    try:
        return llm.generate([prompt], SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True))[0].token_ids
    finally:
        llm.engine.close()


def test_common_prefix_stops_at_the_first_difference_or_the_limit():
    assert common_prefix([1, 2, 3, 4], [1, 2, 9, 4], 10) == 2
    assert common_prefix([1, 2, 3], [1, 2, 3, 4], 2) == 2
    assert common_prefix([], [1], 0) == 0


def test_the_drafts_are_the_draft_models_greedy_continuation(models):
    prompts = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42], [3] * 9]
    drafter = drafter_for(models["small"], num_tokens=4)
    got = drafter.propose_batch([(index, prompt, 4 - index) for index, prompt in enumerate(prompts)])
    assert got == [greedy(models["small"], prompt, 4 - index) for index, prompt in enumerate(prompts)]


def test_a_rows_cache_follows_it_through_rejections(models):
    """A row's tokens go on past its guesses with tokens of their own (as after a rejection), or
    keep some of them: the cached drafter proposes what a fresh one does from the whole context,
    feeding only what its cache lacks."""
    rng = random.Random(0)
    cached = drafter_for(models["small"])
    tokens = [rng.randrange(97) for _ in range(6)]
    for _ in range(8):
        fresh = drafter_for(models["small"])
        want = fresh.propose_batch([(0, tokens, 3)])
        assert cached.propose_batch([(0, tokens, 3)]) == want
        kept = rng.randrange(len(want[0]) + 1)
        tokens = tokens + want[0][:kept] + [rng.randrange(97)]  # the target's token after what it kept
        fresh.release(0)
    row = cached.rows[0]
    assert row.fed == row.tokens[:-1]
    cached.release(0)
    assert cached.allocator.num_free == cached.allocator.num_blocks - 1, "the draft cache leaked blocks"


def test_a_row_the_draft_cache_cannot_hold_gets_no_drafts(models):
    drafter = drafter_for(models["small"], num_blocks=3)  # two blocks of 4: 8 positions
    assert drafter.propose_batch([(0, list(range(7)), 3)]) == [[]]  # 7 + 2 positions do not fit
    assert drafter.propose_batch([(1, list(range(5)), 3)]) != [[]]
    assert drafter.allocator.num_free == 0


def test_a_draft_model_with_another_vocabulary_is_refused(models, tmp_path):
    other = make_tiny_model(tmp_path / "other", "llama-gqa-tied", overrides={"vocab_size": 64})
    with pytest.raises(ValueError, match="vocabulary of 64 tokens.*must share the target's tokenizer"):
        LLM(model=models["target"], dtype="float64", speculative_config={"method": "draft_model", "model": str(other)})


def workload(num_requests: int = 5) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(1)
    prompts = [[rng.randrange(97) for _ in range(rng.randrange(3, 20))] for _ in range(num_requests)]
    params = [SamplingParams(max_tokens=rng.randrange(5, 40), temperature=0, ignore_eos=True) for _ in prompts]
    return prompts, params


def run(model, prompts, params, **options) -> tuple[list[list[int]], LLM]:
    return generate_all(model, prompts, params, None, **options)  # every draft, whatever the step costs here


@pytest.fixture(scope="module")
def reference(models) -> list[list[int]]:
    return run(models["target"], *workload(), pp=1, depth=0)[0]


@pytest.mark.parametrize("draft", ["target", "small"])
@pytest.mark.parametrize("pp, depth, async_scheduling", [(1, 0, False), (2, 1, True), (3, 0, True)])
def test_greedy_output_with_a_draft_model_is_the_output_without(models, reference, draft, pp, depth, async_scheduling):
    config = {"method": "draft_model", "model": str(models[draft]), "num_speculative_tokens": 3}
    got, llm = run(
        models["target"], *workload(), pp=pp, depth=depth, async_scheduling=async_scheduling, speculative_config=config,
    )
    assert got == reference, "speculation changed the greedy output"
    spec = llm.engine.stats.spec
    assert spec.num_draft_tokens > 0
    if draft == "target":  # the target guessing for itself is right nearly always
        assert spec.num_accepted_tokens >= 0.9 * spec.num_draft_tokens, spec.describe()
    else:
        assert spec.num_accepted_tokens < spec.num_draft_tokens, spec.describe()
    drafter = llm.engine.scheduler.speculation.drafter
    assert not drafter.rows and drafter.allocator.num_free == drafter.allocator.num_blocks - 1, "draft KV leaked"
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_blocks - 1, "KV blocks leaked"


@pytest.mark.parametrize("round_cost, drafts", [(10.0, False), (0.01, True)])
def test_the_draft_model_guesses_only_where_its_rounds_pay(models, reference, round_cost, drafts):
    """Rounds of guesses that cost ten steps each are never made (the drafter is not even asked);
    ones that cost a hundredth of a step are. Either way the output is the output without."""
    config = {"method": "draft_model", "model": str(models["target"]), "num_speculative_tokens": 3}
    llm = LLM(model=models["target"], dtype="float64", pp=2, speculative_config=config)
    engine = llm.engine
    assert sorted(engine.scheduler.speculation.drafter.guess_costs.seconds)[-1] == engine.config.max_num_seqs  # timed at start-up
    engine.scheduler.speculation.step_costs = StepCosts({size: 1.0 for size in engine.plan.sizes})
    engine.scheduler.speculation.drafter.guess_costs = StepCosts({1: round_cost})
    asked = []
    propose = engine.scheduler.speculation.drafter.propose_batch
    engine.scheduler.speculation.drafter.propose_batch = lambda requests: asked.append(requests) or propose(requests)
    try:
        prompts, params = workload()
        seqs = [engine.add_request(prompt, p) for prompt, p in zip(prompts, params)]
        while engine.has_work():
            engine.step()
        assert [seq.output_ids for seq in seqs] == reference
        assert (engine.stats.spec.num_draft_tokens > 0) == drafts and bool(asked) == drafts
    finally:
        engine.close()


def test_preemption_and_aborts_with_a_draft_model(models, reference):
    """A cache too small for every request at once: rows are preempted (and their draft cache
    given back with their blocks, so only running rows hold any) and recomputed; one request is
    aborted with a verify step in flight. The rest get the tokens they get without speculation."""
    config = {"method": "draft_model", "model": str(models["target"]), "num_speculative_tokens": 3}
    llm = LLM(model=models["target"], dtype="float64", pp=2, kv_cache_tokens=60, block_size=4, speculative_config=config)
    engine, drafter = llm.engine, llm.engine.scheduler.speculation.drafter

    def only_running_rows_hold_draft_caches() -> None:
        running = {seq.request_id for seq in engine.scheduler.running}
        assert set(drafter.rows) <= running, "a preempted or finished row kept its draft cache"

    try:
        run_aborting_one_mid_verify(engine, *workload(), reference, after_each_step=only_running_rows_hold_draft_caches)
        assert not drafter.rows and drafter.allocator.num_free == drafter.allocator.num_blocks - 1, "draft KV leaked"
    finally:
        engine.close()


def kv_bytes(pipeline) -> int:
    return sum(cache.k.numel() * cache.k.element_size() + cache.v.numel() * cache.v.element_size() for cache in pipeline.caches)


def test_the_kv_budget_holds_the_draft_models_cache_too(models, monkeypatch):
    """On a CPU the KV caches get a fixed budget (on GPUs, free memory): with a draft model, its
    cache, a block for each of the target's and its rows' guesses, comes out of the same budget."""
    budget = 1 << 20
    monkeypatch.setattr(engine_module, "CPU_KV_CACHE_BYTES", budget)
    config = {"method": "draft_model", "model": str(models["small"]), "num_speculative_tokens": 3}
    llm = LLM(model=models["target"], dtype="float64", speculative_config=config)
    alone = LLM(model=models["target"], dtype="float64")
    try:
        engine, drafter = llm.engine, llm.engine.scheduler.speculation.drafter
        both = kv_bytes(engine.pipeline) + kv_bytes(drafter.pipeline)
        one_of_each = kv_bytes(engine.pipeline) // engine.allocator.num_blocks + drafter.kv_bytes_per_block(engine.config.block_size)
        assert budget - one_of_each < both <= budget, (both, budget)
        assert engine.allocator.num_blocks < alone.engine.allocator.num_blocks
    finally:
        llm.engine.close()
        alone.engine.close()
