"""The sampler draws from the right distribution, honours top-k / top-p, and seeds per request."""

from __future__ import annotations

import pytest
import torch

from graphrt import LLM, SamplingParams
from graphrt.runtime.sampler import Sampler
from helpers import assert_draws_follow, reference_distribution


def draw(sampler: Sampler, logits: torch.Tensor, params: SamplingParams, num_draws: int) -> torch.Tensor:
    batch = logits.expand(num_draws, -1)
    return sampler(batch, [params] * num_draws, [None] * num_draws)


def test_temperature_sampling_follows_the_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    tokens = draw(Sampler(torch.device("cpu"), seed=1), logits, SamplingParams(temperature=1.0), 40_000)
    frequencies = torch.bincount(tokens, minlength=4).float() / tokens.numel()
    torch.testing.assert_close(frequencies, torch.softmax(logits[0], -1), atol=0.01, rtol=0)


def test_temperature_sharpens_and_flattens():
    logits = torch.tensor([[1.0, 0.0]])
    sampler = Sampler(torch.device("cpu"), seed=2)
    for temperature in (0.5, 2.0):
        tokens = draw(sampler, logits, SamplingParams(temperature=temperature), 20_000)
        expected = torch.softmax(logits[0] / temperature, -1)[0].item()
        assert abs((tokens == 0).float().mean().item() - expected) < 0.015


def test_top_k_and_top_p_cut_the_tail():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    sampler = Sampler(torch.device("cpu"), seed=3)
    assert set(draw(sampler, logits, SamplingParams(top_k=2), 5000).tolist()) == {0, 1}
    # top_p=0.8 keeps 0.5 + 0.3 (mass before the third token is 0.8, which reaches the limit)
    assert set(draw(sampler, logits, SamplingParams(top_p=0.8), 5000).tolist()) == {0, 1}
    assert set(draw(sampler, logits, SamplingParams(top_p=0.81), 5000).tolist()) == {0, 1, 2}
    assert set(draw(sampler, logits, SamplingParams(top_p=0.01), 500).tolist()) == {0}


def test_greedy_rows_and_sampled_rows_share_a_batch():
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    params = [SamplingParams(temperature=0), SamplingParams(temperature=100.0, seed=4)]
    sampler = Sampler(torch.device("cpu"), seed=0)
    generator = sampler.request_generator(4)
    picks = [sampler(logits, params, [None, generator]).tolist() for _ in range(50)]
    assert all(p[0] == 1 for p in picks)
    assert len({p[1] for p in picks}) > 1


@pytest.mark.parametrize("pp, depth", [(1, 0), (2, 1), (3, 2)])
def test_a_seed_gives_the_same_tokens_whatever_shares_the_batch(tiny_model_factory, pp, depth):
    llm = LLM(model=tiny_model_factory(), pp=pp, depth=depth, dtype="float32", kv_cache_tokens=512)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    alone = llm.generate([[3, 4, 5]], seeded)[0].token_ids
    crowd = llm.generate([[9, 9], [3, 4, 5], [1, 2, 3, 4]], seeded)
    assert crowd[1].token_ids == alone
    other_seed = SamplingParams(max_tokens=12, temperature=1.0, seed=99, ignore_eos=True)
    assert llm.generate([[3, 4, 5]], other_seed)[0].token_ids != alone


LADDER = torch.tensor([[2.0, 1.6, 1.2, 0.8, 0.4, 0.0, -0.4, -0.8]])  # (1, vocab)


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [
        (0.5, 0, 0.7),  # sharpened: keeps 2 tokens (untempered mass would keep 3)
        (2.0, 0, 0.7),  # flattened: keeps 5 tokens (untempered mass would keep 3)
        (2.0, 3, 1.0),
        (0.5, 2, 1.0),
        (1.5, 4, 0.5),  # top_p cuts the 4 top_k tokens to 2
        (0.7, 3, 0.8),  # top_p over the 3 top_k tokens keeps 2 (over all 8 it would keep 3)
        (2.0, 3, 0.9),  # top_p keeps all 3 top_k tokens
    ],
)
def test_temperature_applies_before_top_k_and_top_p(temperature, top_k, top_p):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    tokens = draw(Sampler(torch.device("cpu"), seed=5), LADDER, params, 20_000)
    assert_draws_follow(tokens, reference_distribution(LADDER[0], temperature, top_k, top_p))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_seed_gives_the_same_tokens_whether_or_not_the_sequence_was_preempted(tiny_model_factory, async_scheduling):
    """A preempted sequence is prefilled again and goes on drawing from its own generator, which
    drew nothing while its tokens were recomputed."""
    prompts = [[(7 * i + j) % 97 for j in range(3 + 2 * i)] for i in range(8)]
    params = [SamplingParams(max_tokens=60, temperature=1.0, seed=100 + i, ignore_eos=True) for i in range(8)]
    roomy = LLM(model=tiny_model_factory(), dtype="float64", kv_cache_tokens=2048, async_scheduling=async_scheduling)
    unpreempted = [roomy.generate(p, sp)[0].token_ids for p, sp in zip(prompts, params)]
    assert roomy.engine.scheduler.num_preemptions == 0
    cramped = LLM(
        model=tiny_model_factory(), pp=2, depth=1, dtype="float64", kv_cache_tokens=160, prefill_chunk_size=32,
        buckets=[1, 2, 4, 8], async_scheduling=async_scheduling,
    )
    engine = cramped.engine
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while engine.has_work():
        engine.step()
    assert engine.scheduler.num_preemptions > 0
    assert [s.output_ids for s in seqs] == unpreempted
    assert len({tuple(tokens) for tokens in unpreempted}) == len(prompts)
