"""Two hosts for real: two network namespaces on this machine joined by a veth pair, each with an
address of its own, and `torchrun --nnodes 2` starting graphrt on both: PP 2 across the hosts, EP 2
within each (a tiny Qwen3-MoE). The server on host A answers as one process does; cutting the link
mid-stream ends the stream with an error and every process on both hosts exits non-zero within the
watchdog. Skipped, saying why, where the machine refuses namespaces (they need root).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from graphrt import LLM, SamplingParams
from graphrt.tools.synthetic import make_tiny_model, write_char_tokenizer

WATCHDOG_S = 3.0
PROMPT, TOKENS = "abc", 8
SERVER_PORT, MASTER_PORT = 8123, 29561  # inside the namespaces, which nothing else uses
CLIENT = """
import httpx, json, sys, time
url = "http://127.0.0.1:%d"
deadline = time.time() + 120
while True:
    try:
        if httpx.get(url + "/health", timeout=2).status_code == 200:
            break
    except httpx.HTTPError:
        pass
    if time.time() > deadline:
        sys.exit("the server on host A never became healthy")
    time.sleep(0.3)
body = {"prompt": %r, "max_tokens": %d, "temperature": 0, "ignore_eos": True}
answer = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
if "choices" not in answer:
    sys.exit(f"the server answered {answer}")
print("WHOLE", json.dumps(answer["choices"][0]["text"]), flush=True)
with httpx.stream("POST", url + "/v1/completions", json={**body, "max_tokens": 240, "stream": True}, timeout=60) as response:
    for line in response.iter_lines():
        if line:
            print("CHUNK", line, flush=True)
print("END", flush=True)
""" % (SERVER_PORT, PROMPT, TOKENS)


def ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)


@pytest.fixture
def two_hosts():
    """(namespace, interface) of hosts A (10.77.0.1) and B (10.77.0.2); removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CI runs as root)")
    tag = os.getpid() % 100000
    hosts = [(f"graphrt-a{tag}", f"vgra{tag}"), (f"graphrt-b{tag}", f"vgrb{tag}")]
    made = []
    try:
        for namespace, _ in hosts:
            result = ip("netns", "add", namespace)
            if result.returncode:
                pytest.skip(f"this machine refuses network namespaces: ip netns add: {result.stderr.strip()}")
            made.append(namespace)
        (a, veth_a), (b, veth_b) = hosts
        steps = [
            ("link", "add", veth_a, "type", "veth", "peer", "name", veth_b),
            ("link", "set", veth_a, "netns", a), ("link", "set", veth_b, "netns", b),
            ("-n", a, "addr", "add", "10.77.0.1/24", "dev", veth_a), ("-n", b, "addr", "add", "10.77.0.2/24", "dev", veth_b),
            ("-n", a, "link", "set", veth_a, "up"), ("-n", b, "link", "set", veth_b, "up"),
            ("-n", a, "link", "set", "lo", "up"), ("-n", b, "link", "set", "lo", "up"),
        ]
        for step in steps:
            result = ip(*step)
            if result.returncode:
                pytest.skip(f"this machine refuses a veth pair between namespaces: ip {' '.join(step)}: {result.stderr.strip()}")
        yield hosts
    finally:
        for namespace in made:
            ip("netns", "del", namespace)  # takes its end of the veth pair, and so the pair, with it


def in_namespace(namespace: str, interface: str, *command: str) -> subprocess.Popen:
    """`command` on that host, in a process group of its own (so a failed test can stop it whole)."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME=interface, PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        ["ip", "netns", "exec", namespace, *command], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )


def torchrun(namespace: str, interface: str, node_rank: int, graphrt_args: list[str]) -> subprocess.Popen:
    return in_namespace(
        namespace, interface, sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node_rank),
        "--nproc-per-node", "2", "--master-addr", "10.77.0.1", "--master-port", str(MASTER_PORT), "-m", "graphrt.worker",
        *graphrt_args,
    )


def test_pp_across_two_hosts_with_ep_within_each_serves_and_a_cut_link_ends_everything(two_hosts, tmp_path):
    (host_a, veth_a), (host_b, veth_b) = two_hosts
    model = write_char_tokenizer(make_tiny_model(tmp_path / "qwen3-moe", "qwen3-moe"))
    alone = LLM(model=model, dtype="float64")
    expected = alone.generate(PROMPT, SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True))[0].text
    alone.engine.close()

    # Ranks 0-1 (stage 0's two expert ranks, the server) on host A, 2-3 (stage 1's) on host B.
    args = ["serve", "--model", str(model), "--pp", "2", "--ep", "2", "--dtype", "float64", "--host", "127.0.0.1",
            "--port", str(SERVER_PORT), "--watchdog-s", str(WATCHDOG_S)]  # fmt: skip
    nodes = [torchrun(host_b, veth_b, 1, args), torchrun(host_a, veth_a, 0, args)]
    client = in_namespace(host_a, veth_a, sys.executable, "-c", CLIENT)
    lines: list[str] = []
    cut_at = None
    try:
        reader = threading.Thread(target=lambda: lines.extend(client.stdout), daemon=True)
        reader.start()
        deadline = time.monotonic() + 150
        while sum(line.startswith("CHUNK") for line in lines) < 5 and client.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sum(line.startswith("CHUNK") for line in lines) >= 5, "".join(lines) + "".join(node.stdout.read() for node in nodes if node.poll() is not None)
        assert ip("-n", host_a, "link", "set", veth_a, "down").returncode == 0
        cut_at = time.monotonic()
        reader.join(WATCHDOG_S + 20)
        codes = []
        for node in nodes:
            try:
                codes.append(node.wait(max(1.0, cut_at + WATCHDOG_S + 20 - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        exited_within = time.monotonic() - cut_at
    finally:
        for process in (*nodes, client):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
    logs = [node.stdout.read() for node in nodes]
    whole = next(line for line in lines if line.startswith("WHOLE"))
    assert json.loads(whole.removeprefix("WHOLE ")) == expected  # four ranks on two hosts, the one process's text
    chunks = [line.removeprefix("CHUNK data: ").strip() for line in lines if line.startswith("CHUNK")]
    assert chunks[-1] == "[DONE]" and "END\n" in lines, lines[-3:]
    error = json.loads(chunks[-2])["error"]
    assert "stopped answering" in error["message"] and "the pipeline is down" in error["message"], error
    assert len(chunks) < 240, "the stream ran to its end: the link was cut too late"
    assert codes[0] not in (None, 0) and codes[1] not in (None, 0), (codes, logs)
    assert exited_within < WATCHDOG_S + 20, exited_within
