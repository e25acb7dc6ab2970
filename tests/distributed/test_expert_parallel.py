"""Expert parallelism (`ep=N`, `--ep N`): each stage's routed experts split over N ranks, their
shares summed by one all-reduce per sparse layer.

The layer alone: N shards, each run on a thread with an all-reduce between them, give the whole
layer's output (both fused-MoE forms, the CPU's by-expert kernel too). The engine: stage processes
over gloo give the single-rank tokens exactly in float64 (greedy, seeded sampling, logprobs, prefix
caching) for Mixtral, Qwen3-MoE and DeepSeek-V3 shapes at pp 1 and 2; each rank holds only its
experts; a killed expert rank ends everything. Every wait is bounded, as in test_distributed.py.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import signal
import threading
import time

import pytest
import torch
from safetensors import safe_open
from test_distributed import OPTIONS, PROMPTS, start_rank, wait_all_exited

from graphrt import LLM, SamplingParams
from graphrt.config import EngineConfig
from graphrt.distributed.remote import free_port
from graphrt.distributed.transport import STATS_INTERVAL_S, StageFailure
from graphrt.errors import GraphrtError
from graphrt.kernels.cpu.moe import fused_moe_by_expert
from graphrt.model.config import ModelConfig
from graphrt.model.moe import ExpertShard
from graphrt.model.weights import WeightFiles
from graphrt.profiling.nvtx import Ranges
from graphrt.profiling.report import summarize
from graphrt.profiling.trace import chrome_trace
from graphrt.runtime.stage_builder import load_stage
from graphrt.tools.synthetic import make_synthetic
from helpers import RecordingDomain

FAMILIES = ["mixtral", "qwen3-moe", "deepseek-v3"]  # 8, 8 and 16 experts; DeepSeek's with a shared expert
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=3, ignore_eos=True)
LOGPROBS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
WATCHDOG_S = 3.0


def all_reduce_between_threads(ep: int):
    """What a stage's expert ranks do with one all-reduce, for `ep` threads in one process: each
    share is summed into every rank's tensor, in rank order."""
    barrier, shares = threading.Barrier(ep), [None] * ep

    def combine_for(rank: int):
        def combine(share: torch.Tensor) -> None:
            shares[rank] = share.clone()
            barrier.wait()
            share.copy_(torch.stack(shares).sum(dim=0))
            barrier.wait()  # every rank has read the shares before the next layer writes its own

        return combine

    return combine_for


@pytest.mark.parametrize("fused_moe", ["reference", "cpu-by-expert"])
@pytest.mark.parametrize("num_tokens", [1, 3, 16])
@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.parametrize("variant", ["mixtral", "qwen2-moe", "deepseek-v3"])
def test_expert_shards_summed_give_the_whole_layer(tiny_model_factory, variant, ep, num_tokens, fused_moe):
    """One token has fewer (token, k) pairs than a shard's experts, so the reference's gathered form
    runs there (at ep 2); the other rows its every-expert form. Qwen2-MoE adds a gated shared expert."""
    model = tiny_model_factory(variant)
    cfg = ModelConfig.from_dir(model)
    files = WeightFiles(model)
    layers = range(cfg.num_layers)

    def stage(shard: ExpertShard):
        built = load_stage(cfg, 0, 1, layers, torch.device("cpu"), torch.float64, 64, "torch", files, shard)
        if fused_moe == "cpu-by-expert":
            built.use_kernels(dataclasses.replace(built.ops, fused_moe=fused_moe_by_expert))
        return built

    sparse = next(i for i in layers if cfg.moe.is_sparse(i))
    whole = stage(ExpertShard())
    hidden = torch.randn(num_tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(num_tokens), dtype=torch.float64)
    expected = whole.layers[sparse].moe(hidden, whole.ops)

    shards = [stage(ExpertShard(rank, ep)) for rank in range(ep)]
    combine_for = all_reduce_between_threads(ep)
    outputs = [None] * ep

    def run(rank: int) -> None:
        shards[rank].combine_experts_with(combine_for(rank), Ranges(domain=domains[rank]))
        outputs[rank] = shards[rank].layers[sparse].moe(hidden, shards[rank].ops)

    domains = [RecordingDomain() for _ in range(ep)]
    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(ep)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    per_rank = cfg.moe.num_experts // ep
    for rank, shard in enumerate(shards):
        moe = shard.layers[sparse].moe
        assert moe.experts == range(rank * per_rank, (rank + 1) * per_rank)
        # the shard's experts are the checkpoint's, those experts' and no others
        torch.testing.assert_close(moe.experts_down, whole.layers[sparse].moe.experts_down[moe.experts.start : moe.experts.stop], rtol=0, atol=0)
        torch.testing.assert_close(outputs[rank], expected, rtol=0, atol=1e-12)
        pushed = [message for kind, message, _ in domains[rank].events if kind == "push"]
        assert pushed == ["experts dispatch", "experts run", "experts combine"]  # the layer's parts, for Nsight


def run_all(llm: LLM) -> tuple:
    greedy = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    seeded = [o.token_ids for o in llm.generate(PROMPTS, SEEDED)]
    scored = llm.generate(PROMPTS[:3], LOGPROBS)
    hits_before = llm.engine.allocator.num_hit_tokens
    again = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]  # each prompt's whole blocks are cached now
    return greedy, seeded, scored, again, llm.engine.allocator.num_hit_tokens - hits_before


def assert_same_logprobs(got, expected) -> None:
    for ours, theirs in zip(got, expected):
        assert ours.token_ids == theirs.token_ids
        pairs = list(zip(ours.logprobs, theirs.logprobs)) + list(zip(ours.prompt_logprobs[1:], theirs.prompt_logprobs[1:]))
        for a, b in pairs:
            assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
            assert a.logprob == pytest.approx(b.logprob, abs=1e-9)


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("variant", FAMILIES)
def test_expert_ranks_give_the_single_rank_tokens(tiny_model_factory, variant, pp):
    model = tiny_model_factory(variant)
    alone = LLM(model=model, pp=pp, **OPTIONS)
    greedy, seeded, scored, again, hits = run_all(alone)
    expert_tokens = alone.engine.ring.stage_expert_tokens
    single_rank_reads = alone.engine.weight_reads
    alone.engine.close()
    assert again == greedy and hits > 0

    llm = LLM(model=model, pp=pp, ep=2, devices=["cpu"] * (2 * pp), watchdog_s=30, timeline=pp == 2, **OPTIONS)  # one per rank
    children = llm.engine.cluster.children
    try:
        assert len(children) == 2 * pp - 1  # every rank but this one
        assert llm.engine.devices == [torch.device("cpu")] * pp  # one per stage: its leader's
        ours = run_all(llm)
        assert ours[0] == greedy and ours[1] == seeded and ours[3] == again and ours[4] == hits
        assert_same_logprobs(ours[2], scored)
        # the stage leaders count every expert's tokens (routing is whole on each rank)
        assert llm.engine.ring.stage_expert_tokens == expert_tokens
        # Each rank holds half the experts and the rest of its stage: the experts add up to the single
        # rank's once; each stage's dense weights are held by both its ranks, but the final norm and
        # LM head only by the last stage's leader, which samples.
        ranks = llm.engine.rank_weight_reads()
        cfg = llm.engine.model_config
        head_bytes = (cfg.vocab_size * cfg.hidden_size + cfg.hidden_size) * 8  # float64
        assert len(ranks) == 2 * pp
        assert sum(r.expert_bytes for r in ranks) == single_rank_reads.expert_bytes
        for stage in range(pp):
            first, second = ranks[2 * stage], ranks[2 * stage + 1]
            assert first.expert_bytes == second.expert_bytes
            assert first.dense_bytes - second.dense_bytes == (head_bytes if stage == pp - 1 else 0)
        assert sum(r.dense_bytes for r in ranks) == 2 * single_rank_reads.dense_bytes - head_bytes
        assert "each rank holds 1/2" in llm.engine.expert_rank_summary()
        if pp == 2:  # each rank's figures, the workers' through the store (published and read every STATS_INTERVAL_S)
            halves = [len(tokens) // 2 for tokens in expert_tokens]
            wanted = [sum(expert_tokens[stage][rank * halves[stage] : (rank + 1) * halves[stage]]) for stage in range(2) for rank in range(2)]
            deadline = time.monotonic() + 30  # a loaded machine may publish late; nothing published fails below
            while [figures.expert_tokens for _, _, figures in llm.engine.expert_rank_stats()] != wanted and time.monotonic() < deadline:
                time.sleep(STATS_INTERVAL_S / 2)
            stats = llm.engine.expert_rank_stats()
            assert [(stage, rank) for stage, rank, _ in stats] == [(0, 0), (0, 1), (1, 0), (1, 1)]
            for stage, rank, figures in stats:
                half = len(expert_tokens[stage]) // 2
                assert figures.expert_tokens == sum(expert_tokens[stage][rank * half : (rank + 1) * half]), (stage, rank)
                assert 0 < figures.combine_s < figures.busy_s, (stage, rank, figures)
            assert_a_lane_per_rank(llm.engine)
    finally:
        llm.engine.close()
        codes = wait_all_exited(children, within_s=10)
    assert codes == [0] * (2 * pp - 1)


def assert_a_lane_per_rank(engine) -> None:
    """The profile's timeline after a pp 2 x ep 2 run: every rank ran every micro-batch of its stage,
    each on a lane of its own in the trace; the stages' figures count the leaders' work once. The
    workers' slices come through the store, published every STATS_INTERVAL_S: gathered until each
    worker's lane has its leader's micro-batches (30 s at most)."""
    deadline = time.monotonic() + 30
    while True:
        engine.gather_rank_timelines()
        timeline = engine.timeline
        trace = chrome_trace(timeline, num_stages=2)["traceEvents"]
        lanes = {tid: sorted((e for e in trace if e["ph"] == "X" and e["tid"] == tid), key=lambda e: e["ts"]) for tid in range(1, 5)}
        micro_batches = {tid: [e["args"]["micro_batch"] for e in lane] for tid, lane in lanes.items()}
        if (micro_batches[1] == micro_batches[2] and micro_batches[3] == micro_batches[4]) or time.monotonic() > deadline:
            break
        time.sleep(STATS_INTERVAL_S / 2)
    names = {e["tid"]: e["args"]["name"] for e in trace if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {
        0: "host scheduler", 1: "stage 0 expert rank 0 (rank 0)", 2: "stage 0 expert rank 1 (rank 1)",
        3: "stage 1 expert rank 0 (rank 2)", 4: "stage 1 expert rank 1 (rank 3)",
    }
    for tid, lane in lanes.items():
        assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-3 for a, b in zip(lane, lane[1:])), names[tid]  # one at a time
    assert micro_batches[1] == micro_batches[2] and micro_batches[3] == micro_batches[4] and set(micro_batches[1]) == set(micro_batches[3])
    for e in lanes[2] + lanes[3] + lanes[4]:  # the workers', on gloo: time in the all-reduces, within the slice
        assert 0 < e["args"]["all_reduce_ms"] * 1000 <= e["dur"], e
    summary = summarize(timeline, pp=2, depth=engine.depth)  # the last stage's slices are the worker's now
    assert summary.tokens_per_s > 0 and all(use.decode_counts for use in summary.stages)
    assert len(timeline.slices) == len(lanes[1]) + len(lanes[3])


def test_rank_zero_loads_only_its_experts_from_the_checkpoint(tiny_model_factory):
    """Stage 0's experts on rank 0 are the first half of the checkpoint's, tensor for tensor."""
    model = tiny_model_factory("mixtral")
    llm = LLM(model=model, pp=1, ep=2, watchdog_s=30, **OPTIONS)
    children = llm.engine.cluster.children
    try:
        moe = llm.engine.pipeline.stages[0].layers[0].moe
        assert moe.experts == range(0, 4) and moe.experts_down.shape[0] == 4
        with safe_open(str(next(model.glob("*.safetensors"))), "pt") as f:
            for index, expert in enumerate(moe.experts):
                stored = f.get_tensor(f"model.layers.0.block_sparse_moe.experts.{expert}.w2.weight").double()
                assert torch.equal(moe.experts_down[index], stored)
    finally:
        llm.engine.close()
        wait_all_exited(children, within_s=10)


def test_an_expert_rank_that_cannot_load_its_share_says_why_in_one_line(tiny_model_factory, tmp_path, capfd):
    """Expert 7, rank 1's, is missing from the checkpoint: rank 1 says so in one line (it printed a
    traceback), and the engine's error names that rank rather than the all-reduce it lost."""
    from safetensors.torch import load_file, save_file

    model = shutil.copytree(tiny_model_factory("mixtral"), tmp_path / "m")
    weights = load_file(model / "model.safetensors")
    del weights["model.layers.1.block_sparse_moe.experts.7.w1.weight"]
    save_file(weights, model / "model.safetensors")
    with pytest.raises(StageFailure, match=re.escape("stage 0 expert rank 1 (rank 1) exited with code 1 while the stages started; its own output says why")):
        LLM(model=model, pp=1, ep=2, watchdog_s=WATCHDOG_S, **OPTIONS)
    said = capfd.readouterr().err
    assert ("[graphrt] stage 0 expert rank 1 (rank 1) could not load its stage: the weights in "
            f"{model} lack 1 tensor the config needs, e.g. 'model.layers.1.block_sparse_moe.experts.7.w1.weight'") in said
    assert "Traceback" not in said, said


def test_killing_an_expert_rank_ends_everything(tiny_model_factory):
    """Stage 1's second expert rank dies mid-stream: the requests fail naming it, every other
    process exits non-zero within the watchdog, and the engine stays failed."""
    llm = LLM(model=tiny_model_factory("qwen3-moe"), pp=2, ep=2, watchdog_s=WATCHDOG_S, **OPTIONS)
    make_synthetic(llm.engine, stage_ms=10)  # stage 0 takes 10 ms, so the requests are still running at the kill
    children = llm.engine.cluster.children  # ranks 1, 2, 3
    errors: list[BaseException] = []
    try:
        thread = generate_in_thread(llm, errors)
        time.sleep(1.0)
        assert thread.is_alive(), "the requests finished before the kill; the test needs a slower stage"
        killed_at = time.monotonic()
        children[2].send_signal(signal.SIGKILL)  # rank 3: stage 1, expert rank 1
        thread.join(WATCHDOG_S + 10)
        assert not thread.is_alive(), "generate did not return after an expert rank died"
        codes = wait_all_exited(children, within_s=WATCHDOG_S + 10 - (time.monotonic() - killed_at))
    finally:
        for child in children:
            child.kill()
    assert len(errors) == 1 and isinstance(errors[0], GraphrtError), errors
    assert "stage 1 expert rank 1 (rank 3) exited with code -9" in str(errors[0])
    assert isinstance(errors[0], StageFailure) or isinstance(errors[0].__cause__, StageFailure)
    assert codes[2] == -9 and all(code not in (None, 0) for code in codes), codes
    with pytest.raises(GraphrtError, match=r"rank 3"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0))


def generate_in_thread(llm: LLM, errors: list) -> threading.Thread:
    def run() -> None:
        try:
            llm.generate(PROMPTS, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
        except BaseException as exc:  # noqa: BLE001 - inspected by the caller
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("how", ["killed", "silent"])
def test_an_expert_rank_of_stage_zero_that_dies_or_goes_silent_ends_everything(tiny_model_factory, how):
    """pp 1: rank 0 loses its expert peer (killed: at once, naming it) or waits the watchdog for it
    (stopped with SIGSTOP, so nothing closes); either way the requests fail and no process outlives
    the watchdog by much."""
    llm = LLM(model=tiny_model_factory("qwen3-moe"), pp=1, ep=2, watchdog_s=WATCHDOG_S, **OPTIONS)
    make_synthetic(llm.engine, stage_ms=10)
    children = llm.engine.cluster.children  # rank 1
    errors: list[BaseException] = []
    try:
        thread = generate_in_thread(llm, errors)
        time.sleep(1.0)
        assert thread.is_alive(), "the requests finished before the failure; the test needs a slower stage"
        stopped_at = time.monotonic()
        children[0].send_signal(signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        thread.join(WATCHDOG_S + 10)
        assert not thread.is_alive(), "generate did not return after an expert rank failed"
        failed_within = time.monotonic() - stopped_at
        codes = wait_all_exited(children, within_s=WATCHDOG_S + 10 - failed_within)
    finally:
        for child in children:
            child.kill()
    assert len(errors) == 1 and isinstance(errors[0], GraphrtError), errors
    if how == "killed":  # a closed connection is seen at once, and the dead process named
        assert failed_within < WATCHDOG_S, failed_within
        assert "lost the connection" in str(errors[0]) and "timed out" not in str(errors[0])
        assert "stage 0 expert rank 1 (rank 1) exited with code -9" in str(llm.engine.failure)
    else:  # whichever wait on the silent rank runs out first names it: rank 0's next send of a
        # micro-batch to it, or the all-reduce it no longer joins (known only as one of the stage's)
        assert WATCHDOG_S * 0.9 < failed_within < WATCHDOG_S + 5, failed_within
        named = (
            "stage 0 expert rank 1 (rank 1) stopped answering: send to it timed out",
            "the expert ranks of stage 0 (ranks 0-1) stopped summing their experts' shares: the all-reduce timed out",
        )
        assert any(reason in str(errors[0]) for reason in named), errors[0]
    assert codes[0] not in (None, 0), codes  # the silent one is stopped by rank 0 (SIGTERM, then SIGKILL)


def test_expert_ranks_stay_up_through_an_idle_spell_longer_than_the_watchdog(tiny_model_factory):
    """Heartbeats reach every rank, stage 0's other expert ranks included, while nothing runs."""
    model = tiny_model_factory("mixtral")
    alone = LLM(model=model, pp=2, **OPTIONS)
    expected = [o.token_ids for o in alone.generate(PROMPTS[:2], GREEDY)]
    alone.engine.close()
    llm = LLM(model=model, pp=2, ep=2, watchdog_s=2.0, **OPTIONS)
    children = llm.engine.cluster.children
    try:
        assert [o.token_ids for o in llm.generate(PROMPTS[:2], GREEDY)] == expected
        time.sleep(5.0)  # two and a half watchdogs with nothing to run
        assert [c.poll() for c in children] == [None] * 3 and llm.engine.failure is None
        assert [o.token_ids for o in llm.generate(PROMPTS[:2], GREEDY)] == expected
    finally:
        llm.engine.close()
        codes = wait_all_exited(children, within_s=10)
    assert codes == [0, 0, 0]


def test_each_stage_runs_its_leaders_kernel_choices_on_every_rank(tiny_model_factory, monkeypatch):
    """With the matmul forms chosen by timing (not forced, as the rest of the suite forces them),
    a stage's other expert ranks run its leader's choices rather than timing their own."""
    monkeypatch.delenv("GRAPHRT_MATMUL", raising=False)
    options = {**OPTIONS, "dtype": "float32"}  # float64 has one matmul form only, so nothing would be timed
    llm = LLM(model=tiny_model_factory("qwen3-moe"), pp=2, ep=2, watchdog_s=30, **options)
    children = llm.engine.cluster.children
    try:
        store = llm.engine.cluster.link.store
        chosen = [json.loads(store.get(f"kernels/rank-{rank}")) for rank in range(4)]
        paths = [{c["name"]: c["path"] for c in rank["matmuls"]["choices"]} for rank in chosen]
        assert paths[1] == paths[0] and chosen[1]["ops"] == chosen[0]["ops"]
        # the last stage's other rank has no LM head to choose for: the rest is its leader's
        assert "lm_head" in paths[2] and paths[3] == {name: path for name, path in paths[2].items() if name != "lm_head"}
        assert chosen[3]["ops"] == chosen[2]["ops"]
        # the leaders timed their matmuls; the other ranks timed none (a follower timing its own fails here)
        assert [rank["matmuls"]["measure_s"] > 0 for rank in chosen] == [True, False, True, False]
        assert chosen[0]["matmuls"] == llm.engine.pipeline.kernels[0].matmuls.to_json()
    finally:
        llm.engine.close()
        wait_all_exited(children, within_s=10)


def test_expert_parallelism_is_refused_where_it_cannot_run(tiny_model_factory):
    with pytest.raises(ValueError, match=r"llama.*has none; drop --ep|has none; drop --ep"):
        LLM(model=tiny_model_factory("llama-gqa-tied"), ep=2, **OPTIONS)
    with pytest.raises(ValueError, match=r"--ep 3 must divide the model's 8 routed experts \(config.json's num_local_experts\).*\[1, 2, 4, 8\]"):
        LLM(model=tiny_model_factory("mixtral"), ep=3, **OPTIONS)
    with pytest.raises(ValueError, match="n_routed_experts"):
        LLM(model=tiny_model_factory("deepseek-v3"), ep=3, **OPTIONS)
    with pytest.raises(ValueError, match="speculative decoding with --ep"):
        EngineConfig(ep=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="ep must be a positive integer"):
        EngineConfig(ep=0)
    assert EngineConfig(ep=2).procs  # the expert ranks are processes


def test_devices_under_ep_name_one_per_rank_of_one_kind():
    """--devices names each stage's device, but under --ep each rank's, stage-major."""
    with pytest.raises(
        ValueError, match=r"^--devices names 2 devices for --pp 2 --ep 2: give one per rank, 4, stage-major \(rank = stage \* ep \+ expert rank\)$"
    ):
        EngineConfig(pp=2, ep=2, devices=["cuda:0", "cuda:1"])  # one per stage is one per rank only without --ep
    with pytest.raises(ValueError, match="--devices names 1 devices for --pp 1 --ep 2: give one per rank, 2,"):
        EngineConfig(pp=1, ep=2, devices=["cpu"])
    with pytest.raises(ValueError, match="--devices names 4 devices for 2 stages; give one per stage"):
        EngineConfig(pp=2, devices=["cpu"] * 4)
    with pytest.raises(ValueError, match=r"^--devices cuda:0,cuda:1,cpu,cpu mixes CUDA and CPU devices; under --ep every rank"):
        EngineConfig(pp=2, ep=2, devices=["cuda:0", "cuda:1", "cpu", "cpu"])
    with pytest.raises(ValueError, match=r"^--devices cuda:0,cpu mixes CUDA and CPU devices; with --procs every rank"):
        EngineConfig(pp=2, procs=True, devices=["cuda:0", "cpu"])
    assert EngineConfig(pp=2, devices=["cuda:0", "cpu"]).devices == ["cuda:0", "cpu"]  # stages of one process may mix
    with pytest.raises(ValueError, match=r"^--devices: 'gpu0' is not a device; name each as cpu, cuda or cuda:N$"):
        EngineConfig(pp=2, ep=2, devices=["gpu0", "cpu", "cpu", "cpu"])
    assert EngineConfig(pp=2, ep=2, devices=["cpu"] * 4).stage_devices() == ["cpu", "cpu"]


def test_each_worker_takes_its_ranks_device_from_the_list(monkeypatch):
    """The engine's command line reaches every worker; rank 3 of --pp 2 --ep 2 (stage 1's second
    expert rank) takes the fourth device."""
    from graphrt.distributed.worker import parse_options

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    options = parse_options(["--model", "tiny", "--pp", "2", "--ep", "2", "--devices", "cuda:4, cuda:5,cuda:6,cuda:7"])
    assert (options.device, options.ep) == ("cuda:7", 2)


def test_ranks_that_disagree_about_ep_are_refused_naming_it(tiny_model_factory):
    """torchrun's way, two ranks: rank 0 asks for one stage of two expert ranks, rank 1 was started
    without --ep (so it takes itself for stage 1 of two)."""
    model = str(tiny_model_factory("mixtral"))
    port = free_port()
    engine_args = ["generate", "--model", model, "--pp", "1", "--ep", "2", "--dtype", "float64", "--prompt", "hi", "--watchdog-s", "5"]
    ranks = [start_rank(0, port, engine_args), start_rank(1, port, ["--model", model])]
    try:
        logs = [rank.communicate(timeout=90)[0] for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    assert [rank.returncode for rank in ranks] == [1, 1], logs
    # each names rank 1 as it sees it: the engine as stage 0's second expert rank, rank 1 as stage 1
    assert "stage 0 expert rank 1 (rank 1) disagrees with the engine about ep" in logs[0], logs[0]
    assert "(rank 1) disagrees with the engine about ep" in logs[1] and "the engine has 2, this rank 1" in logs[1], logs[1]


def test_expert_rank_metrics_are_labelled_by_stage_and_rank():
    from graphrt.server.metrics import expert_ranks

    families = {f.name: f for f in expert_ranks(((0, 0, 2.0, 0.5, 10), (0, 1, 2.5, 0.25, 30), (1, 0, 1.0, 0.1, 7), (1, 1, 1.5, 0.2, 9)))}
    tokens = {(s.labels["stage"], s.labels["rank"]): s.value for s in families["graphrt_ep_rank_expert_tokens"].samples}
    assert tokens == {("0", "0"): 10, ("0", "1"): 30, ("1", "2"): 7, ("1", "3"): 9}
    combine = {s.labels["rank"]: s.value for s in families["graphrt_ep_combine_seconds"].samples}
    assert combine == {"0": 0.5, "1": 0.25, "2": 0.1, "3": 0.2}
