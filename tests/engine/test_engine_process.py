"""The engine in a process of its own (`graphrt serve`'s default): the engine process dying
mid-stream is a 503 to every request in flight and a prompt non-zero exit, never a hang; the wire
carries every message type as itself. The server tests run against this mode too
(tests/server/test_server_api.py, test_server_logprobs.py, test_server_clients.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import pytest

for package in ("fastapi", "uvicorn", "httpx", "zmq", "msgspec"):  # the server stack: not on every GPU image
    pytest.importorskip(package)

import httpx  # noqa: E402
import msgspec  # noqa: E402
import zmq  # noqa: E402

from graphrt import LLM  # noqa: E402
from graphrt.engine.core import EngineCore, EngineSnapshot, Rejected  # noqa: E402
from graphrt.engine.messages import (  # noqa: E402
    AbortJob,
    AddJob,
    Fatal,
    JobAdmitted,
    JobFailed,
    JobRejected,
    Outputs,
    Shutdown,
    StopChoice,
    ToEngine,
    ToFront,
)
from graphrt.engine.process import EngineLoop, FrontGone  # noqa: E402
from graphrt.engine.sequence import FinishReason, SequenceOutput  # noqa: E402
from graphrt.sampling_params import (
    SamplingParams,  # noqa: E402
    TokenLogprob,  # noqa: E402
)
from helpers import API_KEY, children_of, start_server  # noqa: E402


@pytest.mark.slow
def test_engine_process_dying_mid_stream_is_a_503_and_a_prompt_nonzero_exit():
    proc, url, _ = start_server()
    try:
        (engine_pid,) = children_of(proc.pid)
        headers = {"Authorization": f"Bearer {API_KEY}"}
        body = {"prompt": "Tell me a story.", "max_tokens": 400, "ignore_eos": True}
        events, statuses, first_event = [], [], threading.Event()

        def stream() -> None:
            with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, headers=headers, timeout=60) as response:
                for line in response.iter_lines():
                    if line:
                        events.append(line)
                        first_event.set()

        def whole() -> None:
            response = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)
            statuses.append((response.status_code, response.json()["error"]["message"]))

        clients = [threading.Thread(target=stream), threading.Thread(target=whole)]
        for client in clients:
            client.start()
        assert first_event.wait(30)
        killed_at = time.monotonic()
        os.kill(engine_pid, signal.SIGKILL)
        for client in clients:
            client.join(20)
            assert not client.is_alive(), "a request hung after the engine process died"
        assert statuses == [(503, "the engine process exited with code -9; restart graphrt")]
        assert "the engine process exited with code -9" in events[-2] and events[-1] == "data: [DONE]"
        assert proc.wait(timeout=20) != 0
        assert time.monotonic() - killed_at < 15
        assert "engine process exited with code -9" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_an_engine_whose_front_dies_mid_stream_stops_at_once():
    """The front killed (-9) with six streams of 400 tokens running: the engine, which checked on
    the front only when idle, went on (for good once its sends to nobody filled the socket), holding
    its memory from the restarted server. It now checks every pass and every blocked send."""
    proc, url, _ = start_server(max_batch=8)
    (engine_pid,) = children_of(proc.pid)
    try:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        body = {"prompt": "Tell me a story.", "max_tokens": 400, "ignore_eos": True, "stream": True}
        started = threading.Barrier(7)

        def stream() -> None:
            with contextlib.suppress(httpx.HTTPError), httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=60) as response:
                lines = response.iter_lines()
                next(line for line in lines if line)
                started.wait(30)
                for _ in lines:
                    pass

        clients = [threading.Thread(target=stream, daemon=True) for _ in range(6)]
        for client in clients:
            client.start()
        started.wait(30)  # every stream has its first token: the engine is mid-work
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 5  # the streams' remaining work takes far longer on these cores
        while time.monotonic() < deadline and os.path.exists(f"/proc/{engine_pid}") and not is_zombie(engine_pid):
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{engine_pid}") or is_zombie(engine_pid), "the engine process outlived its front by 5 s"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(engine_pid, signal.SIGKILL)


def test_a_send_nobody_reads_checks_on_the_front_until_it_is_gone(tmp_path, monkeypatch):
    """A real socket whose queue is full (no front reads it) times out each send; the loop then
    asks whether its front is still there, and stops once it is not. Only the parent's pid is
    faked: pytest's own parent cannot be killed here."""
    context = zmq.Context()
    results = context.socket(zmq.PUSH)
    for option, value in ((zmq.SNDHWM, 1), (zmq.SNDTIMEO, 20), (zmq.LINGER, 0)):
        results.setsockopt(option, value)
    results.connect(f"ipc://{tmp_path}/nobody-reads")
    loop = EngineLoop.__new__(EngineLoop)  # its send and front check only: no engine
    loop.results, loop.encoder, loop._parent = results, msgspec.msgpack.Encoder(), os.getppid()
    checks = []
    front = os.getppid()
    monkeypatch.setattr(os, "getppid", lambda: front if checks.append(1) or len(checks) < 4 else 1)
    try:
        loop.send(Fatal("queued"))  # the one message the queue holds
        with pytest.raises(FrontGone):
            loop.send(Fatal("never read"))
    finally:
        results.close()
        context.term()
    assert len(checks) == 4  # three timed-out sends found the front there, the fourth found it gone


def is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_every_message_crosses_the_wire_as_itself():
    encoder = msgspec.msgpack.Encoder()
    entry = TokenLogprob(5, -0.25, ((5, -0.25), (9, -1.5)), rank=3)
    to_engine = [
        AddJob(3, [[1, 2, 3], [4]], [SamplingParams(max_tokens=4, temperature=0.5, top_k=7, seed=11, stop=["x"], logprobs=2)]),
        AddJob(5, [[2]], [SamplingParams(n=2, top_k=-1, stop=None)]),
        AddJob(4, [[7]], [SamplingParams(
            presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.2, min_p=0.1, min_tokens=2,
            logit_bias={3: -100.0, 9: 2.5}, stop_token_ids=[4], bad_words=["no"], bad_words_token_ids=[[8], [5, 6]],
            allowed_token_ids=[3, 4, 5, 6, 9], skip_special_tokens=False,
        )]),
        AbortJob(3), StopChoice(3, 1), Shutdown(),
    ]
    to_front = [
        JobAdmitted(3, 4), JobRejected(3, "too long"), JobRejected(3, "too long", "context_length_exceeded"), JobFailed(3, 503, "bye"),
        Fatal("stage 1 died"),
        Outputs([(3, 0, SequenceOutput(8, [5, 6], FinishReason.STOP, [entry], [None, entry]))], EngineSnapshot(1, 2, 3, 4, 5, stage_busy_s=(0.5,))),
    ]
    for messages, kind in ((to_engine, ToEngine), (to_front, ToFront)):
        decoder = msgspec.msgpack.Decoder(kind)
        for message in messages:
            assert decoder.decode(encoder.encode(message)) == message


def test_the_engine_refuses_a_request_longer_than_the_context_with_its_code(tiny_model_factory):
    """The front checks lengths first; where the engine is the one to refuse, the client still
    gets context_length_exceeded, which agent frameworks read to trim a conversation."""
    llm = LLM(model=tiny_model_factory(), dtype="float32", max_model_len=16, kv_cache_tokens=256)
    try:
        answer = EngineCore(llm.engine).add(1, [[5] * 20], [SamplingParams(max_tokens=2)])
    finally:
        llm.engine.close()
    assert isinstance(answer, Rejected) and answer.code == "context_length_exceeded"
    assert answer.message.startswith("This model's maximum context length is 16 tokens")


def test_bad_sampling_params_are_refused_on_arrival():
    """The engine process checks what it receives as the front does (SamplingParams' own checks)."""
    bad = msgspec.msgpack.encode({"type": "AddJob", "job": 1, "prompt_ids": [[1]], "params": [{"top_p": 5.0}]})
    decoder = msgspec.msgpack.Decoder(ToEngine)
    with pytest.raises(ValueError, match="top_p"):
        decoder.decode(bad)
    bad = msgspec.msgpack.encode({"type": "AddJob", "job": 1, "prompt_ids": [[1]], "params": [{"repetition_penalty": 0.0}]})
    with pytest.raises(ValueError, match="repetition_penalty"):
        decoder.decode(bad)
