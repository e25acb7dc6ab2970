"""Stages as processes (`procs=True`, `--procs`): the same tokens as one process, a dead stage
fails what is in flight and every process exits, and ranks that disagree are refused at start-up.

Every wait here is bounded: worker processes are killed in `finally` and subprocesses run under
timeouts, so a regression fails the test instead of hanging the suite.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from graphrt import LLM, SamplingParams
from graphrt.distributed.remote import free_port
from graphrt.distributed.transport import StageFailure
from graphrt.errors import GraphrtError
from graphrt.tools.synthetic import make_synthetic, make_tiny_model

OPTIONS = dict(dtype="float64", kv_cache_tokens=2048, buckets=[1, 2, 4], prefill_chunk_size=16)
PROMPTS = [[(7 * i + j) % 96 + 1 for j in range(3 + 5 * i)] for i in range(5)]  # 3..23 tokens: several prefill chunks
# Penalties, bias and masks (graphrt.runtime.logits_plan): the plan travels with the micro-batch, the
# last rank keeps each request's token history and lets it go when rank 0 says the request ended.
PROCESSED = [
    SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, presence_penalty=1.0, repetition_penalty=1.3),
    SamplingParams(max_tokens=10, temperature=0.8, seed=5, ignore_eos=True, frequency_penalty=0.5, min_p=0.1),
    SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logit_bias={7: 2.0}, bad_words_token_ids=[[3], [50, 60]]),
    SamplingParams(max_tokens=10, temperature=0, allowed_token_ids=[1, 2, 4, 8, 16, 32, 64], min_tokens=3),
    SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
]
WATCHDOG_S = 3.0


def outputs(llm: LLM, params: SamplingParams) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, params)]


def wait_all_exited(children: list[subprocess.Popen], within_s: float) -> list[int | None]:
    deadline = time.monotonic() + within_s
    for child in children:
        try:
            child.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    codes = [child.poll() for child in children]
    for child in children:
        if child.poll() is None:
            child.kill()
    return codes


@pytest.mark.parametrize("pp", [2, 3])
def test_stage_processes_give_the_single_process_tokens(tiny_model_factory, pp):
    model = tiny_model_factory("llama-gqa-tied")
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True)
    alone = LLM(model=model, pp=pp, **OPTIONS)
    expected = outputs(alone, greedy), outputs(alone, seeded), outputs(alone, PROCESSED)
    alone.engine.close()
    llm = LLM(model=model, pp=pp, procs=True, watchdog_s=30, **OPTIONS)
    children = llm.engine.cluster.children
    try:
        assert [c.poll() for c in children] == [None] * (pp - 1)
        assert outputs(llm, greedy) == expected[0]
        busy_before = llm.engine.ring.stage_busy_s
        assert outputs(llm, seeded) == expected[1]
        busy_after = llm.engine.ring.stage_busy_s
        assert outputs(llm, PROCESSED) == expected[2]
        # Every stage's busy time reaches rank 0, the other processes' with each reply, and grows.
        assert len(busy_after) == pp and all(0 < a < b for a, b in zip(busy_before, busy_after)), (busy_before, busy_after)
        assert llm.engine.weight_bytes == alone.engine.weight_bytes  # the workers reported theirs
    finally:
        llm.engine.close()
        codes = wait_all_exited(children, within_s=10)
    assert codes == [0] * (pp - 1)  # a normal close: every worker exits cleanly


def test_a_mixture_of_experts_over_stage_processes_gives_the_single_process_tokens(tiny_model_factory):
    """The partition weighed at the largest bucket travels in the plan, and each worker reports its
    weights split into dense and expert bytes: the same layers, the same weight reads, the same tokens."""
    model = tiny_model_factory("qwen3-moe-dense-first")  # layers 0 and 2 dense, 1 and 3 sparse
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = LLM(model=model, pp=2, **OPTIONS)
    expected = outputs(alone, greedy)
    expert_tokens = alone.engine.ring.stage_expert_tokens
    alone.engine.close()
    llm = LLM(model=model, pp=2, procs=True, watchdog_s=30, **OPTIONS)
    children = llm.engine.cluster.children
    try:
        assert outputs(llm, greedy) == expected
        assert llm.engine.layers == alone.engine.layers and llm.engine.partition_rows == alone.engine.partition_rows == 4
        assert llm.engine.weight_reads == alone.engine.weight_reads and llm.engine.weight_reads.expert_bytes > 0
        # the worker's expert load reaches rank 0 with each reply: each stage holds one sparse layer
        assert llm.engine.ring.stage_expert_tokens == expert_tokens and all(sum(t) > 0 for t in expert_tokens)
    finally:
        llm.engine.close()
        codes = wait_all_exited(children, within_s=10)
    assert codes == [0]


def test_rank_zero_opens_nothing_on_the_devices_of_other_ranks(tiny_model_factory, monkeypatch):
    """The last rank samples and keeps the seeded generators; rank 0 makes no sampler (on GPUs it
    would open a CUDA context, some 500 MiB, on the last GPU) and times only its own stage."""
    import graphrt.engine.engine

    model = tiny_model_factory("llama-gqa-tied")
    seeded = SamplingParams(max_tokens=6, temperature=0.8, seed=5, ignore_eos=True)
    alone = LLM(model=model, pp=2, **OPTIONS)
    expected = outputs(alone, seeded)
    alone.engine.close()
    timed_devices = []
    timeline = graphrt.engine.engine.Timeline
    monkeypatch.setattr(graphrt.engine.engine, "Timeline", lambda devices: timed_devices.append(devices) or timeline(devices))
    llm = LLM(model=model, pp=2, procs=True, timeline=True, watchdog_s=30, **OPTIONS)
    children = llm.engine.cluster.children
    try:
        assert llm.engine.sampler is None
        assert [list(map(str, d)) for d in timed_devices] == [["cpu"]]  # stage 0's device only
        assert outputs(llm, seeded) == expected
    finally:
        llm.engine.close()
        wait_all_exited(children, within_s=10)


def test_killing_a_stage_fails_requests_in_flight_and_every_process_exits(tiny_model_factory):
    llm = LLM(model=tiny_model_factory("llama-gqa-tied"), pp=3, procs=True, watchdog_s=WATCHDOG_S, **OPTIONS)
    make_synthetic(llm.engine, stage_ms=10)  # stage 0 takes 10 ms, so the requests are still running at the kill
    children = llm.engine.cluster.children
    errors: list[BaseException] = []

    def run() -> None:
        try:
            llm.generate(PROMPTS, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
        except BaseException as exc:  # noqa: BLE001 - inspected below
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    try:
        thread.start()
        time.sleep(1.0)
        assert thread.is_alive(), "the requests finished before the kill; the test needs a slower stage"
        killed_at = time.monotonic()
        children[0].send_signal(signal.SIGKILL)  # rank 1, the middle stage
        thread.join(WATCHDOG_S + 10)
        assert not thread.is_alive(), "generate did not return after a stage died"
        codes = wait_all_exited(children, within_s=WATCHDOG_S + 10 - (time.monotonic() - killed_at))
    finally:
        for child in children:
            child.kill()
    # The engine may wrap the StageFailure (its own stage-error recovery); the stage is named either way.
    assert len(errors) == 1 and isinstance(errors[0], GraphrtError), errors
    assert "stage 1 (rank 1) exited with code -9" in str(errors[0])
    assert isinstance(errors[0], StageFailure) or isinstance(errors[0].__cause__, StageFailure)
    assert all(code not in (None, 0) for code in codes), codes
    with pytest.raises(GraphrtError, match=r"stage 1 \(rank 1\)"):  # the engine stays failed rather than hanging
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0))


def test_server_over_stage_processes_answers_and_fails_with_503(tiny_model_factory):
    for package in ("fastapi", "uvicorn", "httpx"):  # the server stack: not on every GPU image
        pytest.importorskip(package)
    import httpx

    from graphrt.server import ServerSettings, ServerThread

    model = tiny_model_factory("llama-gqa-tied")
    body = {"prompt": PROMPTS[2], "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    alone = LLM(model=model, pp=2, **OPTIONS)
    expected = alone.generate(PROMPTS[2], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    alone.engine.close()
    llm = LLM(model=model, pp=2, procs=True, watchdog_s=WATCHDOG_S, **OPTIONS)
    children = llm.engine.cluster.children
    server = ServerThread(llm, ServerSettings(model_id="tiny")).start()
    try:
        answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).json()
        assert answer["usage"]["completion_tokens"] == len(expected.token_ids) == 10
        assert answer["choices"][0]["finish_reason"] == "length"
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        for stage in (0, 1):  # stage 1 runs in the worker process
            line = next(line for line in metrics.splitlines() if line.startswith(f'graphrt_stage_busy_seconds_total{{stage="{stage}"}}'))
            assert float(line.split()[-1]) > 0, line
        make_synthetic(llm.engine, stage_ms=10)
        statuses: list[int] = []
        long = {**body, "max_tokens": 200}
        thread = threading.Thread(target=lambda: statuses.append(httpx.post(f"{server.url}/v1/completions", json=long, timeout=30).status_code))
        thread.start()
        time.sleep(1.0)
        killed_at = time.monotonic()
        children[0].send_signal(signal.SIGKILL)
        thread.join(WATCHDOG_S + 10)
        codes = wait_all_exited(children, within_s=WATCHDOG_S + 10 - (time.monotonic() - killed_at))
        assert statuses == [503]
        assert codes == [-9]
        server._thread.join(5)  # the server stops by itself: it cannot serve without the stage
        assert not server._thread.is_alive(), "the server kept serving a dead pipeline"
    finally:
        for child in children:
            child.kill()
        server.stop()


def start_rank(rank: int, port: int, args: list[str]) -> subprocess.Popen:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "graphrt.worker", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.parametrize(
    ("worker_args", "field"),
    [(["--other-model"], "model_fingerprint"), (["--dtype", "float32"], "dtype")],
    ids=["model", "dtype"],
)
def test_ranks_that_disagree_are_refused_naming_the_field(tiny_model_factory, worker_args, field):
    """torchrun's way: the same `python -m graphrt.worker` on every rank; rank 0 runs `graphrt generate`."""
    model = tiny_model_factory("llama-gqa-tied")
    other = tiny_model_factory("llama-mha-untied")
    port = free_port()
    engine_args = ["generate", "--model", str(model), "--pp", "2", "--dtype", "float64", "--prompt", "hi", "--watchdog-s", "5"]
    worker_model = other if worker_args == ["--other-model"] else model
    worker_extra = [] if worker_args == ["--other-model"] else worker_args
    ranks = [start_rank(0, port, engine_args), start_rank(1, port, ["--model", str(worker_model), *worker_extra])]
    try:
        logs = [rank.communicate(timeout=90)[0] for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    assert [rank.returncode for rank in ranks] == [1, 1], logs
    for log in logs:
        assert f"stage 1 (rank 1) disagrees with the engine about {field}" in log, log


def test_stage_zero_keeps_the_heartbeat_going_while_it_waits_for_a_reply():
    """With async scheduling, stage 0's thread waits for an earlier micro-batch's reply before it
    runs the next one; rank 1 may hear nothing else meanwhile, so the waiting thread beats."""
    from types import SimpleNamespace

    from graphrt.distributed.remote import RemoteEvent, RemoteRing
    from graphrt.runtime.streams import CpuStream

    beats: list[float] = []
    stream = CpuStream("test-stage0")
    ring = SimpleNamespace(cluster=SimpleNamespace(watchdog_s=0.2, samples_here=False), streams=[stream], _beat=lambda: beats.append(time.monotonic()))
    try:
        reply = RemoteEvent()
        RemoteRing._wait_on_stage0(ring, SimpleNamespace(done=reply))
        after = stream.record()
        deadline = time.monotonic() + 10  # four beats take 0.2 s; a loaded machine may take longer
        while len(beats) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(beats) >= 4  # one every watchdog_s / 4, while it waits
        assert not after.query()  # still waiting for the reply
        reply._set()
        after.synchronize()

        failed = RemoteEvent()
        RemoteRing._wait_on_stage0(ring, SimpleNamespace(done=failed))
        failed._set(StageFailure("stage 2 (rank 2) exited with code 1"))
        with pytest.raises(StageFailure, match="rank 2"):
            stream.record().synchronize()  # the failure reaches whoever waits on stage 0 next
    finally:
        stream.close()


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_over_stage_processes_gives_the_tokens_without_it(tmp_path, method):
    """Verify steps cross the processes as decode steps whose tokens are rows; the last rank samples
    at every token. A model whose output loops, so that ngram drafts are kept and rejected; the
    target drafts for itself as the draft model (on rank 0's device)."""
    model = make_tiny_model(tmp_path / "looping", "llama-gqa-tied", weight_scale=0.6)
    options = dict(dtype="float64", kv_cache_tokens=2048, prefill_chunk_size=16, max_num_seqs=4)
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    alone = LLM(model=model, pp=2, **options)
    expected = outputs(alone, greedy)
    alone.engine.close()
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    if method == "draft_model":
        config = {"method": "draft_model", "model": str(model), "num_speculative_tokens": 3}
    llm = LLM(model=model, pp=2, procs=True, watchdog_s=30, speculative_config=config, **options)
    llm.engine.scheduler.speculation.step_costs = None  # every draft is verified, whatever the step costs here
    children = llm.engine.cluster.children
    try:
        assert outputs(llm, greedy) == expected
        spec = llm.engine.stats.spec
        assert 0 < spec.num_accepted_tokens, spec.describe()
        assert method == "draft_model" or spec.num_accepted_tokens < spec.num_draft_tokens, spec.describe()
    finally:
        llm.engine.close()
        codes = wait_all_exited(children, within_s=10)
    assert codes == [0]
