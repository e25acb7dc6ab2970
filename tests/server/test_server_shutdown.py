"""`graphrt serve` as a user runs it: the start-up banner, GRAPHRT_API_KEY, --served-model-name, and
SIGTERM / SIGINT with streams in flight: each stream ends with an error event and [DONE], the process
exits 0, promptly."""

from __future__ import annotations

import re
import signal
import threading
import time

import pytest

for package in ("fastapi", "uvicorn", "httpx"):  # the server stack: not on every GPU image
    pytest.importorskip(package)

import httpx  # noqa: E402

from helpers import API_KEY, start_server  # noqa: E402

pytestmark = pytest.mark.slow

# SIGTERM and SIGINT reach the same handler (GracefulServer.capture_signals installs uvicorn's
# handle_exit for both), so each test stops its server with one of them, as it comes in use: Ctrl+C
# at a terminal, SIGTERM from a process manager under load. A server start is most of a test's time.


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP], ids=["SIGINT", "SIGHUP"])
def test_signal_cancels_streams_and_exits_0(sig):
    proc, url, banner = start_server()
    try:
        assert re.match(r"\[graphrt\] load and capture \d+\.\d s: SmolLM2-135M-Instruct", banner[0])
        assert re.match(r"\[graphrt\] matmuls: ", banner[1])  # the path each weight shape runs on, as measured
        # The kernels it runs, op by op compiled or torch reference, and why (kernels/cpu/kernel_choice.py).
        assert re.match(r"\[graphrt\] CPU kernels: (compiled|torch references).* \(", banner[2])
        assert re.match(r"\[graphrt\] warm-up \d+\.\d s", banner[3])
        assert re.match(r"\[graphrt\] cpu placement: (pin|float) \(", banner[4])  # and why (tests/kernels/cpu/test_cpu_placement.py)
        assert banner[6].startswith(f"try: curl {url}/v1/chat/completions") and "Authorization: Bearer $GRAPHRT_API_KEY" in banner[6]
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}).status_code == 401  # the key came from the env
        events, first_event = [], threading.Event()

        def stream_forever():
            body = {"prompt": "Tell me a story.", "max_tokens": 400, "ignore_eos": True, "stream": True}
            headers = {"Authorization": f"Bearer {API_KEY}"}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=60) as response:
                for line in response.iter_lines():
                    if line:
                        events.append(line)
                        first_event.set()

        reader = threading.Thread(target=stream_forever)
        reader.start()
        assert first_event.wait(30)
        start = time.monotonic()
        proc.send_signal(sig)
        assert proc.wait(timeout=20) == 0
        assert time.monotonic() - start < 10
        reader.join(10)
        assert not reader.is_alive()
        assert "shutting down" in events[-2] and events[-1] == "data: [DONE]"
        assert "[graphrt] stopped" in proc.stdout.read()
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("sig", [signal.SIGTERM], ids=["SIGTERM"])
def test_signal_with_16_open_streams_ends_each_and_exits_0(sig):
    # The stage thread is mid-step when the signal lands; a thread left inside a torch op at
    # interpreter exit aborted the process (exit 134, "terminate called without an active exception").
    proc, url, _ = start_server(max_batch=16)
    num_streams = 16
    try:
        events = [[] for _ in range(num_streams)]
        first_token = [threading.Event() for _ in range(num_streams)]

        def stream(index: int) -> None:
            body = {"prompt": "Tell me a story.", "max_tokens": 480, "ignore_eos": True, "stream": True}
            headers = {"Authorization": f"Bearer {API_KEY}"}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=120) as response:
                for line in response.iter_lines():
                    if line:
                        events[index].append(line)
                        first_token[index].set()

        readers = [threading.Thread(target=stream, args=(index,)) for index in range(num_streams)]
        for reader in readers:
            reader.start()
        for index, started in enumerate(first_token):
            assert started.wait(120), f"stream {index} produced no token"
        proc.send_signal(sig)
        assert proc.wait(timeout=120) == 0, proc.stdout.read()
        for reader in readers:
            reader.join(30)
            assert not reader.is_alive()
        for stream_events in events:
            assert "shutting down" in stream_events[-2] and stream_events[-1] == "data: [DONE]", stream_events[-3:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_served_model_names_are_what_clients_pass_and_the_first_is_what_responses_carry(default_model):
    """As vLLM's --served-model-name: clients that send the Hugging Face name get answers (and
    SGLang's scripts, which send "default"). The command line is a vLLM user's too: the model as an
    argument, -pp, --enable-auto-tool-choice."""
    names = ("HuggingFaceTB/SmolLM2-135M-Instruct", "smol")
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
    vllm_habits = ("-pp", "1", "--enable-auto-tool-choice", "--chat-template", template, str(default_model))
    proc, url, banner = start_server(extra_args=(*(arg for name in names for arg in ("--served-model-name", name)), *vllm_habits))
    headers = {"Authorization": f"Bearer {API_KEY}"}
    try:
        assert "[graphrt] chat template: the one --chat-template gave, not the model's" in banner
        question = [{"role": "user", "content": "Hi there"}]
        rendered = httpx.post(f"{url}/tokenize", json={"messages": question}, headers=headers).json()["tokens"]
        spelled = httpx.post(f"{url}/detokenize", json={"tokens": rendered}, headers=headers).json()["prompt"]
        assert spelled == "<user>Hi there\n<assistant>"
        assert f"[graphrt] model names: {', '.join(names)} (responses carry {names[0]})" in banner
        assert any(line.startswith(f"[graphrt] serving {names[0]} on {url}") for line in banner)
        listed = httpx.get(f"{url}/v1/models", headers=headers).json()["data"]
        assert [card["id"] for card in listed] == list(names)
        assert httpx.get(f"{url}/v1/models/{names[1]}", headers=headers).json()["id"] == names[1]
        for name in names:
            body = {"model": name, "prompt": "hi", "max_tokens": 2}
            answer = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)
            assert answer.status_code == 200 and answer.json()["model"] == names[0]
        sglangs = httpx.post(f"{url}/v1/completions", json={"model": "default", "prompt": "hi", "max_tokens": 2}, headers=headers, timeout=60)
        assert sglangs.status_code == 200 and sglangs.json()["model"] == names[0]
        assert httpx.get(f"{url}/v1/models/default", headers=headers).status_code == 404  # no card has that name
        refused = httpx.post(f"{url}/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": "hi"}, headers=headers, timeout=60)
        assert refused.status_code == 404
        assert refused.json()["error"]["message"] == f"model 'SmolLM2-135M-Instruct' does not exist; this server serves {names[0]!r}, {names[1]!r}"
    finally:
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0
    # A refused request is a line on the server's stderr, so its operator sees what clients keep sending.
    assert "[graphrt] refused POST /v1/completions (404): model 'SmolLM2-135M-Instruct' does not exist" in output, output
    assert "[graphrt] refused GET /v1/models/default (404)" in output


def test_a_blank_served_model_name_is_refused_before_anything_starts():
    from click.testing import CliRunner

    from graphrt.cli import main

    result = CliRunner().invoke(main, ["serve", "--served-model-name", " smol"])
    assert result.exit_code == 1
    assert result.output == "error: --served-model-name ' smol' is empty or starts or ends with whitespace; give the name clients send as model\n"
    result = CliRunner().invoke(main, ["serve", "--pipeline-parallel-size", "2", "--model", "a", "b"])
    assert result.exit_code == 2 and "the model is named twice, b and --model a: give one" in result.output
    result = CliRunner().invoke(main, ["serve", "--chat-template", "no-such-file.jinja"])
    assert result.exit_code == 1
    assert result.output == "error: --chat-template 'no-such-file.jinja' is neither a file nor a Jinja template (no {{ or {%); give one of those\n"
    result = CliRunner().invoke(main, ["serve", "--served-model-name", "a", "b"])  # vLLM takes both names so
    assert result.exit_code == 2
    assert "b is no model folder; for several served model names repeat the flag: --served-model-name a --served-model-name b" in result.output


def test_the_models_generation_config_sets_what_a_request_leaves_out(tiny_model_factory, tmp_path):
    """As vLLM's --generation-config auto: a folder whose generation_config.json says temperature 0
    answers a request without a temperature greedily; one that gives a temperature samples."""
    import json
    import shutil

    from graphrt import LLM, SamplingParams

    folder = tmp_path / "greedy-model"
    shutil.copytree(tiny_model_factory(), folder)
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_k": 5}))
    llm = LLM(model=folder, dtype="float32", load_tokenizer=False)
    greedy = llm.generate([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=8))[0].token_ids
    sampled = llm.generate([5, 6, 7], SamplingParams(temperature=1.0, top_k=5, seed=3, max_tokens=8))[0].token_ids
    assert sampled != greedy  # else the test could not tell the two apart
    proc, url, banner = start_server(extra_args=("--dtype", "float32", "--max-model-len", "256", str(folder)))  # the tiny model's
    headers = {"Authorization": f"Bearer {API_KEY}"}
    try:
        assert any("sampling defaults from the model's generation_config.json: temperature=0.0, top_k=5" in line for line in banner)

        def tokens(**fields) -> list[int]:
            body = {"prompt": [5, 6, 7], "max_tokens": 8, "return_token_ids": True, **fields}
            return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60).json()["choices"][0]["token_ids"]

        assert tokens() == tokens(seed=3) == greedy
        assert tokens(temperature=1.0, seed=3) == sampled
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


def test_a_chat_template_is_read_from_its_file_or_taken_as_given(tmp_path):
    from graphrt.server.runner import read_chat_template

    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    path = tmp_path / "template.jinja"
    path.write_text(template)
    assert read_chat_template(str(path)) == read_chat_template(template) == template
    with pytest.raises(ValueError, match="is neither a file nor a Jinja template"):
        read_chat_template(str(tmp_path / "missing.jinja"))


@pytest.mark.parametrize("delay_s", [1.5])
def test_sigterm_during_start_up_stops_it_in_one_line_with_exit_0(delay_s):
    """1.5 s in, the server stack is importing or the engine loading (its start takes several
    seconds): before, SIGTERM killed the process outright, or click said "Aborted!" with exit 1."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "graphrt", "serve", "--port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    time.sleep(delay_s)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert out.strip().splitlines()[-1] == "[graphrt] stopped during start-up" and "Traceback" not in out and "Aborted" not in out
