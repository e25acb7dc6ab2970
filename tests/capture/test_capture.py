"""`graphrt capture`, the graph cache, and replay through static buckets."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from click.testing import CliRunner

from graphrt import LLM, SamplingParams
from graphrt.capture.buckets import BucketPlan, default_buckets, parse_buckets
from graphrt.capture.capture import as_read_by_graph, random_decode_rows
from graphrt.capture.manifest import IDENTITY_FIELDS, MANIFEST_NAME, write_manifest
from graphrt.capture.report import layer_span
from graphrt.cli import main
from graphrt.model import SCRATCH_BLOCK
from graphrt.runtime.ring import build_inputs
from graphrt.runtime.step import ScheduledStep
from graphrt.tools.synthetic import write_char_tokenizer

FIELDS = set(IDENTITY_FIELDS) | {"schema_version", "created", "graphrt", "model_dir", "kv_cache_blocks", "kv_cache_bytes", "null_reasons", "graphs"}
GRAPH_FIELDS = {"stage", "bucket", "mode", "warmup_ms", "rehearsal_ms", "first_calls_ms", "capture_ms", "pool_bytes", "nodes", "max_abs_error", "max_abs_error_allowed", "note"}


def run_cli(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_default_buckets():
    assert default_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert default_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert default_buckets(3) == [1, 2, 3]
    plan = BucketPlan((1, 2, 4, 8))
    assert [plan.bucket_for(n) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    with pytest.raises(ValueError, match="does not fit"):
        plan.bucket_for(9)
    assert parse_buckets("8,1,2,2") == [1, 2, 8]
    with pytest.raises(ValueError, match="comma-separated positive integers"):
        parse_buckets("1,x")


@pytest.fixture(scope="module")
def default_cache(default_model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("graphs") / "cache"
    result = run_cli("capture", "--pp", "2", "--max-batch", "8", "--dtype", "float32", "--out", out)
    assert result.exit_code == 0, result.output
    assert "wrote" in result.output
    return out


def test_capture_writes_every_manifest_field(default_cache):
    manifest = json.loads((default_cache / MANIFEST_NAME).read_text())
    assert FIELDS <= set(manifest)
    assert manifest["pp"] == 2 and manifest["buckets"] == [1, 2, 4, 8] and manifest["dtype"] == "float32"
    assert [s["layers"] for s in manifest["stages"]] == [[0, 19], [19, 30]]
    assert len(manifest["graphs"]) == 2 * 4
    for graph in manifest["graphs"]:
        assert set(graph) == GRAPH_FIELDS
    # CUDA-only fields are null on this CPU, each with its reason.
    assert all(g["pool_bytes"] is None and g["nodes"] is None for g in manifest["graphs"])
    assert {"pool_bytes", "nodes"} <= set(manifest["null_reasons"])
    verified = [g for g in manifest["graphs"] if g["max_abs_error"] is not None]
    assert {g["bucket"] for g in verified} == {8} and all(g["max_abs_error"] < 0.1 for g in verified)
    inspect = run_cli("capture", "--inspect", default_cache)
    assert inspect.exit_code == 0 and "pp=2: cpu layers 0-18, cpu layers 19-29" in inspect.output
    assert (layer_span(3, 4), layer_span(0, 3)) == ("layer 3", "layers 0-2")  # a one-layer stage read "layers 3-3"


def test_generate_with_cache_matches_without(default_cache):
    args = ["generate", "--chat", "--prompt", "Name a color.", "--max-tokens", "16"]
    with_cache = run_cli(*args, "--cache", default_cache)
    without = run_cli(*args, "--pp", "2", "--dtype", "float32")
    assert with_cache.exit_code == 0 and without.exit_code == 0
    assert with_cache.output.splitlines()[0] == without.output.splitlines()[0] != ""
    assert "pp=2 depth=0" in with_cache.stderr  # the cache's pp was applied, not the default 1
    assert f"graph cache {default_cache}" in with_cache.stderr and "graph cache" not in without.stderr


def stale(cache: Path, tmp_path: Path, edit) -> Path:
    copy = Path(shutil.copytree(cache, tmp_path / "stale"))
    manifest = json.loads((copy / MANIFEST_NAME).read_text())
    edit(manifest)
    (copy / MANIFEST_NAME).write_text(json.dumps(manifest))
    return copy


@pytest.mark.parametrize(
    "edit, extra_args, message",
    [
        (lambda m: None, ["--dtype", "float64"], "dtype: cache has 'float32', this run has 'float64'"),
        (lambda m: None, ["--pp", "3"], "pp: cache has 2, this run has 3"),
        (lambda m: None, ["--buckets", "1,2"], "buckets: cache has [1, 2, 4, 8], this run has [1, 2]"),
        (lambda m: m.update(torch="2.5.0"), [], "torch: cache has '2.5.0', this run has"),
        (lambda m: m.update(device_names=["NVIDIA H200", "NVIDIA H200"]), [], "device_names: cache has ['NVIDIA H200'"),
    ],
)
def test_stale_cache_names_the_field(default_cache, tmp_path, edit, extra_args, message):
    cache = stale(default_cache, tmp_path, edit)
    result = run_cli("generate", "--prompt", "hi", "--cache", cache, *extra_args)
    assert result.exit_code == 1
    assert message in result.output and f"graphrt capture --out {cache}" in result.output
    assert result.output.count("\n") == 1 and "Traceback" not in result.output


def test_a_max_batch_the_cache_does_not_have_is_refused(default_cache):
    """The cache's buckets decide the graphs: a --max-batch beside them would be dropped unseen."""
    result = run_cli("generate", "--prompt", "hi", "--cache", default_cache, "--max-batch", "16")
    assert result.exit_code == 1 and "max_batch 16 differs from the graph cache" in result.output
    assert "whose largest bucket is 8" in result.output and f"graphrt capture --out {default_cache} --max-batch 16" in result.output
    assert run_cli("generate", "--prompt", "hi", "--max-tokens", "2", "--cache", default_cache, "--max-batch", "8").exit_code == 0


def test_cache_from_another_model_is_refused_naming_the_folder_it_was_captured_from(default_cache, tiny_model_factory):
    """Not advising a capture into it, which would overwrite another model's cache."""
    result = run_cli("generate", "--prompt", "hi", "--cache", default_cache, "--model", tiny_model_factory())
    captured_from = json.loads((default_cache / MANIFEST_NAME).read_text())["model_dir"]
    assert result.exit_code == 1 and "model_fingerprint: cache has" in result.output, result.output
    assert f"it was captured from {captured_from}: pass --model {captured_from}, or capture this model's graphs into another folder" in result.output
    assert f"--out {default_cache}" not in result.output


def test_a_cache_alone_runs_the_model_it_was_captured_from(tiny_model_factory, tmp_path):
    """As pp and dtype, the model comes from the cache: before, the default model was checked against it."""
    model = write_char_tokenizer(shutil.copytree(tiny_model_factory(), tmp_path / "model"))
    assert run_cli("capture", "--model", model, "--out", tmp_path / "cache", "--max-batch", "2").exit_code == 0
    alone = run_cli("generate", "--prompt", "hi", "--max-tokens", "3", "--cache", tmp_path / "cache")
    named = run_cli("generate", "--prompt", "hi", "--max-tokens", "3", "--cache", tmp_path / "cache", "--model", model)
    assert alone.exit_code == 0 and alone.stdout == named.stdout != "", alone.output


def test_a_cache_alone_serves_the_model_it_was_captured_from(tiny_model_factory, tmp_path):
    """`graphrt serve --cache DIR` resolves the model as generate does (it took the default model)."""
    model = write_char_tokenizer(shutil.copytree(tiny_model_factory(), tmp_path / "tiny-model"))
    assert run_cli("capture", "--model", model, "--out", tmp_path / "cache", "--max-batch", "2").exit_code == 0
    server = subprocess.Popen([sys.executable, "-m", "graphrt", "serve", "--cache", str(tmp_path / "cache"), "--port", "0"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen = []
        for line in server.stdout:
            seen.append(line)
            if found := re.search(r"serving (\S+) on (http://\S+)", line):
                break
        assert found and found.group(1) == "tiny-model", "".join(seen)
        answer = httpx.post(f"{found.group(2)}/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=60)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3, answer.text
    finally:
        server.send_signal(signal.SIGTERM)
        server.communicate(timeout=60)
    assert server.returncode == 0


def test_a_cache_whose_model_folder_is_gone_says_so(default_cache, tmp_path):
    cache = stale(default_cache, tmp_path, lambda m: m.update(model_dir=str(tmp_path / "moved-away")))
    result = run_cli("generate", "--prompt", "hi", "--cache", cache)
    assert result.exit_code == 1 and result.output.count("\n") == 1, result.output
    assert f"the graph cache {cache} was captured from {tmp_path / 'moved-away'}, which is not here; pass --model" in result.output


def test_a_cache_with_expert_parallelism_is_refused_before_anything_starts(default_cache, tmp_path):
    captured = run_cli("capture", "--ep", "2", "--out", tmp_path / "ep")
    assert captured.exit_code == 2 and "a graph cache with --ep is not supported yet" in captured.output
    assert not (tmp_path / "ep").exists()
    used = run_cli("generate", "--prompt", "hi", "--cache", default_cache, "--ep", "2")
    assert used.exit_code == 1 and "a graph cache (--cache, graphrt capture) with --ep is not supported yet" in used.output
    assert "stops" not in used.stderr  # no expert rank was started to be stopped


def edited(**fields):
    """A damage that sets manifest fields."""
    return lambda path: path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda p: p.write_text(p.read_text()[:100]), "is not valid JSON (truncated or corrupt)"),
        (lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "schema_version": 99})), "has schema version 99, this graphrt reads version 1"),
        (lambda p: p.unlink(), "holds no manifest.json"),
        # edited by hand: each field named with what it must be, by generate and by --inspect alike
        (edited(buckets="1,2,4"), "is damaged: buckets is '1,2,4', not a non-empty, increasing list of positive integers"),
        (edited(buckets=[]), "is damaged: buckets is [], not a non-empty"),
        (edited(stages="cpu"), "is damaged: stages is 'cpu', not a list of"),
        (edited(pp="2"), "is damaged: pp is '2', not a positive integer"),
        (edited(pp=3), "is damaged: it lists 2 stages for pp 3"),
        (edited(max_model_len="8192"), "is damaged: max_model_len is '8192', not a positive integer"),
        (lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "graphs": [{**g, "max_abs_error": "small"} for g in json.loads(p.read_text())["graphs"]]})),
         "is damaged: graphs[0].max_abs_error is 'small', not a number or null"),
        (lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "graphs": [{**json.loads(p.read_text())["graphs"][0], "stage": 9}]})),
         "is damaged: graphs[0] is stage 9, bucket 1, which pp 2 and buckets [1, 2, 4, 8] do not have"),
    ],
)
@pytest.mark.parametrize("command", [("generate", "--prompt", "hi", "--cache"), ("capture", "--inspect")])
def test_damaged_manifest(default_cache, tmp_path, damage, message, command):
    cache = Path(shutil.copytree(default_cache, tmp_path / "damaged"))
    damage(cache / MANIFEST_NAME)
    result = run_cli(*command, cache)
    assert result.exit_code == 1 and message in result.output and result.output.count("\n") == 1, result.output


def test_a_cache_path_that_is_no_cache_folder_says_what_it_is(default_cache, tmp_path):
    manifest = default_cache / MANIFEST_NAME
    for args, message in [
        (("capture", "--inspect", manifest), f"{manifest} is the cache's manifest.json; pass the graph cache's folder ({default_cache})"),
        (("capture", "--inspect", tmp_path / "nope"), f"the graph cache {tmp_path / 'nope'} does not exist; make it with `graphrt capture --out"),
        (("generate", "--prompt", "hi", "--cache", tmp_path / "nope"), "does not exist"),
    ]:
        result = run_cli(*args)
        assert result.exit_code == 1 and message in result.output and result.output.count("\n") == 1, result.output


def test_unwritable_output_folder(tmp_path, tiny_model_factory):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    result = run_cli("capture", "--model", tiny_model_factory(), "--out", blocker / "cache")
    assert result.exit_code == 1 and "cannot write the graph cache" in result.output
    assert result.output.count("\n") == 1


def test_the_report_shows_warm_up_apart_from_recording():
    """First calls compile the Triton kernels (into the cache's empty TRITON_CACHE_DIR), which a start
    with the cache skips; recording is paid on every start. A cache written before the two were apart
    still reads, and says what its one figure holds."""
    from graphrt.capture.report import manifest_table

    manifest = {
        "model_fingerprint": "0" * 64, "architecture": "LlamaForCausalLM", "dtype": "bfloat16", "pp": 1,
        "stages": [{"layers": [0, 2], "device": "cuda:0"}], "backend": "cuda", "kernels": "triton", "buckets": [1, 2],
        "block_size": 16, "torch": "2.9", "triton": "3.5", "cuda": "12.8", "driver": "12.8",
        "graphs": [
            {"stage": 0, "bucket": 1, "mode": "graph", "warmup_ms": 9.5, "capture_ms": 3.0, "rehearsal_ms": 5.0, "first_calls_ms": 0.5},
            {"stage": 0, "bucket": 2, "mode": "graph", "warmup_ms": 1500.0, "capture_ms": 4.0, "rehearsal_ms": 1300.0,
             "first_calls_ms": 1250.0},
        ],
    }
    table = manifest_table(manifest)
    assert "warm-up 1.51 s: first calls 1.25 s (Triton" in table and "recording 0.01 s" in table
    assert "most at stage 0 bucket 2, 1.25 s), rehearsal checks 0.05 s, warm-up runs 0.20 s;" in table
    assert "    0      2 graph   1500.0      4.0" in table
    for graph in manifest["graphs"]:
        del graph["rehearsal_ms"], graph["first_calls_ms"]
    assert "warm-up 1.51 s (Triton compile and autotuning on first calls, rehearsal), recording 0.01 s" in manifest_table(manifest)
    for graph in manifest["graphs"]:
        del graph["warmup_ms"]
    old = manifest_table(manifest)
    assert "capture 0.01 s, warm-up and Triton compile included" in old
    assert "    0      2 graph        -      4.0" in old


def test_manifest_is_never_half_written(tmp_path):
    write_manifest(tmp_path, {"schema_version": 1, "ok": True})
    with pytest.raises(TypeError):
        write_manifest(tmp_path, {"schema_version": 1, "bad": object()})  # fails mid-write
    assert json.loads((tmp_path / MANIFEST_NAME).read_text()) == {"schema_version": 1, "ok": True}
    assert os.listdir(tmp_path) == [MANIFEST_NAME]
    mask = os.umask(0o022)
    try:
        write_manifest(tmp_path, {"schema_version": 1})
    finally:
        os.umask(mask)
    assert (tmp_path / MANIFEST_NAME).stat().st_mode & 0o777 == 0o644  # as the cache's other files, not mkstemp's 0600


def test_padding_rows_are_harmless(tiny_model_factory):
    """5 rows padded to bucket 8 give the eager logits, and only the scratch block is written besides their slots."""
    llm = LLM(model=tiny_model_factory("qwen2-qkv-bias"), pp=2, dtype="float64", buckets=[8], kv_cache_tokens=1024)
    engine = llm.engine
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    seqs = [engine.add_request(list(range(1 + i, 12 + 3 * i)), params) for i in range(6)]
    while any(s.in_prefill for s in seqs):
        engine.run(engine.scheduler.schedule())  # prefill only: every prompt's K/V is in the cache
    for seq in seqs:
        seq.output_ids.append(7)  # the token each decodes next
    decode, bystander = seqs[:5], seqs[5]
    touched = torch.zeros(engine.allocator.num_blocks, dtype=torch.bool)
    touched[[b for seq in decode for b in seq.block_ids]] = True
    untouched = ~touched
    untouched[SCRATCH_BLOCK] = False  # padding rows may scribble there, and only there
    for cache in engine.pipeline.caches:  # a sentinel any stray write would overwrite
        cache.k[:, untouched] = 123.0
        cache.v[:, untouched] = 123.0
    step = ScheduledStep(decode, [1] * 5, is_prefill=False)
    token_ids, meta = build_inputs(step, engine.config.block_size)
    before = [(c.k.clone(), c.v.clone()) for c in engine.pipeline.caches]
    eager = engine.pipeline.forward(token_ids, meta)  # no graphs: a plain forward of 5 rows
    written = [(c.k.clone(), c.v.clone()) for c in engine.pipeline.caches]
    for (k, v), cache in zip(before, engine.pipeline.caches):
        cache.k.copy_(k)
        cache.v.copy_(v)
    padded = engine.pipeline.forward(token_ids, meta, engine.graphs)  # through bucket 8
    torch.testing.assert_close(padded, eager, rtol=0, atol=1e-12)
    for (k0, v0), (k1, v1), cache in zip(before, written, engine.pipeline.caches):
        # The five rows wrote the same K/V either way (up to rounding of a different batch shape)...
        torch.testing.assert_close(cache.k[:, touched], k1[:, touched], rtol=0, atol=1e-12)
        torch.testing.assert_close(cache.v[:, touched], v1[:, touched], rtol=0, atol=1e-12)
        # ...and every other block, the bystander's included, is bit-for-bit what it was.
        assert torch.equal(cache.k[:, untouched], k0[:, untouched]) and torch.equal(cache.v[:, untouched], v0[:, untouched])
    assert untouched[bystander.block_ids].all()


def test_verification_reads_the_graphs_width_and_it_is_the_same_function(tiny_model_factory):
    """On CUDA a graph is verified against an eager forward over its own block-table width (other
    widths round differently in 16 bits); in float64 the wide and the narrow forward must agree."""
    llm = LLM(model=tiny_model_factory("llama3-rope"), pp=2, dtype="float64", kv_cache_tokens=1024)
    engine = llm.engine
    for stage, cache in zip(engine.pipeline.stages, engine.pipeline.caches):
        num_blocks, block_size = cache.k.shape[1], cache.k.shape[2]
        x, meta = random_decode_rows(stage, 6, num_blocks, block_size, seed=stage.index, max_context=40)
        narrow = meta.block_tables.shape[1]
        wide = as_read_by_graph(meta, 4 * narrow)
        assert wide.seq_lens_host is None and meta.seq_lens_host is not None
        assert torch.equal(wide.block_tables[:, :narrow], meta.block_tables)
        assert (wide.block_tables[:, narrow:] == SCRATCH_BLOCK).all()
        torch.testing.assert_close(stage(x, wide, cache), stage(x, meta, cache), rtol=0, atol=1e-12)


def test_decode_batches_never_exceed_the_largest_bucket(tiny_model_factory):
    llm = LLM(model=tiny_model_factory(), buckets=[1, 2], kv_cache_tokens=2048, dtype="float64")
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    prompts = [[i + 2] * (3 + i) for i in range(5)]
    sizes = []
    launch = llm.engine.ring.launch
    llm.engine.ring.launch = lambda slot, step, *rest: sizes.append((step.is_prefill, len(step.seqs))) or launch(slot, step, *rest)
    together = llm.generate(prompts, params)
    assert max(n for prefill, n in sizes if not prefill) == 2
    assert [o.token_ids for o in together] == [llm.generate(p, params)[0].token_ids for p in prompts]


class UncountableGraph:
    """A captured graph whose raw handle cannot be had (as with torch's default keep_graph=False)."""

    def raw_cuda_graph(self) -> int:
        raise RuntimeError("Cannot access raw graph: keep_graph must be True")


class NullGraph:
    def raw_cuda_graph(self) -> int:
        return 0  # no graph: cudaGraphGetNodes refuses it (here, also for want of a driver)


@pytest.mark.parametrize("graph", [UncountableGraph(), NullGraph()], ids=["raw-graph-refused", "null-graph"])
def test_counting_graph_nodes_never_fails_a_capture(graph):
    pytest.importorskip("cuda.bindings.runtime")
    from graphrt.capture.cuda_info import graph_node_counts

    counts, why = graph_node_counts(graph)
    assert counts is None
    assert why.startswith("could not count graph nodes: ")
    if isinstance(graph, UncountableGraph):
        assert "keep_graph must be True" in why


def test_a_context_length_that_is_not_whole_blocks_starts(tiny_model_factory):
    """Capture's verification rows stay inside the rotary table when max_model_len (52) is not a
    multiple of the block size (16): the block table reaches position 63, the model only 51."""
    llm = LLM(model=tiny_model_factory(), pp=2, max_model_len=52, kv_cache_tokens=10240, max_num_seqs=4, max_batch=4)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 4
    llm.engine.close()


def test_an_eager_pair_verifies_on_every_matmul_path_the_timing_can_pick(default_model, monkeypatch):
    """F.linear (MKL) rounds 3 rows otherwise than 4: SmolLM2 in float32 with every matmul on it
    failed its bucket-4 verification by 1.25e-4 of the largest logit against a tolerance of 1e-4,
    where the timing picks that path for some shapes on a busy machine."""
    monkeypatch.setenv("GRAPHRT_MATMUL", "dense")
    llm = LLM(model=default_model, dtype="float32", max_batch=4, max_num_seqs=4, load_tokenizer=False)
    [verified] = [r for r in llm.engine.graph_records if r.max_abs_error is not None]
    assert verified.bucket == 4 and 0 < verified.max_abs_error
    llm.engine.close()


@pytest.mark.parametrize("off, fails", [(5e-4, False), (2e-3, True)])
def test_an_eager_pairs_check_allows_rounding_but_not_a_fault(tiny_model_factory, monkeypatch, off, fails):
    """Five parts in ten thousand of the largest output is the rounding a padding row can bring
    (1.25e-4 measured); two in a thousand is a fault."""
    from graphrt.capture.capture import CaptureError
    from graphrt.capture.graphs import EagerStageGraph

    replay = EagerStageGraph.replay
    monkeypatch.setattr(EagerStageGraph, "replay", lambda self, max_seq_len=None: replay(self, max_seq_len) * (1 + off))
    if fails:
        with pytest.raises(CaptureError, match=r"stage 0, bucket 4: replay differs from eager by .* the graph is not safe to use"):
            LLM(model=tiny_model_factory(), dtype="float32", max_batch=4, max_num_seqs=4, load_tokenizer=False)
    else:
        LLM(model=tiny_model_factory(), dtype="float32", max_batch=4, max_num_seqs=4, load_tokenizer=False).engine.close()


def test_a_cpu_capture_says_what_it_measured_and_checked(default_cache):
    """No graph is recorded on a CPU: the summary gives the check of each stage's largest bucket with
    its tolerance, each stage's matmul paths and the ops' kernels, not a table of CUDA zeros."""
    result = run_cli("capture", "--inspect", default_cache)
    assert result.exit_code == 0, result.output
    manifest = json.loads((default_cache / MANIFEST_NAME).read_text())
    for stage in (0, 1):
        [checked] = [g for g in manifest["graphs"] if g["stage"] == stage and g["max_abs_error"] is not None]
        assert checked["bucket"] == 8 and checked["max_abs_error"] <= checked["max_abs_error_allowed"]
        assert (f"stage {stage}, bucket 8: replay over the static buffers (with a padding row) against the stage's plain forward, "
                f"max difference {checked['max_abs_error']:.2g} (allowed {checked['max_abs_error_allowed']:.2g})") in result.output
        paths = ", ".join(f"{c['name']} {c['path']}" for c in manifest["matmuls"][stage]["choices"])
        assert f"stage {stage} matmuls, fastest at 1 and 8 rows (measured in " in result.output and paths in result.output
    assert "ops: paged_decode_attention " in result.output and "warm ms" not in result.output and "Triton" not in result.output
