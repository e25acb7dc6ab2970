"""A grammar that passes the server's checks but then fails to compile in the engine: the client
hears why, a 400 with the reason (or, streamed, an error event in the shape of every mid-stream
error), and the server goes on serving. Where the server itself fails at the grammar, it is a 500.

No grammar is known that xgrammar 0.2.8 reads (the server's check) and then fails to compile
against a vocabulary, so the failure is injected at xgrammar's compile function with monkeypatch;
that needs the engine in this process: a tiny random model with SmolLM2's tokenizer, on a thread.
"""

from __future__ import annotations

import json

import pytest

for package in ("fastapi", "uvicorn", "openai", "httpx", "xgrammar"):  # not on every GPU image
    pytest.importorskip(package)

import httpx  # noqa: E402
import openai  # noqa: E402
import xgrammar  # noqa: E402

from helpers import running_server  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "tiny-grammar"
UNCOMPILABLE = 'root ::= "a grammar xgrammar reads but will not compile"'
XGRAMMAR_MESSAGE = "[09:41:07] /project/cpp/grammar_compiler.cc:512: the grammar's automaton is too large"


@pytest.fixture(scope="module")
def server(default_model, tmp_path_factory):
    from transformers import AutoTokenizer

    from graphrt.tools.synthetic import make_tiny_model

    path = tmp_path_factory.mktemp("grammar") / MODEL
    tokenizer = AutoTokenizer.from_pretrained(default_model)
    make_tiny_model(path, "llama-gqa-tied", overrides={"vocab_size": len(tokenizer)})
    tokenizer.save_pretrained(path)
    with running_server("thread", model=path, dtype="float32", max_num_seqs=4) as running:
        yield running


@pytest.fixture
def uncompilable(monkeypatch):
    """xgrammar's compiler refuses UNCOMPILABLE, as it would a grammar it can read but not compile."""
    compile_grammar = xgrammar.GrammarCompiler.compile_grammar

    def compile_or_refuse(self, grammar, **options):
        if grammar == UNCOMPILABLE:
            raise RuntimeError(XGRAMMAR_MESSAGE)
        return compile_grammar(self, grammar, **options)

    monkeypatch.setattr(xgrammar.GrammarCompiler, "compile_grammar", compile_or_refuse)


def body(grammar: str) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Yes or no?"}], "max_tokens": 4, "temperature": 0,
            "structured_outputs": {"grammar": grammar}}


def ask(grammar: str) -> dict:
    """body(grammar) as the openai client's arguments."""
    fields = body(grammar)
    extra_body = {"structured_outputs": fields.pop("structured_outputs")}
    return {**fields, "extra_body": extra_body}


def sse_events(server, fields: dict) -> list[dict | str]:
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**fields, "stream": True}, timeout=60) as response:
        assert response.status_code == 200  # the stream had begun: its error comes as an event
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


def test_a_grammar_that_fails_to_compile_is_a_400_that_says_why(server, uncompilable):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**ask(UNCOMPILABLE))
    error = refused.value.body
    assert error["type"] == "invalid_request_error"
    assert error["message"] == (
        "structured_output.grammar passed the checks but failed to compile against the model's vocabulary: "
        "the grammar's automaton is too large; simplify the grammar, or drop it and check the output after the response"
    )
    answer = client.chat.completions.create(**ask('root ::= "yes" | "no"'))  # the server goes on
    assert answer.choices[0].message.content in ("yes", "no") and answer.choices[0].finish_reason == "stop"


def test_streamed_the_reason_comes_as_an_error_event_then_done(server, uncompilable):
    """No opening chunk first: it comes with the first tokens (vLLM's order), and there are none."""
    events = sse_events(server, body(UNCOMPILABLE))
    error, done = events
    assert error["error"]["type"] == "invalid_request_error" and "the grammar's automaton is too large" in error["error"]["message"]
    assert done == "[DONE]"
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIError, match="structured_output.grammar passed the checks but failed to compile"):
        for _ in client.chat.completions.create(stream=True, **ask(UNCOMPILABLE)):
            pass


def test_where_the_server_fails_at_a_grammar_it_is_a_500(server, monkeypatch):
    def broken_matcher(compiled, **options):  # xgrammar's matcher will not start: no fault of the request
        raise RuntimeError("injected: no matcher")

    monkeypatch.setattr(xgrammar, "GrammarMatcher", broken_matcher)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.InternalServerError) as failed:
        client.chat.completions.create(**ask('root ::= "up" | "down"'))
    assert failed.value.body["message"] == "structured outputs failed on this server (RuntimeError: injected: no matcher); see the server log"
