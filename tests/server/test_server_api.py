"""`graphrt serve` through the real openai client: chat and completions, streamed and not, usage,
choices, stop strings, models, metrics and the API key. One server per engine mode, on a free port
(shared with the other modules that only ask it questions: conftest.py's default_model_server)."""

from __future__ import annotations

import time

import pytest

for package in ("fastapi", "uvicorn", "openai", "httpx"):  # the server stack: not on every GPU image
    pytest.importorskip(package)

import httpx  # noqa: E402
import openai  # noqa: E402

from graphrt.frontend.tokenizer import Tokenizer  # noqa: E402
from helpers import SERVED_API_KEY  # noqa: E402

pytestmark = pytest.mark.slow

API_KEY = SERVED_API_KEY
MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(default_model_server):
    # float32 (helpers.serve_default_model): choice i must equal a single request with seed + i, which
    # needs the batch's numbers to be the single request's (bfloat16, the CPU default where it is
    # fast, is further from that). Each engine mode; the server is shared with other modules.
    return default_model_server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(default_model) -> Tokenizer:
    return Tokenizer.from_dir(default_model)  # the test's own copy: the server's belongs to its engine thread


def stream_text(chunks, chat: bool) -> tuple[str, str | None, object]:
    """Joined text, finish reason and usage of a one-choice stream."""
    text, finish_reason, usage = "", None, None
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += (choice.delta.content or "") if chat else choice.text
            finish_reason = choice.finish_reason or finish_reason
    return text, finish_reason, usage


def test_chat_greedy_answer_and_usage(client, tokenizer):
    out = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=32, temperature=0)
    assert out.object == "chat.completion" and out.model == MODEL
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == "The capital of France is Paris."
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.prompt_tokens == len(tokenizer.encode_chat(QUESTION))
    # the EOS token counts as generated; the text does not show it
    assert out.usage.completion_tokens == len(tokenizer.encode(out.choices[0].message.content)) + 1
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_completion_length_and_usage(client, tokenizer):
    prompt = "Once upon a time"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert out.object == "text_completion"
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert out.usage.completion_tokens == 8
    assert len(tokenizer.encode(out.choices[0].text)) in range(6, 11)  # re-tokenizing may merge or split a token


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_greedy_stream_equals_non_stream(client, chat):
    if chat:
        args = dict(model=MODEL, messages=[{"role": "user", "content": "Write a haiku about the sea."}], max_tokens=40, temperature=0)
        whole = client.chat.completions.create(**args)
        whole_text = whole.choices[0].message.content
        chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    else:
        args = dict(model=MODEL, prompt="The three largest cities in Europe are", max_tokens=40, temperature=0)
        whole = client.completions.create(**args)
        whole_text = whole.choices[0].text
        chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    text, finish_reason, usage = stream_text(chunks, chat)
    assert len(whole_text) > 20
    assert text == whole_text
    assert finish_reason == whole.choices[0].finish_reason
    assert usage.model_dump() == whole.usage.model_dump()
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
    assert len(chunks) > 5  # it really streamed


def test_stream_without_usage_has_none(client):
    chunks = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0, stream=True))
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_stop_string_cuts_the_text(client, stream):
    # greedy answer: "The capital of France is Paris."; a stop string spanning tokens must never
    # leak its first characters ("France") into the stream before the rest shows it is a stop
    args = dict(model=MODEL, messages=QUESTION, max_tokens=32, temperature=0, stop=["France is", "nowhere"])
    if stream:
        text, finish_reason, _ = stream_text(client.chat.completions.create(**args, stream=True), chat=True)
    else:
        out = client.chat.completions.create(**args)
        text, finish_reason = out.choices[0].message.content, out.choices[0].finish_reason
    assert text == "The capital of "
    assert finish_reason == "stop"


def test_stream_never_sends_half_a_character(client):
    # greedy, this prompt gives emoji, whose bytes span several tokens: intermediate decodes end
    # in U+FFFD, which a stream must hold back until the character is complete
    args = dict(model=MODEL, prompt="Emojis: \U0001F600\U0001F603\U0001F604", max_tokens=12, temperature=0)
    whole = client.completions.create(**args).choices[0].text
    deltas = [c.choices[0].text for c in client.completions.create(**args, stream=True)]
    assert len(whole) >= 3 and "\ufffd" not in whole
    assert "".join(deltas) == whole
    assert not any("\ufffd" in d for d in deltas)


def test_n_choices_with_seed(client, tokenizer):
    args = dict(model=MODEL, prompt="My favourite colour is", max_tokens=6, temperature=1.0, extra_body={"ignore_eos": True})
    out = client.completions.create(**args, n=3, seed=7)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert out.usage.prompt_tokens == len(tokenizer.encode("My favourite colour is"))
    assert out.usage.completion_tokens == 3 * 6
    # choice i draws from seed + i, so each equals a single request with that seed
    singles = [client.completions.create(**args, seed=7 + i).choices[0].text for i in range(3)]
    assert [c.text for c in out.choices] == singles
    assert len(set(singles)) > 1


def test_n_choices_stream(client):
    chunks = list(client.completions.create(
        model=MODEL, prompt="Colours:", max_tokens=5, temperature=1.0, seed=1, n=2, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ))
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    whole = client.completions.create(model=MODEL, prompt="Colours:", max_tokens=5, temperature=1.0, seed=1, n=2, extra_body={"ignore_eos": True})
    assert [texts[0], texts[1]] == [c.text for c in whole.choices]
    assert chunks[-1].usage.completion_tokens == 10


def test_prompt_forms_agree(client, tokenizer):
    prompt = "The sun rises in the"
    args = dict(model=MODEL, max_tokens=6, temperature=0)
    as_text = client.completions.create(prompt=prompt, **args).choices[0].text
    as_ids = client.completions.create(prompt=tokenizer.encode(prompt), **args).choices[0].text
    as_list = client.completions.create(prompt=[prompt], **args).choices[0].text
    assert as_text == as_ids == as_list != ""


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}  # open without the key


def test_api_key_required(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi"}, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise KeyError(name)


def test_tokens_and_time_to_first_token_reach_metrics_while_a_request_runs(client, server):
    """As vLLM counts them each step: a request's tokens and its TTFT showed only once it ended,
    so throughput panels read zero, then one jump, and TTFT alerts lagged by the whole request."""
    before = httpx.get(f"{server.url}/metrics").text
    stream = client.completions.create(model=MODEL, prompt="Tell me a long story.", max_tokens=1000, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    seen = sum(1 for _, chunk in zip(range(10), stream) if chunk.choices)
    during = httpx.get(f"{server.url}/metrics").text
    stream.close()
    # The abort lands before the engine's next step; the tests after this one time the stages from a quiet start.
    busy, deadline = None, time.monotonic() + 30
    while time.monotonic() < deadline:
        now = httpx.get(f"{server.url}/metrics").text
        if metric(now, "graphrt_requests_running") == 0 and metric(now, 'graphrt_stage_busy_seconds_total{stage="0"}') == busy:
            break
        busy = metric(now, 'graphrt_stage_busy_seconds_total{stage="0"}')
        time.sleep(0.2)
    assert seen == 10
    counted = metric(during, "graphrt_generation_tokens_total") - metric(before, "graphrt_generation_tokens_total")
    assert 10 <= counted < 1000  # what came so far, not yet all
    assert metric(during, "graphrt_time_to_first_token_seconds_count") == metric(before, "graphrt_time_to_first_token_seconds_count") + 1


def test_metrics(client, server):
    before = httpx.get(f"{server.url}/metrics").text
    started = time.perf_counter()
    client.completions.create(model=MODEL, prompt="One two three", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    wall = time.perf_counter() - started
    after = httpx.get(f"{server.url}/metrics").text
    busy = metric(after, 'graphrt_stage_busy_seconds_total{stage="0"}') - metric(before, 'graphrt_stage_busy_seconds_total{stage="0"}')
    assert 0 < busy <= wall  # the stage worked on this request, and not longer than it took
    assert metric(after, 'graphrt_requests_total{outcome="length"}') == metric(before, 'graphrt_requests_total{outcome="length"}') + 1
    assert metric(after, "graphrt_generation_tokens_total") == metric(before, "graphrt_generation_tokens_total") + 5
    assert metric(after, "graphrt_prompt_tokens_total") > metric(before, "graphrt_prompt_tokens_total")
    assert metric(after, "graphrt_time_to_first_token_seconds_count") == metric(before, "graphrt_time_to_first_token_seconds_count") + 1
    assert metric(after, "graphrt_time_per_output_token_seconds_count") == metric(before, "graphrt_time_per_output_token_seconds_count") + 1
    e2e = metric(after, "graphrt_e2e_request_latency_seconds_sum") - metric(before, "graphrt_e2e_request_latency_seconds_sum")
    assert metric(after, "graphrt_e2e_request_latency_seconds_count") == metric(before, "graphrt_e2e_request_latency_seconds_count") + 1
    assert 0 < e2e <= wall
    assert metric(after, "graphrt_kv_blocks_used") == 0 and metric(after, "graphrt_kv_blocks_free") > 0
    assert metric(after, "graphrt_requests_running") == metric(after, "graphrt_requests_waiting") == 0
    assert metric(after, "graphrt_eager_fallbacks_total") == 0
    # The same figures under vLLM's names, for its dashboards.
    label = f'model_name="{MODEL}"'
    for graphrt_name, vllm_name in (
        ("graphrt_requests_running", "vllm:num_requests_running"), ("graphrt_requests_waiting", "vllm:num_requests_waiting"),
        ("graphrt_generation_tokens_total", "vllm:generation_tokens_total"), ("graphrt_prompt_tokens_total", "vllm:prompt_tokens_total"),
        ("graphrt_time_to_first_token_seconds_count", "vllm:time_to_first_token_seconds_count"),
        ("graphrt_prefix_cache_hits_total", "vllm:prefix_cache_hits_total"),
        ("graphrt_e2e_request_latency_seconds_count", "vllm:e2e_request_latency_seconds_count"),
    ):
        assert metric(after, f"{vllm_name}{{{label}}}") == metric(after, graphrt_name), vllm_name
    assert metric(after, f'vllm:time_to_first_token_seconds_bucket{{le="+Inf",{label}}}') == metric(after, "graphrt_time_to_first_token_seconds_count")
    assert metric(after, f'vllm:request_success_total{{finished_reason="length",{label}}}') == metric(after, 'graphrt_requests_total{outcome="length"}')
    assert metric(after, f"vllm:gpu_cache_usage_perc{{{label}}}") == metric(after, f"vllm:kv_cache_usage_perc{{{label}}}") == 0
    assert metric(after, f"vllm:kv_cache_usage_perc{{{label}}}") == 0.0


def test_tokenize_counts_what_the_routes_feed_the_model_and_detokenize_spells_it_back(client, server, tokenizer):
    """vLLM's /tokenize and /detokenize: a client counts a prompt's tokens before sending it."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    prompt = "The capital of France is"
    counted = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": prompt}, headers=headers).json()
    assert counted["tokens"] == tokenizer.encode(prompt) and counted["count"] == len(counted["tokens"])
    assert counted["max_model_len"] == client.models.retrieve(MODEL).model_extra["max_model_len"]
    assert client.completions.create(model=MODEL, prompt=prompt, max_tokens=1).usage.prompt_tokens == counted["count"]
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": QUESTION}, headers=headers).json()
    assert chat["tokens"] == tokenizer.encode_chat(QUESTION)
    assert client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1).usage.prompt_tokens == chat["count"]
    spelled = httpx.post(f"{server.url}/detokenize", json={"tokens": chat["tokens"]}, headers=headers).json()["prompt"]
    assert spelled.startswith("<|im_start|>system") and QUESTION[0]["content"] in spelled  # special tokens spelled, as vLLM's
    pieces = httpx.post(f"{server.url}/tokenize", json={"prompt": prompt, "return_token_strs": True}, headers=headers).json()
    assert pieces["token_strs"] == ["The", "Ġcapital", "Ġof", "ĠFrance", "Ġis"] and pieces["tokens"] == counted["tokens"]
    transcript = httpx.post(f"{server.url}/tokenize", json={"messages": QUESTION, "add_generation_prompt": False}, headers=headers).json()
    assert chat["tokens"][: transcript["count"]] == transcript["tokens"] and transcript["count"] < chat["count"]
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_chat_continues_the_final_message_when_asked(client, server, tokenizer):
    """vLLM's and SGLang's continue_final_message: the prompt ends inside the assistant's message
    (as /tokenize renders it with the same fields), and the reply is what follows it."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    partial = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]
    fields = {"continue_final_message": True, "add_generation_prompt": False}
    counted = httpx.post(f"{server.url}/tokenize", json={"messages": partial, **fields}, headers=headers).json()
    assert tokenizer.decode(counted["tokens"]).endswith("\nassistant\nThe capital of France is")  # no end of turn after it
    answer = client.chat.completions.create(model=MODEL, messages=partial, max_tokens=4, temperature=0, extra_body=fields)
    assert answer.usage.prompt_tokens == counted["count"]
    assert answer.choices[0].message.content.startswith(" Paris")  # continues the sentence; a new turn would start it anew


@pytest.mark.parametrize(
    "route, body, message",
    [
        ("/tokenize", {}, "give exactly one of prompt (text) and messages (a conversation)"),
        ("/tokenize", {"prompt": "a", "messages": QUESTION}, "give exactly one of prompt"),
        ("/tokenize", {"prompt": "a", "tools": []}, "tools go with messages"),
        ("/tokenize", {"prompt": "a", "continue_final_message": True}, "continue_final_message and chat_template_kwargs go with messages"),
        ("/tokenize", {"prompt": "a", "chat_template": "{{ x }}"}, "unrecognized request argument: chat_template"),
        ("/tokenize", {"prompt": "a", "model": "gpt-4"}, "model 'gpt-4' does not exist"),
        ("/detokenize", {"tokens": [1, -1]}, "tokens: -1 is outside the tokenizer's vocabulary [0, 49152)"),
        ("/detokenize", {"tokens": "1 2"}, "tokens: Input should be a valid list"),
    ],
)
def test_tokenize_and_detokenize_refuse_what_they_cannot_answer(server, route, body, message):
    answer = httpx.post(f"{server.url}{route}", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert answer.status_code in (400, 404) and message in answer.json()["error"]["message"], answer.text
    assert httpx.post(f"{server.url}{route}", json=body).status_code == 401  # the key is asked for first


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client):
    """vLLM's stream_options.continuous_usage_stats: each chunk counts the tokens sent so far."""
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [chunk.usage.completion_tokens for chunk in chunks]
    assert counts == sorted(counts) and counts[-1] == 5 and len(set(counts)) > 1
    assert all(chunk.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for chunk in chunks)


def test_an_unknown_route_names_the_served_ones(server):
    answer = httpx.post(f"{server.url}/v1/embeddings", json={"input": "a"}, headers={"Authorization": f"Bearer {API_KEY}"})
    assert answer.status_code == 404
    message = answer.json()["error"]["message"]
    assert message.startswith("POST /v1/embeddings: Not Found; this server answers DELETE /v1/responses/{response_id:path}; GET ")
    assert "POST /v1/completions, /v1/chat/completions, /v1/responses," in message and "/flush_cache" in message


def test_the_prefix_cache_is_flushed_when_idle_and_refused_while_busy(client, server):
    """vLLM's POST /reset_prefix_cache and SGLang's POST /flush_cache: a prompt seen before is a
    prefix-cache hit, and after a flush it is computed again. While a request runs, the flush is
    refused and the request goes on."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    prompt = "Count with me, slowly and carefully, from one up to one hundred: one, two, three, four, five,"  # over two KV blocks

    def hits_after_asking() -> float:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
        return metric(httpx.get(f"{server.url}/metrics").text, "graphrt_prefix_cache_hits_total")

    assert httpx.post(f"{server.url}/flush_cache", headers=headers).json() == {"status": "flushed"}
    first = hits_after_asking()
    again = hits_after_asking()
    assert again > first  # the second time is a hit
    assert httpx.post(f"{server.url}/reset_prefix_cache", headers=headers).status_code == 200
    assert hits_after_asking() == again  # computed afresh
    assert httpx.post(f"{server.url}/flush_cache").status_code == 401
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=64, stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))  # running in the engine now
    busy = httpx.post(f"{server.url}/flush_cache", headers=headers)
    assert busy.status_code == 400 and "flushed only while the engine is idle" in busy.json()["error"]["message"]
    assert sum(1 for _ in stream) > 0  # the request went on


def test_chat_choices_say_what_stopped_them(client):
    """vLLM's stop_reason: the stop string, whole and streamed; none for EOS, even listed in stop_token_ids."""
    answer = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=32, temperature=0, stop=[" Paris"])
    assert answer.choices[0].finish_reason == "stop" and answer.choices[0].model_extra["stop_reason"] == " Paris"
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=32, temperature=0, stop=[" Paris"], stream=True))
    assert [c.choices[0].model_extra.get("stop_reason") for c in chunks if c.choices and c.choices[0].finish_reason] == [" Paris"]
    ended = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=32, temperature=0, extra_body={"stop_token_ids": [2]})
    assert ended.choices[0].finish_reason == "stop" and ended.choices[0].model_extra["stop_reason"] is None  # 2 is EOS, <|im_end|>
