"""More requests than the KV cache holds at full length: the server admits them, preempts and
recomputes the youngest as blocks run out, and answers every one in full (tests/runtime/test_ring.py
checks that preempted requests get exactly the tokens they get alone)."""

from __future__ import annotations

import concurrent.futures

import pytest

for package in ("fastapi", "uvicorn", "openai", "httpx"):  # the server stack: not on every GPU image
    pytest.importorskip(package)

import httpx  # noqa: E402
import openai  # noqa: E402

from graphrt import LLM  # noqa: E402
from graphrt.server import ServerSettings, ServerThread  # noqa: E402

PROMPTS = [[(13 * i + j) % 90 + 3 for j in range(6 + i)] for i in range(6)]
MAX_TOKENS = 90  # 96 to 101 tokens each: a 256-token cache holds two at full length


def test_requests_beyond_the_cache_are_preempted_and_answered_in_full(tiny_model_factory):
    llm = LLM(model=tiny_model_factory("llama3-rope"), kv_cache_tokens=256, buckets=[1, 2, 4, 8])
    engine = llm.engine
    model_id = engine.model_dir.name
    with ServerThread(llm, ServerSettings(model_id=model_id)) as running:
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="none", max_retries=0)

        def ask(prompt):
            return client.completions.create(
                model=model_id, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
            )

        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            answers = list(pool.map(ask, PROMPTS))
        metrics = httpx.get(f"{running.url}/metrics").text
    assert [a.usage.completion_tokens for a in answers] == [MAX_TOKENS] * len(PROMPTS)
    assert [a.choices[0].finish_reason for a in answers] == ["length"] * len(PROMPTS)
    preemptions = next(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("graphrt_preemptions_total"))
    assert preemptions > 0
    assert engine.allocator.num_free == engine.allocator.num_blocks - 1
