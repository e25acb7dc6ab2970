"""`graphrt serve --speculative-config` as a user starts it, through the openai client, with each
drafter: the same greedy text as without speculation (stop strings included), and the drafts
counted in /metrics."""

from __future__ import annotations

import json
import re
import signal

import pytest

for package in ("fastapi", "uvicorn", "httpx", "openai"):  # the server stack: not on every GPU image
    pytest.importorskip(package)

import httpx  # noqa: E402
import openai  # noqa: E402

from graphrt import LLM, SamplingParams  # noqa: E402
from graphrt.model.config import ModelConfig  # noqa: E402
from graphrt.tools.synthetic import make_tiny_model  # noqa: E402
from helpers import API_KEY, start_server  # noqa: E402

pytestmark = pytest.mark.slow

# A copy-heavy request, the kind prompt lookup is for: the answer repeats the code it was given. (Asked
# to rename the function instead, the model rewrote most of it: 1 of 14 drafts kept, so whether any
# was kept hung on where the adaptive pauses fell.)
CODE = "def area(width, height):\n    result = width * height\n    return result\n"
MESSAGE = f"Here is a Python function:\n\n{CODE}\nRepeat it exactly."
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def metric(text: str, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert found, f"{name} is not in /metrics"
    return float(found.group(1))


@pytest.fixture(scope="module")
def texts_without_speculation(default_model) -> tuple[str, str]:
    """The greedy answer to MESSAGE without speculation, whole and cut at the stop string "height"
    (the same for every drafter: computed once for the module)."""
    llm = LLM(model=default_model, dtype="float32", max_model_len=512)
    prompt = llm.chat_prompt(MESSAGE)
    want = llm.generate(prompt, SamplingParams(max_tokens=80, temperature=0))[0].text
    want_stopped = llm.generate(prompt, SamplingParams(max_tokens=80, temperature=0, stop=["height"]))[0].text
    llm.engine.close()
    assert "width * height" in want, "the reference answer should reuse the code"
    return want, want_stopped


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_serve_with_speculation_gives_the_text_without_it(default_model, texts_without_speculation, method, tmp_path):
    """draft_model: a one-layer random model with the default model's vocabulary, cheap enough for
    its guesses to pay (no trained smaller model with SmolLM2's tokenizer is at hand); its drafts
    are mostly rejected, and the text must not change."""
    speculative = SPECULATIVE
    if method == "draft_model":
        vocab = ModelConfig.from_dir(default_model).vocab_size
        draft = make_tiny_model(tmp_path / "draft", "llama-gqa-tied", num_layers=1, overrides={"vocab_size": vocab})
        speculative = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4}
    want, want_stopped = texts_without_speculation

    proc, url, _ = start_server(extra_args=("--dtype", "float32", "--speculative-config", json.dumps(speculative)))
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
        messages = [{"role": "user", "content": MESSAGE}]
        stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=80, temperature=0, stream=True)
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert streamed == want
        stopped = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=80, temperature=0, stop=["height"])
        assert stopped.choices[0].message.content == want_stopped and stopped.choices[0].finish_reason == "stop"
        metrics = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
        drafts = metric(metrics, "graphrt_spec_decode_num_draft_tokens_total")
        accepted = metric(metrics, "graphrt_spec_decode_num_accepted_tokens_total")
        assert metric(metrics, "graphrt_spec_decode_num_drafts_total") > 0 and 0 <= accepted <= drafts
        if method == "ngram":  # the answer copies the question's code, which prompt lookup finds
            assert accepted > 0
            assert metric(metrics, 'graphrt_spec_decode_num_accepted_tokens_per_pos_total{position="0"}') > 0
            # A request with logprobs drafts too, and each token it keeps comes with its logprob.
            stream = client.chat.completions.create(
                model="SmolLM2-135M-Instruct", messages=messages, max_tokens=80, temperature=0, stream=True,
                logprobs=True, top_logprobs=2,
            )
            chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
            scored = [entry for choice in chunks if choice.logprobs for entry in choice.logprobs.content]
            assert "".join(choice.delta.content or "" for choice in chunks) == want
            assert "".join(entry.token for entry in scored).removesuffix("<|im_end|>") == want  # the stop token is scored too
            assert all(entry.logprob <= 0 and len(entry.top_logprobs) == 2 for entry in scored)
            metrics = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
            assert metric(metrics, "graphrt_spec_decode_num_accepted_tokens_total") > accepted
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
