"""SGLang's native API on `graphrt serve`: /generate answers what /v1/completions answers for the
same prompt and sampling, in SGLang's shapes (one object or a list, `meta_info`, streamed as the
whole output so far), with logprobs as SGLang's triples; /health_generate, /get_model_info and
/get_server_info; bad requests named in the request's own terms. One server per engine mode."""

from __future__ import annotations

import json

import pytest

for package in ("fastapi", "uvicorn", "openai", "httpx"):  # the server stack: not on every GPU image
    pytest.importorskip(package)

import httpx  # noqa: E402
import openai  # noqa: E402

from helpers import SERVED_API_KEY  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
HEADERS = {"Authorization": f"Bearer {SERVED_API_KEY}"}
PROMPTS = ["The capital of France is", "1, 2, 3,"]


@pytest.fixture(scope="module")
def server(default_model_server):
    return default_model_server  # float32, each engine mode (helpers.serve_default_model)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=SERVED_API_KEY, max_retries=0)


def generate(server, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/generate", json=body, headers=HEADERS, timeout=120)


def test_generate_answers_what_completions_answers_in_sglangs_shape(server, client):
    answer = generate(server, text=PROMPTS[0], sampling_params={"max_new_tokens": 6, "temperature": 0}).json()
    expected = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, extra_body={"return_token_ids": True})
    assert answer["text"] == expected.choices[0].text and answer["output_ids"] == expected.choices[0].model_extra["token_ids"]
    meta = answer["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (expected.usage.prompt_tokens, 6)
    assert isinstance(meta["id"], str) and meta["e2e_latency"] > 0
    by_ids = generate(server, input_ids=expected.choices[0].model_extra["prompt_token_ids"], sampling_params={"max_new_tokens": 6, "temperature": 0})
    assert by_ids.json()["text"] == answer["text"]


def test_a_batch_of_prompts_answers_a_list_in_order(server):
    batch = generate(server, text=PROMPTS, sampling_params={"max_new_tokens": 5, "temperature": 0}, rid=["a", "b"]).json()
    alone = [generate(server, text=prompt, sampling_params={"max_new_tokens": 5, "temperature": 0}).json() for prompt in PROMPTS]
    assert [out["text"] for out in batch] == [out["text"] for out in alone]
    assert [out["meta_info"]["id"] for out in batch] == ["a", "b"]
    assert isinstance(generate(server, text=PROMPTS[:1], sampling_params={"max_new_tokens": 1}).json(), list)  # a list of one is a list


def test_a_stream_sends_the_whole_output_so_far_each_time(server):
    body = {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    whole = generate(server, **body).json()
    with httpx.stream("POST", f"{server.url}/generate", json={**body, "stream": True}, headers=HEADERS, timeout=120) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    texts = [event["text"] for event in events]
    assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:])) and texts[-1] == whole["text"]
    assert [e["meta_info"]["finish_reason"] for e in events[:-1]] == [None] * (len(events) - 1)
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 8} and events[-1]["output_ids"] == whole["output_ids"]


def test_logprobs_are_completions_logprobs_as_sglangs_triples(server, client):
    answer = generate(server, text=PROMPTS[1], sampling_params={"max_new_tokens": 4, "temperature": 0}, return_logprob=True,
                      top_logprobs_num=2, return_text_in_logprobs=True, logprob_start_len=0).json()
    expected = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=4, temperature=0, logprobs=2, echo=True)
    meta, logprobs = answer["meta_info"], expected.choices[0].logprobs
    prompt_tokens = meta["prompt_tokens"]
    assert [text for _, _, text in meta["output_token_logprobs"]] == logprobs.tokens[prompt_tokens:]
    assert [lp for lp, _, _ in meta["output_token_logprobs"]] == pytest.approx(logprobs.token_logprobs[prompt_tokens:], abs=1e-5)
    assert [lp for lp, _, _ in meta["input_token_logprobs"]][1:] == pytest.approx(logprobs.token_logprobs[1:prompt_tokens], abs=1e-5)
    assert meta["input_token_logprobs"][0][0] is None and len(meta["input_token_logprobs"]) == prompt_tokens
    for top, expected_top in zip(meta["output_top_logprobs"], logprobs.top_logprobs[prompt_tokens:]):
        assert {text: lp for lp, _, text in top} == pytest.approx(expected_top, abs=1e-5)
    plain = generate(server, text=PROMPTS[1], sampling_params={"max_new_tokens": 2}, return_logprob=True).json()["meta_info"]
    assert [text for _, _, text in plain["output_token_logprobs"]] == [None, None] and "input_token_logprobs" not in plain


def test_a_stop_says_what_it_matched_here_and_on_completions(server, client):
    """SGLang's finish_reason names the stop string or token; vLLM's stop_reason on completions too."""
    text = generate(server, text=PROMPTS[1], sampling_params={"max_new_tokens": 8, "temperature": 0}).json()["text"]
    stop = text.strip().split()[1]  # the second number it writes
    by_string = generate(server, text=PROMPTS[1], sampling_params={"max_new_tokens": 8, "temperature": 0, "stop": [stop]}).json()
    assert by_string["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop} and stop not in by_string["text"]
    token = by_string["output_ids"][0]
    by_token = generate(server, text=PROMPTS[1], sampling_params={"max_new_tokens": 8, "temperature": 0, "stop_token_ids": [token]}).json()
    assert by_token["meta_info"]["finish_reason"] == {"type": "stop", "matched": token}
    kept = generate(server, text=PROMPTS[1], sampling_params={"max_new_tokens": 8, "temperature": 0, "stop": [stop], "no_stop_trim": True}).json()
    assert kept["text"].endswith(stop)
    completion = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=0, stop=[stop])
    assert completion.choices[0].model_extra["stop_reason"] == stop
    completion = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=0, extra_body={"stop_token_ids": [token]})
    assert completion.choices[0].model_extra["stop_reason"] == token
    assert client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=2).choices[0].model_extra["stop_reason"] is None


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"text": "a", "sampling_params": {"max_new_tokens": 0}}, "sampling_params.max_new_tokens", "greater than or equal to 1"),
    ({"text": "a", "sampling_params": {"max_tokens": 3}}, "sampling_params.max_tokens", "not a sampling parameter served here"),
    ({"text": "a", "sampling_params": {"temperature": "0.5"}}, "sampling_params.temperature", "valid number"),
    ({"text": "a", "sampling_params": {"min_new_tokens": 9, "max_new_tokens": 4}}, "sampling_params.min_new_tokens", "must not exceed sampling_params.max_new_tokens"),
    ({"text": "a", "sampling_params": {"regex": "("}}, "sampling_params.regex", "cannot be used"),
    ({"text": "a", "input_ids": [1]}, "text", "exactly one of text"),
    ({"sampling_params": {}}, "text", "exactly one of text"),
    ({"text": "a", "image_data": "cat.png"}, "image_data", "graphrt serves text-only models"),
    ({"text": "a", "return_logprob": "yes"}, "return_logprob", "boolean"),
    ({"text": "a", "return_logprob": True, "top_logprobs_num": 99}, "top_logprobs_num", "less than or equal to 20"),
    ({"text": "", "sampling_params": {}}, None, "the prompt is empty; give at least one token"),  # found while preparing it
    ({"input_ids": "hello"}, "input_ids", "must be a non-empty list of token ids, or a list of them"),
    ({"text": [1, 2]}, "text", "must be a string or a non-empty list of strings"),
    ({"text": "a", "max_new_tokens": 4}, "max_new_tokens", "put it in sampling_params"),
    ({"text": "a", "sampling_params": "greedy"}, "sampling_params", "must be an object of sampling parameters"),
    ({"text": "a", "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 99}, "top_logprobs_num", "must be in [0, 20]"),
])
def test_bad_generate_requests_are_named_in_the_requests_terms(server, body, param, says):
    answer = generate(server, **body)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param and says in answer.json()["error"]["message"], answer.text


def test_sglangs_nulls_are_not_given(server):
    """SGLang's client sends every unset sampling parameter as null: max_new_tokens is then 128."""
    sampling = {"max_new_tokens": None, "temperature": 0, "ignore_eos": True, "regex": None, "json_schema": None, "ebnf": None, "stop": None}
    answer = generate(server, text=PROMPTS[0], sampling_params=sampling, return_logprob=None, rid=None)
    assert answer.status_code == 200 and answer.json()["meta_info"]["completion_tokens"] == 128, answer.text


def test_each_prompt_may_bring_its_own_sampling_params(server):
    """SGLang's batch form: a list of sampling_params, one per prompt, each prompt answered as it
    would be alone with its own."""
    own = [{"max_new_tokens": 3, "temperature": 0}, {"max_new_tokens": 6, "temperature": 0, "stop": [" "]}]
    batch = generate(server, text=PROMPTS, sampling_params=own).json()
    alone = [generate(server, text=prompt, sampling_params=params).json() for prompt, params in zip(PROMPTS, own)]
    assert [(a["text"], a["output_ids"], a["meta_info"]["finish_reason"]) for a in batch] == [
        (a["text"], a["output_ids"], a["meta_info"]["finish_reason"]) for a in alone]
    assert batch[0]["meta_info"]["completion_tokens"] == 3 and batch[0]["meta_info"]["finish_reason"]["type"] == "length"


def test_per_prompt_sampling_params_with_n_keep_prompt_order_streamed_too(server):
    """Two outputs per prompt: each prompt's pair is what that prompt gets alone with its own
    parameters (its own length), in prompt order; streamed, each event says which output it is."""
    own = [{"max_new_tokens": 3, "temperature": 0, "n": 2}, {"max_new_tokens": 5, "temperature": 0, "n": 2}]
    batch = generate(server, text=PROMPTS, sampling_params=own).json()
    alone = [generate(server, text=[prompt], sampling_params=[params]).json() for prompt, params in zip(PROMPTS, own)]
    assert [a["output_ids"] for a in batch] == [a["output_ids"] for pair in alone for a in pair]
    assert [a["meta_info"]["completion_tokens"] for a in batch] == [3, 3, 5, 5]
    body = {"text": PROMPTS, "sampling_params": own, "stream": True}
    with httpx.stream("POST", f"{server.url}/generate", json=body, headers=HEADERS, timeout=120) as response:
        events = [json.loads(line.removeprefix("data: ")) for line in response.iter_lines() if line and line != "data: [DONE]"]
    last = {event["index"]: event for event in events}
    assert sorted(last) == [0, 1, 2, 3] and [last[i]["output_ids"] for i in range(4)] == [a["output_ids"] for a in batch]


@pytest.mark.parametrize("body, param, says", [
    ({"text": ["a"], "sampling_params": [{"regex": "("}]}, "sampling_params[0].regex", "cannot be used"),  # a list of one: still [0]
    ({"text": "a", "sampling_params": [{"max_new_tokens": 2}]}, "sampling_params", "a list must hold one object per prompt (one prompt), got 1"),
    ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params", "a list must hold one object per prompt (2 prompts), got 1"),
    ({"text": ["a", "b"], "sampling_params": [{}, {"max_new_tokens": 0}]}, "sampling_params[1].max_new_tokens", "greater than or equal to 1"),
    ({"text": ["a", "b"], "sampling_params": [{}, {"max_tokens": 3}]}, "sampling_params[1].max_tokens", "not a sampling parameter served here"),
    ({"text": ["a", "b"], "sampling_params": [{}, 7]}, "sampling_params[1]", "must be an object of sampling parameters"),
    ({"text": ["a", "b"], "sampling_params": [{}, {"min_new_tokens": 9, "max_new_tokens": 4}]}, "sampling_params[1].min_new_tokens",
     "must not exceed sampling_params[1].max_new_tokens"),
    ({"text": ["a", "b"], "sampling_params": [{"regex": "("}, {}]}, "sampling_params[0].regex", "cannot be used"),
    ({"text": ["a", "b"], "sampling_params": [{"n": 2}, {}]}, "sampling_params", "n must be the same for every prompt"),
])
def test_a_list_of_sampling_params_is_checked_prompt_by_prompt(server, body, param, says):
    answer = generate(server, **body)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param and says in answer.json()["error"]["message"], answer.text


def test_health_generate_and_model_info(server, client):
    requests_before = metric_of(httpx.get(f"{server.url}/metrics").text, "graphrt_requests_total")
    assert httpx.get(f"{server.url}/health_generate", timeout=60).status_code == 200
    assert metric_of(httpx.get(f"{server.url}/metrics").text, "graphrt_requests_total") == requests_before  # a probe is no request
    info = httpx.get(f"{server.url}/get_model_info", headers=HEADERS).json()
    assert info["model_path"].endswith(MODEL) and info["is_generation"] is True
    assert info["max_model_len"] == client.models.retrieve(MODEL).model_extra["max_model_len"]
    server_info = httpx.get(f"{server.url}/get_server_info", headers=HEADERS).json()
    assert server_info["served_model_name"] == MODEL and server_info["version"]
    assert httpx.get(f"{server.url}/get_model_info").status_code == 401  # behind the key, as the API is


def metric_of(text: str, name: str) -> float:
    """The sum of a metric's samples over its labels."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{") or line.startswith(name + " "))


def test_a_stream_with_logprobs_ends_with_the_whole_outputs_logprobs(server):
    body = {"text": PROMPTS[1], "sampling_params": {"max_new_tokens": 5, "temperature": 0}, "return_logprob": True, "top_logprobs_num": 1}
    whole = generate(server, **body).json()["meta_info"]
    with httpx.stream("POST", f"{server.url}/generate", json={**body, "stream": True}, headers=HEADERS, timeout=120) as response:
        events = [json.loads(line.removeprefix("data: ")) for line in response.iter_lines() if line and line != "data: [DONE]"]
    counts = [len(event["meta_info"]["output_token_logprobs"]) for event in events]
    assert counts == sorted(counts) and counts[-1] == 5  # each event the whole output's so far
    last = events[-1]["meta_info"]
    assert [token for _, token, _ in last["output_token_logprobs"]] == [token for _, token, _ in whole["output_token_logprobs"]]
    assert [lp for lp, _, _ in last["output_token_logprobs"]] == pytest.approx([lp for lp, _, _ in whole["output_token_logprobs"]], abs=1e-5)
