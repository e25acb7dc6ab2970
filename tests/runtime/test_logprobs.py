"""Logprobs equal transformers' log_softmax for the same tokens: generated ones and prompt ones,
on the default model in float32 and on tiny models in float64, across stages (threads and
processes), prefill chunking, async scheduling and preemption; the alternatives are the true top k,
and each token's rank its place among all."""

from __future__ import annotations

import pytest
import torch
import transformers

from graphrt import LLM, SamplingParams

PROMPT = "The quick brown fox jumps over the lazy dog. The capital of France is"


def hf_logprobs(model_dir, token_ids: list[int], dtype=torch.float32) -> torch.Tensor:
    """log_softmax of transformers' logits at every position of `token_ids` (row p predicts p + 1)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([token_ids])).logits[0].to(dtype), dim=-1)


def check_against(reference: torch.Tensor, output, num_top: int, num_prompt_top: int | None, atol: float) -> None:
    """Each reported logprob and alternative against the reference rows; the alternatives are the
    true top k, in order."""
    prompt_len = len(output.prompt_token_ids)
    ids = output.prompt_token_ids + output.token_ids
    assert len(output.logprobs) == len(output.token_ids)
    checked = [(prompt_len + i, entry, num_top) for i, entry in enumerate(output.logprobs)]
    if num_prompt_top is not None:
        assert len(output.prompt_logprobs) == prompt_len and output.prompt_logprobs[0] is None
        checked += [(p, output.prompt_logprobs[p], num_prompt_top) for p in range(1, prompt_len)]
    for position, entry, k in checked:
        row = reference[position - 1]
        assert entry.token_id == ids[position]
        assert abs(entry.logprob - row[entry.token_id].item()) <= atol, position
        # vLLM's rank: 1 + the tokens more likely; where the reference has others within atol, any count between
        more_likely, near = (row > row[entry.token_id] + atol).sum().item(), (row > row[entry.token_id] - atol).sum().item()
        assert 1 + more_likely <= entry.rank <= near, position
        top_values, top_ids = row.topk(k)
        assert [t for t, _ in entry.top] == top_ids.tolist(), position
        assert max((abs(v - r) for (_, v), r in zip(entry.top, top_values.tolist())), default=0.0) <= atol


@pytest.mark.slow
@pytest.mark.parametrize("pp, chunk", [(1, 512), (2, 5)])
def test_default_model_logprobs_equal_transformers(default_model, pp, chunk):
    """float32, to 1e-4: greedy tokens' logprobs with 5 alternatives, the prompt's with 3 (a chunk of
    5 tokens splits the prompt's scoring over several prefill steps)."""
    llm = LLM(default_model, pp=pp, dtype="float32", prefill_chunk_size=chunk)
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=5, prompt_logprobs=3)
    output = llm.generate([PROMPT], params)[0]
    reference = hf_logprobs(default_model, output.prompt_token_ids + output.token_ids)
    check_against(reference, output, 5, 3, atol=1e-4)


@pytest.mark.slow
def test_sampled_tokens_are_scored_before_temperature(default_model):
    """A hot, top-k limited sample reports the model's own distribution (vLLM's default), not the
    one it was drawn from."""
    llm = LLM(default_model, dtype="float32")
    params = SamplingParams(max_tokens=6, temperature=1.7, top_k=3, seed=7, logprobs=2)
    output = llm.generate([PROMPT], params)[0]
    reference = hf_logprobs(default_model, output.prompt_token_ids + output.token_ids)
    check_against(reference, output, 2, None, atol=1e-4)


def test_requests_without_logprobs_get_none_and_the_same_tokens(tiny_model_factory):
    llm = LLM(tiny_model_factory(), pp=2, dtype="float64", kv_cache_tokens=512)
    prompts = [[5, 9, 13, 2], list(range(20, 45))]
    plain = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    scored = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1, prompt_logprobs=0))
    assert [o.token_ids for o in plain] == [o.token_ids for o in scored]
    assert all(o.logprobs is None and o.prompt_logprobs is None for o in plain)
    assert all(len(o.logprobs) == 12 for o in scored)
    assert all(all(len(e.top) == 0 for e in o.prompt_logprobs[1:]) for o in scored)


@pytest.mark.parametrize("pp", [1, 2, 3])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_tiny_model_logprobs_in_float64(tiny_model_factory, pp, async_scheduling):
    """Batched with requests that ask for nothing, prompts chunked across steps: to float32's
    rounding of the values (they are reported in float32)."""
    model_dir = tiny_model_factory("qwen3-qk-norm")
    llm = LLM(model=model_dir, pp=pp, dtype="float64", kv_cache_tokens=1024, prefill_chunk_size=7, async_scheduling=async_scheduling)
    prompts = [list(range(3, 30)), [4, 8, 15, 16, 23, 42], [1, 2]]
    asked = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=4, prompt_logprobs=2)
    engine = llm.engine
    seqs = [engine.add_request(p, asked if i != 1 else SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)) for i, p in enumerate(prompts)]
    while engine.has_work():
        engine.step()
    for index in (0, 2):
        seq = seqs[index]
        output = type("Output", (), dict(
            prompt_token_ids=seq.prompt_ids, token_ids=seq.output_ids, logprobs=seq.logprobs, prompt_logprobs=seq.prompt_logprobs,
        ))
        reference = hf_logprobs(model_dir, seq.prompt_ids + seq.output_ids, torch.float64)
        check_against(reference, output, 4, 2, atol=1e-5)


def test_preempted_request_scores_its_prompt_once(tiny_model_factory):
    """A KV cache too small for both requests preempts one; its recomputed prefill must not score
    its prompt again, and its logprobs still line up with its tokens."""
    model_dir = tiny_model_factory()
    llm = LLM(model=model_dir, pp=2, dtype="float64", kv_cache_tokens=64, max_num_seqs=2, block_size=16)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    outputs = llm.generate([list(range(1, 20)), list(range(30, 45))], params)
    assert llm.engine.scheduler.num_preemptions > 0
    for output in outputs:
        reference = hf_logprobs(model_dir, output.prompt_token_ids + output.token_ids, torch.float64)
        check_against(reference, output, 1, 1, atol=1e-5)


def test_stage_processes_report_the_same_logprobs(tiny_model_factory):
    model_dir = tiny_model_factory("llama-gqa-tied")
    prompts = [list(range(3, 30)), [7, 7, 7]]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=0)
    options = dict(pp=3, dtype="float64", kv_cache_tokens=512, prefill_chunk_size=10)
    local = LLM(model=model_dir, **options).generate(prompts, params)
    remote_llm = LLM(model=model_dir, procs=True, watchdog_s=30, **options)
    try:
        remote = remote_llm.generate(prompts, params)
    finally:
        remote_llm.engine.close()
    assert [o.token_ids for o in remote] == [o.token_ids for o in local]
    assert [o.logprobs for o in remote] == [o.logprobs for o in local]
    assert [o.prompt_logprobs for o in remote] == [o.prompt_logprobs for o in local]
