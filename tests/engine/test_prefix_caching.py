"""Prefix caching: requests reuse the KV blocks of prefixes computed before and get exactly the
tokens they get without it (float64 tiny models, pp 1-3, async scheduling on and off, stage
processes), the allocator's references and its least-recently-used eviction, and what asks to
compute its prompt (prompt logprobs) does. Fuzzed accounting: tests/engine/test_block_accounting.py."""

from __future__ import annotations

import random

import pytest

from graphrt import LLM, SamplingParams
from graphrt.engine.block_allocator import BlockAllocator, block_keys

BLOCK = 4
ROOT = b"test-root"


def workload() -> list[list[int]]:
    """Prompts sharing prefixes of no, one, a partial and many blocks with an earlier one."""
    rng = random.Random(5)
    system = [rng.randrange(3, 97) for _ in range(23)]  # five whole blocks and three tokens
    tail = lambda n: [rng.randrange(3, 97) for _ in range(n)]  # noqa: E731
    return [
        system + tail(6),
        system + tail(2),  # many blocks
        system[:4] + tail(9),  # one block
        system[:6] + tail(3),  # a block and a half: only the whole one can be shared
        tail(11),  # nothing
        system + system[:8],  # the whole system prompt, then more of it
        system[:20],  # exactly five cached blocks: its last token, and so its last block, is still computed
    ]


def generate(llm: LLM, prompts: list[list[int]], together: bool) -> list[list[int]]:
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    if together:
        return [o.token_ids for o in llm.generate(prompts, params)]
    return [llm.generate([p], params)[0].token_ids for p in prompts]


def assert_cache_at_rest(engine) -> None:
    """Nothing runs: no block is referenced, and free plus cached blocks are the whole pool."""
    allocator = engine.allocator
    assert allocator.num_referenced == 0
    assert allocator.num_free == allocator.num_blocks - 1
    assert len(allocator._free) + allocator.num_cached == allocator.num_blocks - 1


@pytest.mark.parametrize(
    ("variant", "pp", "async_scheduling"),
    [("llama3-rope", pp, async_scheduling) for pp in (1, 2, 3) for async_scheduling in (True, False)]
    + [("deepseek-v3", pp, True) for pp in (1, 2, 3)],  # a mixture of experts with a latent cache
)
def test_cached_prefixes_give_exactly_the_uncached_tokens(tiny_model_factory, variant, pp, async_scheduling):
    model_dir = tiny_model_factory(variant)
    options = dict(
        pp=pp, dtype="float64", block_size=BLOCK, kv_cache_tokens=1024, prefill_chunk_size=8, async_scheduling=async_scheduling,
    )
    prompts = workload()
    expected = generate(LLM(model=model_dir, prefix_caching=False, **options), prompts, together=False)
    llm = LLM(model=model_dir, **options)
    assert generate(llm, prompts, together=False) == expected  # one after another: each finds the earlier ones cached
    hits_alone = llm.engine.allocator.num_hit_tokens
    assert hits_alone == BLOCK * (5 + 1 + 1 + 0 + 5 + 4)  # whole blocks only, never a prompt's last token
    assert_cache_at_rest(llm.engine)
    assert generate(llm, prompts, together=True) == expected  # arriving together: running ones share blocks
    assert llm.engine.allocator.num_hit_tokens > hits_alone
    assert_cache_at_rest(llm.engine)


def test_requests_admitted_together_share_what_the_first_computes(tiny_model_factory):
    """All admitted in one tick, before any of them computed anything: they find the first one's
    blocks when their own first chunk is about to run."""
    llm = LLM(model=tiny_model_factory(), dtype="float64", block_size=BLOCK, kv_cache_tokens=1024, prefill_chunk_size=16)
    system = list(range(10, 42))  # 8 blocks
    prompts = [system + [50 + i, 60 + i] for i in range(4)]
    llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert llm.engine.allocator.num_hit_tokens == 3 * len(system)


@pytest.mark.parametrize("pp", [1, 2])
def test_prompts_in_one_chunk_share_what_the_first_of_them_writes(tiny_model_factory, pp):
    """Four prompts with a two-block system prompt fit one chunk: the first computes the system
    prompt and the other three read its blocks in that same chunk (every stage's layers write the
    chunk's K/V before attending), with the tokens they get alone."""
    model_dir = tiny_model_factory("llama3-rope")
    options = dict(pp=pp, dtype="float64", block_size=BLOCK, kv_cache_tokens=1024, prefill_chunk_size=64)
    system = list(range(10, 18))
    prompts = [system + [50 + i, 60 + i, 70 + i] for i in range(4)]
    expected = generate(LLM(model=model_dir, prefix_caching=False, **options), prompts, together=False)
    llm = LLM(model=model_dir, **options)
    steps = []
    schedule = llm.engine.scheduler.schedule

    def recorded_schedule(*args, **kwargs):
        steps.append(schedule(*args, **kwargs))
        return steps[-1]

    llm.engine.scheduler.schedule = recorded_schedule
    assert generate(llm, prompts, together=True) == expected
    first = steps[0]
    assert first.is_prefill and first.query_lens == [11, 3, 3, 3]  # one chunk; the others compute their tails
    assert llm.engine.allocator.num_hit_tokens == 3 * len(system)
    assert_cache_at_rest(llm.engine)


def test_prompt_logprobs_compute_the_prompt(tiny_model_factory):
    """A request reporting its prompt's logprobs takes nothing from the cache, and reports every
    prompt token: the same numbers as with caching off."""
    model_dir = tiny_model_factory()
    options = dict(dtype="float64", block_size=BLOCK, kv_cache_tokens=1024)
    prompt = list(range(3, 30))
    asked = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=2, logprobs=1)
    expected = LLM(model=model_dir, prefix_caching=False, **options).generate([prompt], asked)[0]
    llm = LLM(model=model_dir, **options)
    llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    hits = llm.engine.allocator.num_hit_tokens
    got = llm.generate([prompt], asked)[0]
    assert llm.engine.allocator.num_hit_tokens == hits
    assert got.prompt_logprobs == expected.prompt_logprobs and got.logprobs == expected.logprobs
    assert len(got.prompt_logprobs) == len(prompt)


def test_stage_processes_give_the_same_tokens_with_caching_on_and_off(tiny_model_factory):
    model_dir = tiny_model_factory("llama-gqa-tied")
    options = dict(pp=2, dtype="float64", block_size=BLOCK, kv_cache_tokens=1024, prefill_chunk_size=8)
    prompts = workload()
    expected = generate(LLM(model=model_dir, prefix_caching=False, **options), prompts, together=False)
    llm = LLM(model=model_dir, procs=True, watchdog_s=30, **options)
    try:
        assert generate(llm, prompts, together=False) == expected
        assert generate(llm, prompts, together=True) == expected
        assert llm.engine.allocator.num_hit_tokens > 0
    finally:
        llm.engine.close()


# -- the allocator alone ---------------------------------------------------------------------------


def registered(allocator: BlockAllocator, tokens: list[int]) -> list[int]:
    """Allocate blocks for `tokens`' full blocks and register them, as a finished prefill would."""
    keys = block_keys(tokens, BLOCK, ROOT)
    blocks = allocator.allocate(len(keys))
    for block, key in zip(blocks, keys):
        allocator.register(block, key)
    return blocks


def test_keys_chain_so_a_block_is_found_only_after_the_same_prefix():
    first = block_keys([1, 2, 3, 4, 5, 6, 7, 8], BLOCK, ROOT)
    other_start = block_keys([9, 9, 9, 9, 5, 6, 7, 8], BLOCK, ROOT)
    assert first[1] != other_start[1]  # same tokens in block 1, another parent
    assert block_keys([1, 2, 3, 4, 5, 6, 7, 8], BLOCK, b"other-model") != first
    assert block_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], BLOCK, ROOT) == first  # a partial block has no key
    assert block_keys([1, 2, 3, 4, 5, 6, 7, 8], BLOCK, ROOT, start=1, parent=first[0]) == first[1:]


def test_unreferenced_blocks_stay_cached_and_are_evicted_least_recently_used_first():
    allocator = BlockAllocator(num_blocks=7, block_size=BLOCK)  # 6 usable
    old = registered(allocator, [1] * 8)  # 2 blocks
    new = registered(allocator, [2] * 8)
    allocator.free(old)
    allocator.free(new)
    assert allocator.num_free == 6 and allocator.num_cached == 4
    assert allocator.cached_prefix(block_keys([1] * 8, BLOCK, ROOT)) == old
    fresh = allocator.allocate(3)  # 2 never used, then the least recently used cached block
    assert set(fresh) & set(old) == {old[1]} and not set(fresh) & set(new)
    assert allocator.cached_prefix(block_keys([1] * 8, BLOCK, ROOT)) == [old[0]]
    assert allocator.cached_prefix(block_keys([2] * 8, BLOCK, ROOT)) == new


def test_taking_a_cached_block_protects_it_until_its_last_reference_goes():
    allocator = BlockAllocator(num_blocks=4, block_size=BLOCK)  # 3 usable
    blocks = registered(allocator, [7] * 4)
    allocator.take(blocks)  # a second request shares it
    allocator.free(blocks)
    assert allocator.num_referenced == 1 and allocator.num_cached == 0
    allocator.allocate(2)  # everything else: the shared block is not evicted
    assert allocator.num_free == 0
    with pytest.raises(RuntimeError, match="asked for 1 KV blocks with 0 free"):
        allocator.allocate(1)
    allocator.free(blocks)
    assert allocator.num_cached == 1 and allocator.num_free == 1
    with pytest.raises(RuntimeError, match="freed more often"):
        allocator.free(blocks)


def test_a_key_computed_twice_keeps_its_first_block_and_a_failure_forgets_all():
    allocator = BlockAllocator(num_blocks=5, block_size=BLOCK)
    first = registered(allocator, [3] * 4)
    second = registered(allocator, [3] * 4)  # two requests computed the same block at once
    allocator.free(first + second)
    assert allocator.num_cached == 1 and allocator.cached_prefix(block_keys([3] * 4, BLOCK, ROOT)) == first
    allocator.forget_cache()
    assert allocator.num_cached == 0 and allocator.num_free == 4
    assert allocator.cached_prefix(block_keys([3] * 4, BLOCK, ROOT)) == []


def test_server_over_stage_processes_serves_cached_prefixes_and_counts_them(tiny_model_factory):
    """`graphrt serve --procs`: the same tokens as without caching, and /metrics counts the hits."""
    for package in ("fastapi", "uvicorn", "httpx"):  # the server stack: not on every GPU image
        pytest.importorskip(package)
    import httpx

    from graphrt.server import ServerSettings, ServerThread

    model_dir = tiny_model_factory("llama-gqa-tied")
    options = dict(pp=2, dtype="float64", block_size=BLOCK, kv_cache_tokens=1024, prefill_chunk_size=8)
    prompts = workload()
    expected = generate(LLM(model=model_dir, prefix_caching=False, **options), prompts, together=False)
    llm = LLM(model=model_dir, procs=True, watchdog_s=30, **options)
    server = ServerThread(llm, ServerSettings(model_id="tiny")).start()
    try:
        # logprobs: a model without a tokenizer spells its tokens "token_id:N" there
        body = {"max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 0}
        got = [httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": p}, timeout=60).json() for p in prompts]
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    finally:
        server.stop()
    tokens = [[int(t.removeprefix("token_id:")) for t in answer["choices"][0]["logprobs"]["tokens"]] for answer in got]
    assert tokens == expected
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines() if line.startswith("graphrt_prefix_cache")}
    assert values["graphrt_prefix_cache_hits_total"] == BLOCK * (5 + 1 + 1 + 0 + 5 + 4)
    assert values["graphrt_prefix_cache_queries_total"] == sum(map(len, prompts))
    assert values["graphrt_prefix_cache_hit_rate"] == pytest.approx(values["graphrt_prefix_cache_hits_total"] / sum(map(len, prompts)))


@pytest.mark.slow
def test_default_model_greedy_text_is_unchanged(default_model):
    """Chats sharing a system prompt: the same greedy text with the cache as without (float32: the
    cached prefix is computed in other matmul shapes, which a near tie could tell; none here)."""
    system = "You are a helpful assistant who answers in one short sentence, plainly and without lists."
    questions = ["What is the capital of France?", "Name a large ocean.", "What do bees make?", "What is two plus two?"]
    params = SamplingParams(max_tokens=24, temperature=0)

    def answers(llm: LLM) -> list[str]:
        prompts = [llm.tokenizer.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": q}]) for q in questions]
        return [o.text for o in llm.generate(prompts, params)] + [llm.generate(prompts[:1], params)[0].text]

    expected = answers(LLM(default_model, dtype="float32", prefix_caching=False))
    llm = LLM(default_model, dtype="float32")
    assert answers(llm) == expected
    assert llm.engine.allocator.num_hit_tokens > 0
