"""A stage that fails once: the server answers the request it was carrying with a 500 and keeps
serving; the KV blocks come back."""

from __future__ import annotations

import pytest

for package in ("fastapi", "uvicorn", "openai"):  # the server stack: not on every GPU image
    pytest.importorskip(package)

import openai  # noqa: E402

from graphrt.llm import LLM  # noqa: E402
from graphrt.server import ServerSettings, ServerThread  # noqa: E402


def test_one_stage_fault_fails_only_the_request_in_flight(tiny_model_factory):
    llm = LLM(model=tiny_model_factory(), pp=2, kv_cache_tokens=1024)
    engine = llm.engine
    stage = engine.pipeline.stages[1]
    forward, faults = stage.forward, []

    def faulty(x, meta, cache):
        if faults:
            faults.pop()
            raise RuntimeError("injected fault")
        return forward(x, meta, cache)

    stage.forward = faulty
    model_id = engine.model_dir.name
    with ServerThread(llm, ServerSettings(model_id=model_id)) as running:
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="none", max_retries=0)
        request = dict(model=model_id, prompt=[5, 6, 7], max_tokens=8, temperature=0)
        before = client.completions.create(**request)
        faults.append(1)
        with pytest.raises(openai.InternalServerError, match="pipeline stage failed"):
            client.completions.create(**request)
        after = client.completions.create(**request)
        assert after.choices[0].text == before.choices[0].text
        assert after.usage.completion_tokens == 8
        # Nothing of the failed request is left in the front's state either.
        assert running.async_engine._outputs._requests == {} and running.async_engine._request_ids == {}
    assert engine.allocator.num_free == engine.allocator.num_blocks - 1
