"""Behaviour the rest of the suite left unpinned, found by mutation testing (benchmarks/mutation.py):
each test here fails for a small change to scheduler, kv_cache, sampling or ring code that the
other fast tests let through. They go through public interfaces only."""

from __future__ import annotations

import pytest
import torch

from graphrt import SamplingParams
from graphrt.engine.block_allocator import BlockAllocator
from graphrt.model.config import ModelConfig
from graphrt.model.kv_cache import StageKVCache, bytes_per_block

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@pytest.mark.parametrize("seed", [INT64_MIN, -1, 0, INT64_MAX])
def test_any_int64_seed_is_accepted_negative_ones_too(seed):
    assert SamplingParams(seed=seed).seed == seed


@pytest.mark.parametrize("seed", [INT64_MIN - 1, INT64_MAX + 1])
def test_a_seed_outside_int64_is_refused(seed):
    with pytest.raises(ValueError, match=r"seed must be an integer in \[-9223372036854775808, 9223372036854775807\]"):
        SamplingParams(seed=seed)


@pytest.mark.parametrize("num_tokens, blocks", [(0, 0), (1, 1), (15, 1), (16, 1), (17, 2), (32, 2), (33, 3)])
def test_blocks_for_rounds_up_to_whole_blocks(num_tokens, blocks):
    assert BlockAllocator(num_blocks=8, block_size=16).blocks_for(num_tokens) == blocks


@pytest.mark.parametrize("num_blocks", [2, 3, 4, 5])
def test_capacity_is_every_block_but_the_scratch_one(num_blocks):
    allocator = BlockAllocator(num_blocks=num_blocks, block_size=16)
    assert allocator.capacity_tokens == (num_blocks - 1) * 16
    assert allocator.num_free == num_blocks - 1


def test_bytes_per_block_is_what_a_block_of_the_cache_takes(tiny_model_factory):
    cfg = ModelConfig.from_dir(tiny_model_factory())
    num_layers, num_blocks, block_size = 2, 3, 4
    cache = StageKVCache.allocate(cfg, num_layers, num_blocks, block_size, torch.device("cpu"), torch.float16)
    per_block = (cache.k.nbytes + cache.v.nbytes) // num_blocks
    assert bytes_per_block(cfg, num_layers, block_size, torch.float16) == per_block


def test_decode_rows_riding_a_prompt_chunk_leave_it_at_least_half(tiny_model_factory):
    """Many running decodes must not starve a new prompt: at most half of each chunk carries them."""
    from graphrt import LLM

    chunk = 8
    llm = LLM(
        model=tiny_model_factory(), pp=1, depth=0, async_scheduling=False, prefill_chunk_size=chunk,
        kv_cache_tokens=1024, buckets=[1, 2, 4, 8],
    )
    engine = llm.engine
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    decoding = [engine.add_request([3 + i], params) for i in range(7)]
    while any(seq.in_prefill for seq in decoding) or not all(seq.output_ids for seq in decoding):
        engine.step()
    prompt = engine.add_request(list(range(1, 41)), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    steps = []
    while prompt.in_prefill:
        before = prompt.num_computed
        engine.step()
        steps.append(prompt.num_computed - before)
    assert all(not seq.finished for seq in decoding)  # they were running alongside throughout
    assert [s for s in steps if s] and all(s >= chunk // 2 for s in steps if s), steps
    for seq in decoding:
        engine.abort(seq)
    while engine.has_work():
        engine.step()


def test_a_request_that_exactly_fills_the_cache_runs_and_one_token_more_is_refused(tiny_model_factory):
    from graphrt import LLM
    from graphrt.errors import RequestError

    llm = LLM(model=tiny_model_factory(), kv_cache_tokens=32, block_size=16)
    with pytest.raises(RequestError, match=r"needs 33 tokens of KV cache but the whole cache holds 32"):
        llm.generate([1] * 10, SamplingParams(max_tokens=23))
    out = llm.generate([1] * 10, SamplingParams(max_tokens=22, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 22 and out.finish_reason == "length"
