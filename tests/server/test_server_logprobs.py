"""Logprobs, echo and batched prompts through `graphrt serve` and the real openai client: the
numbers equal transformers' log_softmax (float32, to 1e-4), streamed equals not streamed, choices
are numbered prompt by prompt."""

from __future__ import annotations

import re

import pytest

for package in ("fastapi", "uvicorn", "openai", "httpx"):  # the server stack: not on every GPU image
    pytest.importorskip(package)

import openai  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from graphrt.frontend.tokenizer import Tokenizer  # noqa: E402
from helpers import SERVED_API_KEY  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"  # the served name: the model folder's
PROMPTS = ["The capital of France is", "Water boils at a temperature of"]
ATOL = 1e-4


@pytest.fixture(scope="module")
def client(default_model_server) -> openai.OpenAI:
    """The default model's server in float32, in each engine mode (conftest.py)."""
    return openai.OpenAI(base_url=f"{default_model_server.url}/v1", api_key=SERVED_API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(default_model) -> Tokenizer:
    return Tokenizer.from_dir(default_model)


@pytest.fixture(scope="module")
def reference(default_model):
    """log_softmax of transformers' logits for a token sequence (row p scores token p + 1)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32)

    def logprobs(token_ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([token_ids])).logits[0].float(), dim=-1)

    return logprobs


def greedy_ids(reference, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """transformers' greedy continuation: the token ids the server's text stands for."""
    ids = list(prompt_ids)
    for _ in range(num_tokens):
        ids.append(int(reference(ids)[-1].argmax()))
    return ids


def test_echo_with_logprobs_scores_prompt_and_completion(client, tokenizer, reference):
    """What lm-eval's loglikelihood tasks send: token-id prompts in a batch, echo, logprobs, greedy."""
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    response = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0, logprobs=3, echo=True, n=2)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert response.usage.prompt_tokens == sum(map(len, prompts))
    assert response.usage.completion_tokens == 4 * 4
    for choice in response.choices:
        prompt_ids = prompts[choice.index // 2]  # prompt-major: prompt 0's two choices, then prompt 1's
        logprobs = choice.logprobs
        assert choice.text.startswith(tokenizer.decode(prompt_ids))
        assert len(logprobs.tokens) == len(prompt_ids) + 4
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        # the token strings spell the text, and text_offset says where each one starts
        assert "".join(logprobs.tokens) == choice.text
        assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]
        ids = greedy_ids(reference, prompt_ids, 4)
        assert logprobs.tokens == [tokenizer.decode_token(t) for t in ids]
        rows = reference(ids)
        for position in range(1, len(ids)):
            row = rows[position - 1]
            assert abs(logprobs.token_logprobs[position] - row[ids[position]].item()) <= ATOL, position
            top = logprobs.top_logprobs[position]
            best = row.topk(3)
            names = [tokenizer.decode_token(t) for t in best.indices.tolist()]
            # the three most likely tokens, plus the token itself when it is not among them
            assert set(top) == set(names) | {logprobs.tokens[position]}
            for name, value in zip(names, best.values.tolist()):
                assert abs(top[name] - value) <= ATOL


def test_completion_logprobs_stream_equals_non_stream(client):
    kwargs = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=2)
    whole = client.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kwargs) if c.choices]
    streamed = [lp for chunk in chunks if chunk.logprobs for lp in chunk.logprobs.token_logprobs]
    assert "".join(c.text for c in chunks) == whole.text
    assert streamed == pytest.approx(whole.logprobs.token_logprobs, abs=ATOL)  # a prefix-cache hit: see below
    assert [o for c in chunks if c.logprobs for o in c.logprobs.text_offset] == whole.logprobs.text_offset


def test_chat_logprobs_equal_transformers_streamed_or_not(client, tokenizer, reference):
    messages = [{"role": "user", "content": "Name a color."}]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**kwargs).choices[0]
    content = whole.logprobs.content
    prompt_ids = tokenizer.encode_chat(messages)
    output_ids = greedy_ids(reference, prompt_ids, len(content))[len(prompt_ids):]
    assert [t.token for t in content] == [tokenizer.decode_token(t) for t in output_ids]
    assert "".join(t.token for t in content) == whole.message.content
    rows = reference(prompt_ids + output_ids)
    for i, token in enumerate(content):
        row = rows[len(prompt_ids) + i - 1]
        assert abs(token.logprob - row[output_ids[i]].item()) <= ATOL
        assert token.bytes == list(token.token.encode("utf-8"))
        best = row.topk(2)
        assert [t.token for t in token.top_logprobs] == [tokenizer.decode_token(t) for t in best.indices.tolist()]
    streamed = [t for c in client.chat.completions.create(stream=True, **kwargs) if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]
    # The second request finds the prompt's blocks in the prefix cache and computes only the rest,
    # in matmuls of other shapes: the same numbers to float32 rounding, not bit for bit.
    assert [t.token for t in streamed] == [t.token for t in content]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(streamed, content)) <= ATOL


def test_without_logprobs_there_are_none(client):
    completion = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=3, temperature=0)
    assert [c.logprobs for c in completion.choices] == [None, None]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert chat.choices[0].logprobs is None


def test_batched_prompts_answer_as_single_requests(client):
    """Each prompt of a batch gets what it gets alone; streamed, each choice keeps its own text."""
    single = [client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0).choices[0].text for p in PROMPTS]
    batched = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=8, temperature=0)
    assert [c.text for c in sorted(batched.choices, key=lambda c: c.index)] == single
    texts = ["", ""]
    for chunk in client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=8, temperature=0, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == single


def test_echo_without_logprobs_prefixes_the_prompt(client):
    plain = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=5, temperature=0).choices[0]
    echoed = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=5, temperature=0, echo=True).choices[0]
    assert echoed.text == PROMPTS[1] + plain.text and echoed.logprobs is None


def check_prompt_logprobs(entries: list, prompt_ids: list[int], reference, tokenizer, num_top: int) -> None:
    """vLLM's shape: null first, then per prompt token {id: {logprob, rank, decoded_token}}, the token
    itself first, then its num_top most likely alternatives ranked 1, 2, ..."""
    assert len(entries) == len(prompt_ids) and entries[0] is None
    rows = reference(prompt_ids)
    for position in range(1, len(prompt_ids)):
        row, token = rows[position - 1], prompt_ids[position]
        entry = entries[position]
        first_key, first = next(iter(entry.items()))
        assert first_key == str(token) and first["decoded_token"] == tokenizer.decode_token(token)
        assert abs(first["logprob"] - row[token].item()) <= ATOL
        assert (row > row[token] + ATOL).sum().item() + 1 <= first["rank"] <= (row > row[token] - ATOL).sum().item()
        best = row.topk(num_top)
        assert set(entry) == {str(t) for t in best.indices.tolist()} | {str(token)}
        for rank, (alt, value) in enumerate(zip(best.indices.tolist(), best.values.tolist()), start=1):
            if alt != token:
                assert entry[str(alt)]["rank"] == rank and abs(entry[str(alt)]["logprob"] - value) <= ATOL


def test_prompt_logprobs_as_vllm_reports_them(client, tokenizer, reference):
    """vLLM's prompt_logprobs: on each completion choice, beside echo's own logprobs (which list only
    as many alternatives as logprobs asks); on a chat response once, for its templated prompt."""
    prompt_ids = tokenizer.encode(PROMPTS[1])
    completion = client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=2, temperature=0, echo=True, logprobs=1, extra_body={"prompt_logprobs": 3},
    )
    choice = completion.choices[0]
    check_prompt_logprobs(choice.model_extra["prompt_logprobs"], prompt_ids, reference, tokenizer, 3)
    assert all(top is None or len(top) <= 2 for top in choice.logprobs.top_logprobs)  # echo's: the token and 1 alternative
    messages = [{"role": "user", "content": "Name a color."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_body={"prompt_logprobs": 0})
    check_prompt_logprobs(chat.model_extra["prompt_logprobs"], tokenizer.encode_chat(messages), reference, tokenizer, 0)
    assert chat.choices[0].logprobs is None  # nothing asked of the output
    plain = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=2)
    assert "prompt_logprobs" not in (plain.choices[0].model_extra or {})


@pytest.mark.parametrize("body, message", [
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs are not available with stream: true"),
    ({"prompt_logprobs": -1}, "-1 (every token of the vocabulary) is not served"),
    ({"prompt_logprobs": 21}, "must be in [0, 20]"),
])
def test_prompt_logprobs_that_cannot_be_served_say_why(client, body, message):
    with pytest.raises(openai.BadRequestError, match=re.escape(message)):
        client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2, extra_body=body)
