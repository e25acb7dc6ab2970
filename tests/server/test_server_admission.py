"""Preparing a request (chat template, tokenizing, length checks) happens off the engine thread, so
a prompt that takes long to tokenize, or one that is refused, never stalls a running stream; and a
prompt whose length in characters alone proves it too long is refused before it is tokenized."""

from __future__ import annotations

import json
import threading
import time

import pytest

for package in ("fastapi", "uvicorn", "httpx"):  # the server stack: not on every GPU image
    pytest.importorskip(package)

import httpx  # noqa: E402

from graphrt.frontend.tokenizer import Tokenizer  # noqa: E402
from graphrt.llm import LLM  # noqa: E402
from graphrt.server import ServerSettings, ServerThread  # noqa: E402

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 512
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
ENGINE_THREAD = "graphrt-engine"  # the name AsyncEngine gives its thread
WAIT_S = 60  # generous: only a broken server waits this long
# Long enough to outlast the requests sent beside it: they are answered by its 6th token or so, and a
# stream that ended first would fail the test (no tokens while a prompt is held, none after the 400s).
STREAM_TOKENS = 64


class StepCounter:
    """Counts the engine's steps (called on the engine thread)."""

    def __init__(self, engine):
        self.count = 0
        step = engine.step

        def counted():
            self.count += 1
            return step()

        engine.step = counted


@pytest.fixture(scope="module")
def served(default_model):
    llm = LLM(default_model, max_num_seqs=8, max_model_len=MAX_MODEL_LEN)
    engine = llm.engine
    steps = StepCounter(engine)
    with ServerThread(llm, ServerSettings(model_id=engine.model_dir.name)) as running:
        yield running, engine, steps


@pytest.fixture
def tokenizer_calls(served, monkeypatch):
    """Every call into the server's tokenizer that turns text into tokens: (method, thread name).
    A call whose text contains HOLD waits until the test sets `release`."""
    running, engine, _ = served
    tokenizer = running.async_engine.tokenizer
    calls, entered, release = [], threading.Event(), threading.Event()

    def recorded(name):
        method = getattr(tokenizer, name)

        def call(arg, *rest, **options):
            calls.append((name, threading.current_thread().name))
            if "HOLD" in str(arg):
                entered.set()
                release.wait(WAIT_S)
            return method(arg, *rest, **options)

        return call

    for name in ("encode", "encode_chat", "encode_templated", "apply_chat_template"):
        if hasattr(tokenizer, name):
            monkeypatch.setattr(tokenizer, name, recorded(name))
    yield calls, entered, release
    release.set()


class Stream:
    """A long greedy completion streamed on a thread of its own; `num_chunks` grows as tokens arrive."""

    def __init__(self, url: str):
        self.num_chunks = 0
        self.finish_reason: str | None = None
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._read, args=(url,), daemon=True)
        self.thread.start()

    def _read(self, url: str) -> None:
        body = {"prompt": "Tell me a long story about a lighthouse.", "max_tokens": STREAM_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{url}{COMPLETIONS}", json=body, timeout=WAIT_S) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        self.num_chunks += 1
                        self.finish_reason = json.loads(line[6:])["choices"][0]["finish_reason"] or self.finish_reason
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
        finally:
            self.done.set()

    def finished_whole(self) -> bool:
        self.thread.join(WAIT_S)
        return self.error is None and self.finish_reason == "length"

    def wait_for(self, num_chunks: int) -> None:
        deadline = time.monotonic() + WAIT_S
        while self.num_chunks < num_chunks and not self.done.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.num_chunks >= num_chunks, (self.num_chunks, self.error)


def wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def post_in_background(url: str, path: str, body: dict) -> tuple[threading.Thread, list]:
    result: list = []
    thread = threading.Thread(
        target=lambda: result.append(httpx.post(f"{url}{path}", json=body, timeout=WAIT_S)), daemon=True,
    )
    thread.start()
    return thread, result


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_a_prompt_being_tokenized_does_not_stall_a_running_stream(served, tokenizer_calls, path):
    """While a too-long prompt is held inside the tokenizer, the engine keeps stepping and the
    stream keeps receiving tokens; the prompt is then refused with a 400. Had the tokenizer run on
    the engine thread, holding it would have stopped both."""
    server, _, steps = served
    calls, entered, release = tokenizer_calls
    stream = Stream(server.url)
    stream.wait_for(2)
    text = "HOLD " + "word " * 2000  # about 2,000 tokens: few enough characters to be tokenized, then refused
    body = {"prompt": text} if path == COMPLETIONS else {"messages": [{"role": "user", "content": text}]}
    request, response = post_in_background(server.url, path, {**body, "max_tokens": 4})
    try:
        assert entered.wait(WAIT_S), "the prompt never reached the tokenizer"
        steps_then, chunks_then = steps.count, stream.num_chunks
        advanced = wait_until(lambda: steps.count >= steps_then + 5 and stream.num_chunks >= chunks_then + 3, timeout=20)
        assert advanced, f"while a prompt was being tokenized: {steps.count - steps_then} engine steps, {stream.num_chunks - chunks_then} streamed tokens"
    finally:
        release.set()
    request.join(WAIT_S)
    assert response[0].status_code == 400, response[0].text
    message = response[0].json()["error"]["message"]
    assert message.startswith(f"This model's maximum context length is {MAX_MODEL_LEN} tokens, and the prompt is ") and "shorten the prompt" in message
    assert response[0].json()["error"]["code"] == "context_length_exceeded"
    assert calls and all(thread != ENGINE_THREAD for _, thread in calls), calls
    assert stream.finished_whole(), (stream.error, stream.finish_reason)


def test_a_prompt_too_long_by_its_characters_is_refused_before_tokenizing(served, tokenizer_calls):
    """Four clients each sending close to 1 MiB of prompt (refused with 400) while a stream runs:
    none of them is tokenized, and the stream goes on."""
    server, _, steps = served
    calls, _, _ = tokenizer_calls
    stream = Stream(server.url)
    stream.wait_for(2)
    calls.clear()  # the stream's own prompt
    huge = "word " * 200_000  # 1,000,000 characters
    bodies = [{"prompt": huge}, {"prompt": huge}, {"messages": [{"role": "user", "content": huge}]},
              {"messages": [{"role": "system", "content": huge}, {"role": "user", "content": "hi"}]}]
    chunks_then = stream.num_chunks
    requests = [post_in_background(server.url, CHAT if "messages" in body else COMPLETIONS, {**body, "max_tokens": 4}) for body in bodies]
    for thread, response in requests:
        thread.join(WAIT_S)
        assert response[0].status_code == 400, response[0].text
        message = response[0].json()["error"]["message"]
        assert message.startswith(f"This model's maximum context length is {MAX_MODEL_LEN} tokens, and the prompt is ")
        assert "characters, so at least" in message and response[0].json()["error"]["code"] == "context_length_exceeded"
        assert "shorten the prompt" in message
    # Only the chat template ran (to see the text the model would read); no text was tokenized.
    assert [name for name, _ in calls if name != "apply_chat_template"] == [], calls
    assert all(thread != ENGINE_THREAD for _, thread in calls), calls
    assert stream.finished_whole(), (stream.error, stream.finish_reason)
    assert stream.num_chunks > chunks_then


def test_prompts_that_fit_are_tokenized_off_the_engine_thread(served, tokenizer_calls, default_model):
    server, _, _ = served
    calls, _, _ = tokenizer_calls
    reference = Tokenizer.from_dir(default_model)  # the test's own copy
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    with httpx.Client(base_url=server.url, timeout=WAIT_S) as http:
        chat = http.post(CHAT, json={"messages": messages, "max_tokens": 3})
        text = http.post(COMPLETIONS, json={"prompt": "Once upon a time", "max_tokens": 3})
        ids = http.post(COMPLETIONS, json={"prompt": [1, 2, 3, 4], "max_tokens": 3})
        two = http.post(COMPLETIONS, json={"prompt": "Once upon a time", "max_tokens": 3, "n": 2})
        too_many_ids = http.post(COMPLETIONS, json={"prompt": [5] * MAX_MODEL_LEN, "max_tokens": 3})
        bad_id = http.post(COMPLETIONS, json={"prompt": [1, 10**6], "max_tokens": 3})
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == len(reference.encode_chat(messages))
    assert text.status_code == 200 and text.json()["usage"]["prompt_tokens"] == len(reference.encode("Once upon a time"))
    assert ids.status_code == 200 and ids.json()["usage"]["prompt_tokens"] == 4
    assert two.status_code == 200 and len(two.json()["choices"]) == 2
    assert too_many_ids.status_code == 400 and f"maximum context length is {MAX_MODEL_LEN} tokens" in too_many_ids.json()["error"]["message"]
    assert bad_id.status_code == 400 and "outside the vocabulary" in bad_id.json()["error"]["message"]
    assert len(calls) >= 4 and all(thread != ENGINE_THREAD for _, thread in calls), calls


@pytest.mark.parametrize("text", [
    "#" * 5000,  # the longest entries of this vocabulary are runs of '#' and of spaces
    " " * 5000,
    "\n" + " " * 4999,
    "<|im_start|><|im_end|>" * 200,  # special tokens: many characters each
    "word " * 1000,
    "\U0001f600" * 1000,  # 4 bytes a character in a byte-level vocabulary
    "e\u0301" * 1000,  # a letter and a combining accent
])
def test_the_character_bound_never_exceeds_the_true_token_count(default_model, text):
    tokenizer = Tokenizer.from_dir(default_model)
    assert 1 <= tokenizer.min_num_tokens(len(text)) <= len(tokenizer.encode(text))
    assert tokenizer.min_num_tokens(len(text)) <= len(tokenizer.encode_templated(text))
    # and a megabyte of text is proven too long for an 8,192-token context without tokenizing it
    assert tokenizer.min_num_tokens(1 << 20) > 8192

