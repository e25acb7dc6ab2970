"""Penalties, `logit_bias`, `min_p`, `min_tokens`, `stop_token_ids`, `bad_words`,
`allowed_token_ids`, `skip_special_tokens`, `include_stop_str_in_output` and `return_token_ids` through `graphrt serve` with the real openai client, on completions and chat,
streamed and not: the tokens `LLM.generate` gives for the same parameters, the words banned, the
tokens allowed; and exactly what `vllm bench serve --backend openai` sends, answered in full.

A tiny random model with SmolLM2's tokenizer and chat template, so the server starts in a second
and words tokenize as they do for the default model. The engine runs on a thread here: the
parameters crossing to an engine process are checked in tests/engine/test_engine_process.py."""

from __future__ import annotations

import json
import shutil

import pytest

for package in ("fastapi", "uvicorn", "openai", "httpx"):  # the server stack: not on every GPU image
    pytest.importorskip(package)

import httpx  # noqa: E402
import openai  # noqa: E402

from graphrt import LLM, SamplingParams  # noqa: E402
from graphrt.tools.synthetic import make_tiny_model  # noqa: E402
from helpers import running_server  # noqa: E402

pytestmark = pytest.mark.slow  # SmolLM2's tokenizer comes from the default model's folder

MODEL = "tiny-chat"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
OPTIONS = dict(dtype="float32", max_num_seqs=8)


@pytest.fixture(scope="module")
def model(default_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("server-sampling") / MODEL
    make_tiny_model(path, "llama-gqa-tied", overrides={"vocab_size": 49152})
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(default_model / name, path / name)
    return path


@pytest.fixture(scope="module")
def offline(model) -> LLM:
    """The same model in this process: what the server must answer."""
    return LLM(model=model, **OPTIONS)


@pytest.fixture(scope="module")
def server(model):
    with running_server("thread", model=model, **OPTIONS) as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def text_of(offline: LLM, prompt, **params) -> tuple[str, list[int]]:
    out = offline.generate(prompt, SamplingParams(**params))[0]
    return out.text, out.token_ids


PENALIZED = dict(presence_penalty=1.2, frequency_penalty=0.5, logit_bias={"3247": -5.0, "42297": 4.0})
EXTENSIONS = dict(repetition_penalty=1.3, min_p=0.1, min_tokens=10, bad_words=["rust", "owners"], top_k=40)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completions_with_every_parameter_give_the_offline_tokens(client, offline, stream):
    prompt = "The capital of France is"
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, **PENALIZED, extra_body=EXTENSIONS)
    expected, tokens = text_of(
        offline, prompt, max_tokens=16, temperature=0, presence_penalty=1.2, frequency_penalty=0.5,
        logit_bias={3247: -5.0, 42297: 4.0}, repetition_penalty=1.3, min_p=0.1, min_tokens=10,
        bad_words=["rust", "owners"], top_k=40,
    )
    assert expected != text_of(offline, prompt, max_tokens=16, temperature=0)[0]  # the parameters change the output
    if stream:
        text = "".join(chunk.choices[0].text for chunk in client.completions.create(stream=True, **kwargs) if chunk.choices)
    else:
        text = client.completions.create(**kwargs).choices[0].text
    assert text == expected and tokens.count(42297) >= 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_with_penalties_gives_the_offline_tokens(client, offline, stream):
    prompt = offline.chat_prompt(QUESTION[0]["content"])
    expected, _ = text_of(offline, prompt, max_tokens=24, temperature=0, presence_penalty=2.0, repetition_penalty=1.5)
    kwargs = dict(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0, presence_penalty=2.0,
                  extra_body={"repetition_penalty": 1.5})
    if stream:
        chunks = client.chat.completions.create(stream=True, **kwargs)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    else:
        text = client.chat.completions.create(**kwargs).choices[0].message.content
    assert text == expected


def test_bad_words_never_appear_and_allowed_tokens_are_all_there_is(client, offline):
    unbanned = client.completions.create(model=MODEL, prompt="Hello", max_tokens=24, temperature=0).choices[0].text
    word = unbanned.split()[1]  # a word the model writes: banned, it is gone
    banned = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=24, temperature=0, extra_body={"bad_words": [word]},
    ).choices[0].text
    assert word in unbanned and word not in banned
    allowed = offline.tokenizer.encode(" yes") + offline.tokenizer.encode(" no")
    out = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=8, temperature=0.9, seed=3, extra_body={"allowed_token_ids": allowed},
    )
    assert set(out.choices[0].message.content.split()) <= {"yes", "no"} and out.usage.completion_tokens == 8


def test_a_stop_token_ends_the_text_before_itself_once_min_tokens_are_out(client, offline):
    _, tokens = text_of(offline, "One", max_tokens=16, temperature=0, ignore_eos=True)
    stop = tokens[3]
    first = tokens.index(stop)
    out = client.completions.create(
        model=MODEL, prompt="One", max_tokens=16, temperature=0, extra_body={"stop_token_ids": [stop]},
    )
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == first + 1
    assert out.choices[0].text == offline.tokenizer.decode(tokens[:first])  # the stop token's own text is left out
    later = client.completions.create(
        model=MODEL, prompt="One", max_tokens=16, temperature=0, extra_body={"stop_token_ids": [stop], "min_tokens": first + 2},
    )
    assert later.usage.completion_tokens > first + 2 or later.choices[0].finish_reason == "length"


def test_min_tokens_holds_eos_back(client):
    forced = {"logit_bias": {"2": 100}}  # SmolLM2's EOS, <|im_end|>
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=12, extra_body=forced).usage.completion_tokens == 1
    held = client.completions.create(model=MODEL, prompt="Hi", max_tokens=12, extra_body={**forced, "min_tokens": 5})
    assert held.usage.completion_tokens == 6 and held.choices[0].finish_reason == "stop"


def test_what_vllm_bench_serve_sends_is_answered_in_full(server):
    """`vllm bench serve --backend openai` (vllm/benchmarks/lib/endpoint_request_func.py): these
    fields on every request, then `ignore_eos` and the sampling fields of --extra-body."""
    payload = {
        "model": MODEL, "prompt": "The quick brown fox", "repetition_penalty": 1.0, "max_tokens": 12, "logprobs": None,
        "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0.0,
    }
    with httpx.Client(base_url=server.url, timeout=60) as http, http.stream("POST", "/v1/completions", json=payload) as response:
        assert response.status_code == 200, response.read()
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["text"]) >= 2
    assert chunks[-1]["usage"]["completion_tokens"] == 12


# <|im_start|> (1) is a special token that can come mid-output; <|im_end|> (2) is the EOS. Only
# <|im_start|> may be written until min_tokens are out, then the EOS is forced: tokens [1, 1, 2].
SPECIAL_TOKENS = dict(max_tokens=8, temperature=0, allowed_token_ids=[1, 2], min_tokens=2)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_skip_special_tokens_false_keeps_them_in_the_text_but_not_the_eos(client, offline, stream):
    kept = offline.generate("Hi", SamplingParams(**SPECIAL_TOKENS, logit_bias={2: 100}, skip_special_tokens=False))[0]
    skipped = offline.generate("Hi", SamplingParams(**SPECIAL_TOKENS, logit_bias={2: 100}))[0]
    assert kept.token_ids == skipped.token_ids == [1, 1, 2] and kept.finish_reason == "stop"
    assert (kept.text, skipped.text) == ("<|im_start|><|im_start|>", "")
    fields = dict(model=MODEL, max_tokens=8, temperature=0, logit_bias={"2": 100},
                  extra_body={"allowed_token_ids": [1, 2], "min_tokens": 2, "skip_special_tokens": False})
    if stream:
        text = "".join(chunk.choices[0].text for chunk in client.completions.create(prompt="Hi", stream=True, **fields) if chunk.choices)
        chunks = client.chat.completions.create(messages=QUESTION, stream=True, **fields)
        content = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    else:
        text = client.completions.create(prompt="Hi", **fields).choices[0].text
        content = client.chat.completions.create(messages=QUESTION, **fields).choices[0].message.content
    assert text == content == kept.text



def sse_events(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("n", [1, 2])
def test_return_token_ids_gives_the_prompt_and_output_ids_as_vllm_places_them(server, offline, n):
    """Completions: on each choice; chat: the prompt's on the response (the first chunk), the
    output's on each choice (each chunk's new ones). Streamed ids add up to the whole answer's."""
    prompt = "The capital of France is"
    prompt_ids = offline.generate(prompt, SamplingParams(max_tokens=1))[0].prompt_token_ids
    seeded = dict(max_tokens=12, temperature=0.8, seed=7, n=n, return_token_ids=True)
    expected = [offline.generate(prompt, SamplingParams(max_tokens=12, temperature=0.8, seed=7 + j))[0].token_ids for j in range(n)]
    url = f"{server.url}/v1/completions"
    whole = httpx.post(url, json={"prompt": prompt, **seeded}, timeout=60).json()
    assert [choice["token_ids"] for choice in whole["choices"]] == expected
    assert [choice["prompt_token_ids"] for choice in whole["choices"]] == [prompt_ids] * n
    events = sse_events(url, {"prompt": prompt, **seeded, "stream": True})
    streamed, prompts_sent = [[] for _ in range(n)], [[] for _ in range(n)]
    for event in events:
        for choice in event["choices"]:
            streamed[choice["index"]] += choice["token_ids"]
            if "prompt_token_ids" in choice:
                prompts_sent[choice["index"]].append(choice["prompt_token_ids"])
    assert streamed == expected and prompts_sent == [[prompt_ids]] * n

    chat_prompt = offline.chat_prompt(QUESTION[0]["content"])
    expected = [offline.generate(chat_prompt, SamplingParams(max_tokens=12, temperature=0.8, seed=7 + j))[0].token_ids for j in range(n)]
    url = f"{server.url}/v1/chat/completions"
    whole = httpx.post(url, json={"messages": QUESTION, **seeded}, timeout=60).json()
    assert whole["prompt_token_ids"] == chat_prompt
    assert [choice["token_ids"] for choice in whole["choices"]] == expected
    events = sse_events(url, {"messages": QUESTION, **seeded, "stream": True})
    assert events[0]["prompt_token_ids"] == chat_prompt and all("prompt_token_ids" not in event for event in events[1:])
    streamed = [[] for _ in range(n)]
    for event in events:
        for choice in event["choices"]:
            streamed[choice["index"]] += choice.get("token_ids", [])
    assert streamed == expected


def test_without_return_token_ids_no_ids_are_sent(server):
    for route, ask in (("completions", {"prompt": "Hi"}), ("chat/completions", {"messages": QUESTION})):
        for flag in ({}, {"return_token_ids": None}, {"return_token_ids": False}):
            body = httpx.post(f"{server.url}/v1/{route}", json={**ask, "max_tokens": 3, **flag}, timeout=60).json()
            assert "prompt_token_ids" not in body and all("token_ids" not in choice for choice in body["choices"])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_include_stop_str_in_output_keeps_the_stop_string(client, offline, stream):
    full, _ = text_of(offline, "One", max_tokens=16, temperature=0, ignore_eos=True)
    stop = full.split()[2]  # a word the model writes
    before = full[: full.index(stop)]
    for include, expected in ((False, before), (True, before + stop)):
        kwargs = dict(model=MODEL, prompt="One", max_tokens=16, temperature=0, stop=[stop],
                      extra_body={"ignore_eos": True, "include_stop_str_in_output": include})
        if stream:
            text = "".join(chunk.choices[0].text for chunk in client.completions.create(stream=True, **kwargs) if chunk.choices)
        else:
            text = client.completions.create(**kwargs).choices[0].text
        assert text == expected
