"""Every malformed or out-of-range request gets a 4xx with an OpenAI-style error body naming the
problem, and the server keeps serving: /health and a good request work after each one."""

from __future__ import annotations

import json

import pytest

for package in ("fastapi", "uvicorn", "httpx"):  # the server stack: not on every GPU image
    pytest.importorskip(package)

import httpx  # noqa: E402

from helpers import SERVER_MODES, running_server  # noqa: E402

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 256
MAX_BODY_BYTES = 64 * 1024
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f"}}]


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


# (id, method, path, raw body, status, the parameter the error must name, or None)
BAD_REQUESTS = [
    ("invalid-json", "POST", COMPLETIONS, b'{"prompt": "hi",', 400, None),
    ("json-array", "POST", COMPLETIONS, b'["hi"]', 400, None),
    ("json-string", "POST", COMPLETIONS, b'"hi"', 400, None),
    ("empty-body", "POST", COMPLETIONS, b"", 400, None),
    ("non-utf8", "POST", COMPLETIONS, b'{"prompt": "\xff\xfe"}', 400, None),
    ("nan-literal", "POST", COMPLETIONS, b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    ("missing-prompt", "POST", COMPLETIONS, body(max_tokens=4), 400, "prompt"),
    ("missing-messages", "POST", CHAT, body(max_tokens=4), 400, "messages"),
    ("prompt-number", "POST", COMPLETIONS, body(prompt=5), 400, "prompt"),
    ("prompt-mixed-list", "POST", COMPLETIONS, body(prompt=[1, "a"]), 400, "prompt"),
    ("prompt-batch-empty-token-list", "POST", COMPLETIONS, body(prompt=[[1, 2], []]), 400, "prompt"),
    ("prompt-batch-too-many-sequences", "POST", COMPLETIONS, body(prompt=["a", "b", "c"], n=43), 400, "prompt"),
    ("prompt-empty", "POST", COMPLETIONS, body(prompt=""), 400, None),
    ("token-id-outside-vocab", "POST", COMPLETIONS, body(prompt=[1, 10**9]), 400, None),
    ("token-id-negative", "POST", COMPLETIONS, body(prompt=[-1]), 400, None),
    ("prompt-too-long", "POST", COMPLETIONS, body(prompt="word " * 400, max_tokens=4), 400, None),
    ("max-tokens-negative", "POST", COMPLETIONS, body(prompt="hi", max_tokens=-1), 400, "max_tokens"),
    ("max-tokens-zero", "POST", COMPLETIONS, body(prompt="hi", max_tokens=0), 400, "max_tokens"),
    ("max-tokens-huge", "POST", COMPLETIONS, body(prompt="hi", max_tokens=10**9), 400, None),
    ("max-tokens-string", "POST", COMPLETIONS, body(prompt="hi", max_tokens="16"), 400, "max_tokens"),
    ("max-tokens-float", "POST", COMPLETIONS, body(prompt="hi", max_tokens=4.5), 400, "max_tokens"),
    ("max-completion-tokens-disagree", "POST", CHAT, body(messages=USER, max_tokens=4, max_completion_tokens=8), 400, "max_tokens"),
    ("temperature-negative", "POST", COMPLETIONS, body(prompt="hi", temperature=-0.5), 400, "temperature"),
    ("temperature-too-high", "POST", COMPLETIONS, body(prompt="hi", temperature=3), 400, "temperature"),
    ("temperature-bool", "POST", COMPLETIONS, body(prompt="hi", temperature=True), 400, "temperature"),
    ("top-p-negative", "POST", COMPLETIONS, body(prompt="hi", top_p=-0.1), 400, "top_p"),
    ("top-p-above-one", "POST", COMPLETIONS, body(prompt="hi", top_p=1.5), 400, "top_p"),
    ("top-k-negative", "POST", COMPLETIONS, body(prompt="hi", top_k=-2), 400, "top_k"),
    ("n-zero", "POST", COMPLETIONS, body(prompt="hi", n=0), 400, "n"),
    ("n-huge", "POST", COMPLETIONS, body(prompt="hi", n=10_000), 400, "n"),
    ("seed-string", "POST", COMPLETIONS, body(prompt="hi", seed="abc"), 400, "seed"),
    ("seed-beyond-int64", "POST", COMPLETIONS, body(prompt="hi", seed=2**70), 400, "seed"),
    ("stop-empty-string", "POST", COMPLETIONS, body(prompt="hi", stop=[""]), 400, "stop"),
    ("stop-number", "POST", COMPLETIONS, body(prompt="hi", stop=5), 400, "stop"),
    ("stream-string", "POST", COMPLETIONS, body(prompt="hi", stream="yes"), 400, "stream"),
    ("stream-options-without-stream", "POST", COMPLETIONS, body(prompt="hi", stream_options={"include_usage": True}), 400, "stream_options"),
    ("stream-options-unknown-field", "POST", COMPLETIONS, body(prompt="hi", stream=True, stream_options={"x": 1}), 400, "stream_options.x"),
    ("messages-empty", "POST", CHAT, body(messages=[]), 400, "messages"),
    ("messages-not-a-list", "POST", CHAT, body(messages="hi"), 400, "messages"),
    ("message-without-role", "POST", CHAT, body(messages=[{"content": "hi"}]), 400, "messages[0].role"),
    ("message-unknown-role", "POST", CHAT, body(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages[0].role"),
    ("message-content-number", "POST", CHAT, body(messages=[{"role": "user", "content": 42}]), 400, "messages[0].content"),
    ("message-image-part", "POST", CHAT, body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400, "messages[0].content"),
    ("chat-prompt-too-long", "POST", CHAT, body(messages=[{"role": "user", "content": "word " * 400}]), 400, None),
    ("unknown-model", "POST", COMPLETIONS, body(prompt="hi", model="gpt-4"), 404, "model"),
    ("unknown-model-chat", "POST", CHAT, body(messages=USER, model="gpt-4"), 404, "model"),
    ("unknown-model-retrieve", "GET", "/v1/models/gpt-4", b"", 404, "model"),
    ("logprobs-above-20", "POST", COMPLETIONS, body(prompt="hi", logprobs=21), 400, "logprobs"),
    ("top-logprobs-without-logprobs", "POST", CHAT, body(messages=USER, top_logprobs=2), 400, "top_logprobs"),
    ("echo-in-chat", "POST", CHAT, body(messages=USER, echo=True), 400, "echo"),
    ("tool-choice-names-no-given-tool", "POST", CHAT, body(messages=USER, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "g"}}), 400, "tool_choice"),
    ("tool-choice-required-without-tools", "POST", CHAT, body(messages=USER, tool_choice="required"), 400, "tool_choice"),
    ("tool-choice-unknown", "POST", CHAT, body(messages=USER, tools=TOOLS, tool_choice="always"), 400, "tool_choice"),
    ("tool-name-with-a-space", "POST", CHAT, body(messages=USER, tools=[{"type": "function", "function": {"name": "get weather"}}]), 400, "tools[0].function.name"),
    ("tool-parameters-the-engine-refuses", "POST", CHAT, body(messages=USER, tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}}, "if": {"required": ["a"]}}}}], tool_choice="required"), 400, "tools[0].function.parameters"),
    ("assistant-content-null-without-tool-calls", "POST", CHAT, body(messages=[*USER, {"role": "assistant", "content": None}, *USER]), 400, "messages[1].content"),
    ("tool-message-without-tool-call-id", "POST", CHAT, body(messages=[*USER, {"role": "tool", "content": "x"}]), 400, "messages[1].tool_call_id"),
    ("unsupported-best-of", "POST", COMPLETIONS, body(prompt="hi", best_of=3), 400, "best_of"),
    ("unsupported-suffix", "POST", COMPLETIONS, body(prompt="hi", suffix="end"), 400, "suffix"),
    ("presence-penalty-above-2", "POST", COMPLETIONS, body(prompt="hi", presence_penalty=2.5), 400, "presence_penalty"),
    ("frequency-penalty-below-minus-2", "POST", CHAT, body(messages=USER, frequency_penalty=-3), 400, "frequency_penalty"),
    ("repetition-penalty-zero", "POST", COMPLETIONS, body(prompt="hi", repetition_penalty=0), 400, "repetition_penalty"),
    ("min-p-above-one", "POST", COMPLETIONS, body(prompt="hi", min_p=1.5), 400, "min_p"),
    ("min-tokens-above-max-tokens", "POST", COMPLETIONS, body(prompt="hi", max_tokens=4, min_tokens=8), 400, "min_tokens"),
    ("logit-bias-key-not-a-token-id", "POST", COMPLETIONS, body(prompt="hi", logit_bias={"one": 5}), 400, "logit_bias"),
    ("logit-bias-value-above-100", "POST", CHAT, body(messages=USER, logit_bias={"1": 150}), 400, "logit_bias"),
    ("logit-bias-key-outside-vocab", "POST", COMPLETIONS, body(prompt="hi", logit_bias={"1000000": 5}), 400, None),
    ("stop-token-ids-negative", "POST", COMPLETIONS, body(prompt="hi", stop_token_ids=[-1]), 400, "stop_token_ids"),
    ("allowed-token-ids-empty", "POST", COMPLETIONS, body(prompt="hi", allowed_token_ids=[]), 400, "allowed_token_ids"),
    ("bad-words-blank", "POST", COMPLETIONS, body(prompt="hi", bad_words=[" "]), 400, "bad_words"),
    ("unsupported-functions", "POST", CHAT, body(messages=USER, functions=[{"name": "f"}]), 400, "functions"),
    ("response-format-unknown-type", "POST", CHAT, body(messages=USER, response_format={"type": "xml"}), 400, "response_format.type"),
    ("response-format-json-schema-without-schema", "POST", COMPLETIONS, body(prompt="hi", response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     400, "response_format.json_schema.schema"),
    ("response-format-schema-keyword-the-engine-refuses", "POST", CHAT, body(messages=USER, response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}), 400, "response_format.json_schema.schema"),
    ("structured-outputs-two-kinds", "POST", COMPLETIONS, body(prompt="hi", structured_outputs={"regex": "a+", "choice": ["a"]}), 400, "structured_outputs"),
    ("structured-outputs-bad-regex", "POST", COMPLETIONS, body(prompt="hi", structured_outputs={"regex": "(a"}), 400, "structured_outputs.regex"),
    ("structured-outputs-with-a-named-tool", "POST", CHAT, body(messages=USER, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "f"}},
     structured_outputs={"choice": ["a"]}), 400, "structured_outputs"),
    ("unrecognized-argument", "POST", COMPLETIONS, body(prompt="hi", foo=1), 400, "foo"),
    ("vllm-guided-json", "POST", CHAT, body(messages=USER, guided_json={"type": "object"}), 400, "guided_json"),
    ("oversized-body", "POST", COMPLETIONS, body(prompt="a" * (2 * MAX_BODY_BYTES)), 413, None),
    ("unknown-route", "POST", "/v1/embeddings", body(input="hi"), 404, None),
    ("wrong-method", "GET", COMPLETIONS, b"", 405, None),
]


@pytest.fixture(scope="module", params=SERVER_MODES)
def server(default_model, request):
    settings = dict(max_body_bytes=MAX_BODY_BYTES)
    with running_server(request.param, settings, model=default_model, max_num_seqs=8, max_model_len=MAX_MODEL_LEN) as running:
        yield running


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def test_the_table_covers_enough():
    assert len(BAD_REQUESTS) >= 30
    assert len({case[0] for case in BAD_REQUESTS}) == len(BAD_REQUESTS)


@pytest.mark.parametrize(("method", "path", "raw", "status", "param"), [case[1:] for case in BAD_REQUESTS], ids=[case[0] for case in BAD_REQUESTS])
def test_bad_request_gets_4xx_and_server_keeps_serving(http, method, path, raw, status, param):
    response = http.request(method, path, content=raw, headers={"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and len(error["message"]) > 10
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param
        assert param.split("[")[0].split(".")[0] in error["message"]
    assert http.get("/health").status_code == 200


def test_messages_say_what_to_do(http):
    too_long = http.post(COMPLETIONS, json={"prompt": "word " * 400, "max_tokens": 4}).json()["error"]["message"]
    assert f"This model's maximum context length is {MAX_MODEL_LEN} tokens" in too_long and "shorten the prompt" in too_long
    huge = http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 10**9}).json()["error"]["message"]
    assert "lower max_tokens" in huge
    outside = http.post(COMPLETIONS, json={"prompt": "hi", "logit_bias": {"1000000": 5}}).json()["error"]["message"]
    assert "logit_bias" in outside and "outside the vocabulary [0, 49152)" in outside
    penalty = http.post(COMPLETIONS, json={"prompt": "hi", "presence_penalty": 2.5}).json()["error"]["message"]
    assert "[-2, 2]" in penalty
    unknown = http.post(COMPLETIONS, json={"prompt": "hi", "model": "gpt-4"}).json()["error"]["message"]
    assert "'SmolLM2-135M-Instruct'" in unknown
    guided = http.post(CHAT, json={"messages": USER, "guided_choice": ["a", "b"]}).json()["error"]["message"]
    assert guided == 'unrecognized request argument: guided_choice; send structured_outputs: {"choice": [...]} instead'


def test_neutral_values_of_unsupported_parameters_are_accepted(http):
    # clients often send the "off" value of a parameter explicitly
    response = http.post(COMPLETIONS, json={
        "prompt": "hi", "max_tokens": 2, "logprobs": None, "echo": False, "best_of": 1,
        "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "user": "someone", "repetition_penalty": 1.0,
        "min_p": None, "min_tokens": None, "stop_token_ids": None, "bad_words": None, "allowed_token_ids": None,
    })
    assert response.status_code == 200, response.text


def test_bad_requests_leave_no_blocks_and_count_as_rejected(http):
    metrics = http.get("/metrics").text
    assert "graphrt_kv_blocks_used 0.0" in metrics
    rejected = next(line for line in metrics.splitlines() if line.startswith('graphrt_requests_total{outcome="rejected"}'))
    assert float(rejected.split()[-1]) >= len([case for case in BAD_REQUESTS if case[4] != 405 and case[0] != "unknown-route"])
    ok = http.post(CHAT, json={"messages": USER, "max_tokens": 3, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
