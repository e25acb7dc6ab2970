"""The whole engine with penalties, bias, masks, min_tokens and stop tokens: every greedy token is the
argmax of transformers' logits of the same prefix, processed by the per-request reference
(helpers.reference_logits), for pp 1 and 2, async scheduling on and off, under preemption and
with speculative decoding; seeded sampling repeats itself; a request with the defaults is not
touched, bit for bit; logprobs stay those of the raw logits (vLLM's default)."""

from __future__ import annotations

import pytest
import torch

from graphrt import LLM, SamplingParams
from helpers import hf_model, reference_logits

PROMPTS = [[(5 * i + 3 * j) % 96 + 1 for j in range(4 + 9 * i)] for i in range(6)]  # 4..49 tokens: chunks and riders
MAX_TOKENS = 24
PARAMS = [
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, presence_penalty=1.2),
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, frequency_penalty=0.7, repetition_penalty=1.3),
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, repetition_penalty=0.7, presence_penalty=-0.4),
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logit_bias={5: 3.0, 6: -2.0},
                   bad_words_token_ids=[[9], [14, 91], [91, 94, 24]], frequency_penalty=0.2),
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0, allowed_token_ids=list(range(0, 97, 3)), min_tokens=6,
                   stop_token_ids=[12], logit_bias={12: 1.5}),
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),  # the defaults
]
OPTIONS = dict(dtype="float64", kv_cache_tokens=2048, prefill_chunk_size=24, buckets=[1, 2, 4, 8])


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama3-rope")


@pytest.fixture(scope="module")
def reference(model):
    """Each token a request gets must be the argmax of transformers' logits of its prefix, processed."""
    hf = hf_model(model, torch.float64)
    eos_ids = {hf.config.eos_token_id}

    def check(prompts, params, outputs) -> None:
        for prompt, p, output in zip(prompts, params, outputs):
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + output])).logits[0]  # (positions, vocab)
            for t, token in enumerate(output):
                expected = reference_logits(logits[len(prompt) + t - 1], p, prompt, output[:t], eos_ids)
                assert token == int(expected.argmax()), (p, t, output)

    return check


def generate(model, params=PARAMS, prompts=PROMPTS, **options) -> tuple[list, LLM]:
    llm = LLM(model=model, **{**OPTIONS, **options})
    return llm.generate(prompts, params), llm


@pytest.mark.parametrize("pp, depth, async_scheduling", [(1, 0, False), (1, 0, True), (2, 1, True)])
def test_greedy_tokens_are_the_argmax_of_the_processed_reference_logits(model, reference, pp, depth, async_scheduling):
    outs, llm = generate(model, pp=pp, depth=depth, async_scheduling=async_scheduling)
    tokens = [o.token_ids for o in outs]
    reference(PROMPTS, PARAMS, tokens)
    # The parameters did something: every request but the last differs from its unprocessed output.
    plain = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    assert [o.token_ids != p.token_ids for o, p in zip(outs, plain)] == [True] * 5 + [False]
    # The request with stop token 12 went on past it for 6 tokens, then stopped at it.
    stopped = outs[4]
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == 12 and len(stopped.token_ids) > 6
    assert 12 not in stopped.token_ids[:-1] and all(t % 3 == 0 for t in stopped.token_ids)
    # The histories of ended requests go with the next micro-batch launched (`plain`'s keep none).
    assert not llm.engine.sampler.history.rows


def test_min_tokens_masks_eos_until_that_many_tokens(model, reference):
    forced_eos = dict(max_tokens=MAX_TOKENS, temperature=0, logit_bias={2: 100.0})  # EOS is token 2
    params = [SamplingParams(**forced_eos), SamplingParams(**forced_eos, min_tokens=5)]
    outs, _ = generate(model, params, PROMPTS[:2])
    assert [o.token_ids for o in outs][0] == [2] and outs[0].finish_reason == "stop"
    assert len(outs[1].token_ids) == 6 and outs[1].token_ids[-1] == 2 and outs[1].finish_reason == "stop"
    reference(PROMPTS[:2], params, [o.token_ids for o in outs])


def test_preempted_requests_start_their_histories_again_and_get_the_same_tokens(model, reference):
    outs, llm = generate(model, kv_cache_tokens=160, pp=2, depth=1)
    assert llm.engine.scheduler.num_preemptions > 0
    reference(PROMPTS, PARAMS, [o.token_ids for o in outs])


def test_a_prompt_from_the_prefix_cache_still_counts_for_the_repetition_penalty(model, reference):
    """The history starts from the host's prompt ids, whether the prompt's K/V was computed or cached."""
    shared = [(11 * j) % 96 + 1 for j in range(40)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, repetition_penalty=1.6)
    llm = LLM(model=model, **OPTIONS)
    first = llm.generate(shared, params)[0].token_ids
    queries, hits = llm.engine.allocator.num_queried_tokens, llm.engine.allocator.num_hit_tokens
    again = llm.generate([shared, shared + [5]], params)
    assert llm.engine.allocator.num_hit_tokens - hits >= 32 and llm.engine.allocator.num_queried_tokens > queries
    assert again[0].token_ids == first
    reference([shared, shared + [5]], [params] * 2, [o.token_ids for o in again])


def test_speculative_decoding_verifies_with_the_drafts_counted(tmp_path, reference):
    """A model whose output loops (ngram drafts are kept and missed), a repetition penalty below 1
    (drafts matter to the next entry's penalty), every draft verified: the tokens without speculation."""
    from graphrt.tools.synthetic import make_tiny_model

    looping = make_tiny_model(tmp_path / "looping", "llama-gqa-tied", weight_scale=0.6)
    params = [
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, repetition_penalty=0.8, frequency_penalty=0.1),
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, presence_penalty=0.3, bad_words_token_ids=[[40, 41]]),
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
    ]
    prompts = [[7, 8, 9, 7, 8, 9, 7, 8], [3, 1, 4, 1, 5, 9, 2, 6], [11, 12, 11, 12, 11]]
    expected = [o.token_ids for o in generate(looping, params, prompts)[0]]
    for pp, async_scheduling in [(1, True), (2, False)]:
        llm = LLM(model=looping, pp=pp, async_scheduling=async_scheduling, speculative_config={
            "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
        }, **OPTIONS)
        llm.engine.scheduler.speculation.step_costs = None  # every draft is verified
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected
        spec = llm.engine.stats.spec
        assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens, spec.describe()


def test_seeded_sampling_with_penalties_repeats_itself_and_leaves_default_requests_alone(model):
    seeded = SamplingParams(max_tokens=16, temperature=0.9, top_k=20, min_p=0.05, seed=7, ignore_eos=True,
                            presence_penalty=0.8, repetition_penalty=1.2)
    default = SamplingParams(max_tokens=16, temperature=1.0, seed=8, ignore_eos=True)
    llm = LLM(model=model, **OPTIONS)
    alone = [llm.generate(PROMPTS[1], seeded)[0].token_ids, llm.generate(PROMPTS[2], default)[0].token_ids]
    crowd = llm.generate(PROMPTS[:4], [PARAMS[0], seeded, default, PARAMS[3]])
    assert [crowd[1].token_ids, crowd[2].token_ids] == alone
    other = LLM(model=model, async_scheduling=False, pp=2, **OPTIONS)
    assert other.generate(PROMPTS[1], seeded)[0].token_ids == alone[0]
    unpenalized = SamplingParams(max_tokens=16, temperature=0.9, top_k=20, min_p=0.05, seed=7, ignore_eos=True)
    assert llm.generate(PROMPTS[1], unpenalized)[0].token_ids != alone[0]


def test_a_micro_batch_of_default_requests_carries_no_plan(model):
    llm = LLM(model=model, **OPTIONS)
    engine = llm.engine
    for prompt in PROMPTS:
        engine.add_request(prompt, SamplingParams(max_tokens=8, temperature=0.0, presence_penalty=0, repetition_penalty=1.0))
    plans = []
    while engine.has_work():
        engine.step()
        plans += [mb.logits_plan for mb in engine.ring.in_flight]
    assert plans and all(plan is None for plan in plans)


def test_logprobs_are_those_of_the_raw_logits(model):
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2, presence_penalty=2.0, logit_bias={4: 5.0})
    out = LLM(model=model, **OPTIONS).generate(PROMPTS[2], params)[0]
    hf = hf_model(model, torch.float64)
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPTS[2] + out.token_ids])).logits[0, len(PROMPTS[2]) - 1 : -1]
    raw = torch.log_softmax(logits, dim=-1)  # (tokens, vocab)
    for t, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(raw[t, token].item(), abs=1e-5)
        assert [tid for tid, _ in entry.top] == raw[t].topk(2).indices.tolist()
    assert out.token_ids.count(4) > 1  # the bias moved the tokens, and the logprobs did not follow it
