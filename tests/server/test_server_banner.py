"""The request the start-up banner offers to paste works against the server that prints it."""

from __future__ import annotations

import json
import shlex

import pytest

for package in ("fastapi", "uvicorn", "httpx"):  # the server stack: not on every GPU image
    pytest.importorskip(package)

import httpx  # noqa: E402

from graphrt.server.runner import curl_example  # noqa: E402
from helpers import running_server  # noqa: E402


def pasted(command: str) -> tuple[str, dict]:
    """(path, JSON body) of a `curl URL ... -d BODY` line, as a shell would split it."""
    words = shlex.split(command)
    return words[1], json.loads(words[words.index("-d") + 1])


def test_a_model_without_a_tokenizer_is_offered_a_completion_of_token_ids(tiny_model_factory):
    model = tiny_model_factory()
    with running_server("thread", model=model, dtype="float32", max_num_seqs=2) as server:
        url, body = pasted(curl_example(server.url, model.name, with_key=False, has_tokenizer=False))
        answer = httpx.post(url, json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        assert 0 < answer.json()["usage"]["completion_tokens"] <= body["max_tokens"]
        url, body = pasted(curl_example(server.url, model.name, with_key=False))
        assert httpx.post(url, json=body, timeout=60).status_code == 400  # the chat example: no chat template to apply
