"""Hostile requests (issue 13): a parameter value the engine cannot hold is refused at the edge or
clamped, so it never fails the micro-batch it would share with other streams; tiny temperatures
sample as greedy, the limit they approach; malformed bodies that used to raise inside the parser
get a 400 with OpenAI's error body."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

for package in ("fastapi", "uvicorn", "openai", "httpx"):  # the server stack: not on every GPU image
    pytest.importorskip(package)

import httpx  # noqa: E402
import openai  # noqa: E402
import torch  # noqa: E402

from graphrt.llm import LLM  # noqa: E402
from graphrt.runtime.sampler import Sampler  # noqa: E402
from graphrt.sampling_params import SamplingParams  # noqa: E402
from graphrt.server import ServerSettings, ServerThread  # noqa: E402
from helpers import prompt_logits  # noqa: E402

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
TINY_TEMPERATURES = [1e-40, 5e-324]  # a float32 subnormal, and the smallest float64 (0 in float32)


def assert_openai_error(response: httpx.Response, status: int = 400, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert isinstance(error["message"], str) and len(error["message"]) > 20
    if param is not None:
        assert error["param"] == param
    return error


# -- the sampler --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_logits(tiny_model_factory) -> torch.Tensor:
    """Last-position logits of a few prompts through a real (tiny, random) model."""
    llm = LLM(model=tiny_model_factory(), kv_cache_tokens=512)
    engine = llm.engine
    try:
        return torch.stack([prompt_logits(engine, prompt) for prompt in ([3, 4, 5], [9, 9], [1, 2, 3, 4], [60])])
    finally:
        engine.close()


@pytest.mark.parametrize("temperature", TINY_TEMPERATURES)
def test_tiny_temperatures_sample_as_greedy(real_logits, temperature):
    sampler = Sampler(torch.device("cpu"), seed=0)
    num_rows = real_logits.shape[0]
    tokens = sampler(real_logits, [SamplingParams(temperature=temperature)] * num_rows, [None] * num_rows)
    assert tokens.tolist() == real_logits.argmax(dim=-1).tolist()


def test_small_normal_temperatures_do_not_overflow_on_large_logits(real_logits):
    # 1e-30 is a normal float32 and is really sampled; logits of 1e9 / 1e-30 would overflow float32
    sampler = Sampler(torch.device("cpu"), seed=0)
    large = real_logits * 1e9
    num_rows = large.shape[0]
    tokens = sampler(large, [SamplingParams(temperature=1e-30)] * num_rows, [None] * num_rows)
    assert tokens.tolist() == large.argmax(dim=-1).tolist()


def test_top_k_beyond_the_vocabulary_means_no_limit(real_logits):
    num_rows = real_logits.shape[0]
    draws = {}
    for top_k in (0, 2**63 - 1):
        sampler = Sampler(torch.device("cpu"), seed=7)
        draws[top_k] = [sampler(real_logits, [SamplingParams(top_k=top_k)] * num_rows, [None] * num_rows).tolist() for _ in range(20)]
    assert draws[0] == draws[2**63 - 1]


@pytest.mark.parametrize(("field", "value"), [
    ("top_k", 2**64), ("seed", 2**64 - 1), ("seed", -(2**63) - 1), ("temperature", float("inf")),
])
def test_sampling_params_refuse_values_the_engine_cannot_hold(field, value):
    # top_k and seeds travel between stages as int64; an overflow there fails the whole micro-batch
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


# -- the server, on a tiny model slowed down so that streams overlap ---------------------------------


STREAM_TOKENS = 240  # the tiny model's context is 256


class SlowSampler:
    """The engine's sampler, ~20 ms a step: long streams are still running when other requests come."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler

    def __call__(self, logits, params, generators, plan=None):
        time.sleep(0.02)
        return self.sampler(logits, params, generators, plan)


@pytest.fixture(scope="module")
def tiny_server(tiny_model_factory):
    llm = LLM(model=tiny_model_factory(), kv_cache_tokens=2048, max_num_seqs=16)
    engine = llm.engine
    engine.ring.sampler = SlowSampler(engine.ring.sampler)
    with ServerThread(llm, ServerSettings(model_id=engine.model_dir.name)) as running:
        yield running


def run_stream(client: openai.OpenAI, model: str) -> tuple[str | None, int] | str:
    """Finish reason and completion tokens of one long greedy stream, or the error that ended it
    (the tiny model has no tokenizer, so its chunks carry no text and come at the end)."""
    try:
        return read_stream(client, model)
    except openai.APIError as exc:
        return f"{type(exc).__name__}: {exc.message}"


def read_stream(client: openai.OpenAI, model: str) -> tuple[str | None, int]:
    chunks = client.completions.create(
        model=model, prompt=[5, 6, 7], max_tokens=STREAM_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    finish_reason, completion_tokens = None, 0
    for chunk in chunks:
        for choice in chunk.choices:
            finish_reason = choice.finish_reason or finish_reason
        if chunk.usage is not None:
            completion_tokens = chunk.usage.completion_tokens
    return finish_reason, completion_tokens


# (name, extra fields, expected status): refused where the engine cannot hold the value, accepted
# (and clamped or read as its limit) where OpenAI or vLLM would accept it
HOSTILE = [
    ("top-k-2**64", {"top_k": 2**64}, 400),
    ("top-k-int64-max", {"top_k": 2**63 - 1}, 200),
    ("seed-2**64-1", {"seed": 2**64 - 1}, 400),
    ("seed-minus-one", {"seed": -1}, 200),
    ("seed-int64-min", {"seed": -(2**63)}, 200),
    ("temperature-1e-40", {"temperature": 1e-40}, 200),
    ("temperature-5e-324", {"temperature": 5e-324}, 200),
    ("top-p-5e-324", {"top_p": 5e-324}, 200),
    ("max-tokens-2**64", {"max_tokens": 2**64}, 400),
    ("n-2**64", {"n": 2**64}, 400),
]


def wait_until_running(http: httpx.Client, num_requests: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        gauge = next(line for line in http.get("/metrics").text.splitlines() if line.startswith("graphrt_requests_running "))
        if float(gauge.split()[-1]) >= num_requests:
            return
        time.sleep(0.01)
    raise AssertionError(f"{num_requests} requests were not running after {timeout} s")


def test_a_hostile_request_fails_alone_and_streams_in_flight_finish(tiny_server):
    with httpx.Client(base_url=tiny_server.url, timeout=60) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        client = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="none", max_retries=0)

        def send(fields: dict) -> httpx.Response:
            return http.post(COMPLETIONS, json={"model": model, "prompt": [5, 6, 7], "max_tokens": 4, **fields})

        num_streams = 3
        with ThreadPoolExecutor(num_streams + len(HOSTILE)) as pool:
            streams = [pool.submit(run_stream, client, model) for _ in range(num_streams)]
            wait_until_running(http, num_streams)
            responses = list(pool.map(send, [fields for _, fields, _ in HOSTILE]))
            overlapped = not any(stream.done() for stream in streams)
            results = [stream.result(timeout=120) for stream in streams]
    assert results == [("length", STREAM_TOKENS)] * num_streams
    assert overlapped, "the streams ended before the hostile requests came: the test proves nothing"
    assert {name: r.status_code for (name, _, _), r in zip(HOSTILE, responses)} == {name: status for name, _, status in HOSTILE}
    for (_, fields, status), response in zip(HOSTILE, responses):
        if status == 400:  # the message names the parameter
            assert next(iter(fields)) in assert_openai_error(response)["message"]


# -- the server, on the default model (tokenizer and chat template) ---------------------------------


@pytest.fixture(scope="module")
def server(default_model):
    llm = LLM(default_model, max_num_seqs=8, max_model_len=256)
    engine = llm.engine
    with ServerThread(llm, ServerSettings(model_id=engine.model_dir.name)) as running:
        yield running


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.mark.slow
def test_tiny_temperatures_answer_as_greedy_over_the_api(http):
    def text(temperature: float) -> str:
        body = json.dumps({"prompt": "The capital of France is", "max_tokens": 12, "temperature": temperature})
        response = http.post(COMPLETIONS, content=body, headers={"Content-Type": "application/json"})
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    greedy = text(0)
    assert [text(t) for t in TINY_TEMPERATURES] == [greedy] * len(TINY_TEMPERATURES)


DEEP = 20_000
# (id, path, raw body, the parameter the error must name or None, words the message must hold)
MALFORMED = [
    ("nested-20k-deep", COMPLETIONS, b'{"prompt": ' + b"[" * DEEP + b"]" * DEEP + b"}", None, "too deeply"),
    ("nested-20k-deep-top-level", CHAT, b"[" * DEEP + b"]" * DEEP, None, "too deeply"),
    ("nested-objects-20k-deep", CHAT, b'{"a": ' * DEEP + b"1" + b"}" * DEEP, None, "too deeply"),
    ("integer-5000-digits", COMPLETIONS, b'{"prompt": "hi", "max_tokens": ' + b"7" * 5000 + b"}", None, "digits"),
    ("lone-surrogate-prompt", COMPLETIONS, b'{"prompt": "hi \\ud800 there", "max_tokens": 2}', "prompt", "surrogate"),
    ("lone-low-surrogate-chat", CHAT, b'{"messages": [{"role": "user", "content": "\\udc00"}], "max_tokens": 2}', "messages[0].content", "surrogate"),
    ("lone-surrogate-text-part", CHAT, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\ud83d"}]}]}', "messages[0].content[0].text", "surrogate"),
    ("lone-surrogate-stop", COMPLETIONS, b'{"prompt": "hi", "stop": ["\\ud800"]}', "stop[0]", "surrogate"),
    ("lone-surrogate-key", COMPLETIONS, b'{"prompt": "hi", "\\ud800": 1}', None, "surrogate"),
    ("lone-surrogate-model", COMPLETIONS, b'{"prompt": "hi", "model": "\\ud800"}', "model", "surrogate"),
    ("chat-content-empty-list", CHAT, b'{"messages": [{"role": "user", "content": []}], "max_tokens": 2}', "messages[0].content", "non-empty list of text parts"),
    ("chat-content-empty-string", CHAT, b'{"messages": [{"role": "user", "content": ""}], "max_tokens": 2}', "messages[0].content", "non-empty string"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("path", "raw", "param", "words"), [case[1:] for case in MALFORMED], ids=[case[0] for case in MALFORMED])
def test_malformed_bodies_get_a_400_with_an_openai_error(http, path, raw, param, words):
    response = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    error = assert_openai_error(response, param=param)
    assert words in error["message"]
    assert http.get("/health").status_code == 200


@pytest.mark.slow
def test_surrogate_pairs_and_text_parts_are_still_accepted(http):
    pair = b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi \\ud83d\\ude00"}]}], "max_tokens": 2}'
    response = http.post(CHAT, content=pair, headers={"Content-Type": "application/json"})
    assert response.status_code == 200, response.text
