"""A mixture of experts' load on /metrics: each stage's tokens per expert, and how uneven it is."""

from __future__ import annotations

import re

import pytest

for package in ("fastapi", "uvicorn", "openai", "httpx"):  # the server stack: not on every GPU image
    pytest.importorskip(package)

import httpx  # noqa: E402
import openai  # noqa: E402

from graphrt import LLM  # noqa: E402
from graphrt.server import ServerSettings, ServerThread  # noqa: E402

PROMPT = [5, 9, 13, 21, 34]
MAX_TOKENS = 7


def test_each_stages_tokens_per_expert_are_on_metrics(tiny_model_factory):
    """qwen3-moe-dense-first over 2 stages: layers 0-1 and 2-3, one sparse layer each, top-3 of 6."""
    llm = LLM(model=tiny_model_factory("qwen3-moe-dense-first"), pp=2, dtype="float32", kv_cache_tokens=256)
    model_id = llm.engine.model_dir.name
    with ServerThread(llm, ServerSettings(model_id=model_id)) as running:
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="none", max_retries=0)
        client.completions.create(model=model_id, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
        metrics = httpx.get(f"{running.url}/metrics").text
    counts = {  # prometheus writes the labels sorted by name
        (int(stage), int(expert)): float(value)
        for expert, stage, value in re.findall(r'^graphrt_moe_expert_tokens_total\{expert="(\d+)",stage="(\d+)"\} (\S+)$', metrics, re.M)
    }
    assert sorted(counts) == [(stage, expert) for stage in (0, 1) for expert in range(6)]
    fed = len(PROMPT) + MAX_TOKENS - 1  # every prompt token, and every sampled token but the last fed back
    for stage in (0, 1):
        per_expert = [counts[stage, expert] for expert in range(6)]
        assert sum(per_expert) == fed * 3  # one sparse layer, three choices a token
        imbalance = re.search(rf'^graphrt_moe_expert_load_imbalance\{{stage="{stage}"\}} (\S+)$', metrics, re.M)
        assert float(imbalance.group(1)) == pytest.approx(max(per_expert) * 6 / sum(per_expert))
