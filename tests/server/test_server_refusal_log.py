"""A refused request is one line on the server's stderr: the operator sees what clients keep
sending, at WARNING, a wrong API key and an unknown route at INFO (anyone who can reach the port
can send those), never a control character a client put in, and nothing with --disable-log-requests."""

from __future__ import annotations

import logging

import pytest

for package in ("fastapi", "uvicorn", "httpx"):  # the server stack: not on every GPU image
    pytest.importorskip(package)

import httpx  # noqa: E402

from graphrt import LLM  # noqa: E402
from graphrt.server import ServerSettings, ServerThread  # noqa: E402


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    return LLM(model=tiny_model_factory(), dtype="float32", kv_cache_tokens=256)


def refusals(records) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in records if r.name == "graphrt.server" and r.getMessage().startswith("refused")]


def test_each_refusal_is_a_line_with_its_route_status_and_message(llm, caplog):
    settings = ServerSettings(model_id="tiny", api_key="right-key")
    with ServerThread(llm, settings) as running, caplog.at_level(logging.INFO, logger="graphrt"):
        key = {"Authorization": "Bearer right-key"}
        httpx.post(f"{running.url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 0}, headers=key)
        httpx.post(f"{running.url}/v1/completions", json={"prompt": [1, 2]}, headers={"Authorization": "Bearer wrong"})
        httpx.get(f"{running.url}/v1/embeddings%1b[31m", headers=key)  # the path as the server reads it holds ESC
    lines = refusals(caplog.records)
    assert lines[0] == (logging.WARNING, "refused POST /v1/completions (400): max_tokens: Input should be greater than or equal to 1")
    assert lines[1][0] == logging.INFO and lines[1][1].startswith("refused POST /v1/completions (401): ")
    assert lines[2][0] == logging.INFO and lines[2][1].startswith("refused GET /v1/embeddings\\x1b[31m (404): ")
    assert len(lines) == 3 and not any("\x1b" in text for _, text in lines)


def test_disable_log_requests_silences_them(llm, caplog):
    with ServerThread(llm, ServerSettings(model_id="tiny", log_refused=False)) as running, caplog.at_level(logging.INFO, logger="graphrt"):
        refused = httpx.post(f"{running.url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 0})
    assert refused.status_code == 400 and refusals(caplog.records) == []
