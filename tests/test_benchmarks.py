"""Every script in benchmarks/ still runs and prints what it measures (issue 30).

Each script runs as a subprocess, as `python benchmarks/NAME.py` is run, at its smallest settings
and on a tiny random model wherever it takes --model: a check that the script works, not a
measurement (no figure is held against a bar; only that the metric's line is there, with a number).
Scripts that need a tokenizer (chat prompts, text over HTTP) get a tiny model with the default
model's tokenizer (vocabulary 49152), so no test here loads the default pretrained model.

Not run further than their --help, each for the reason in its test: peer_vllm.py (vLLM's CPU
build in a venv of its own, installed on its first run), lm_eval_parity.py (lm-eval, in
.venv-eval) and mutation.py (cosmic-ray, and hours of mutants). The GPU benchmarks run their
`--device cpu` self-check, and without CUDA must say so and exit 3 (that check in this process).
The file takes about 2.5 minutes on two cores, most of it interpreters and engines starting.
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from graphrt.tools.synthetic import make_tiny_model

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"
HELPER_MODULES = {"process_tree.py"}  # imported by benchmarks, not a benchmark itself
NUMBER = r"[-+]?[\d,]+(?:\.\d+)?"  # 12, 1,234, 0.5, -3.0, +1.5
NO_CUDA_EXIT = 3  # graph_replay_gpu.py, kernels_gpu.py, pp_throughput_gpu.py without a GPU
TESTED: set[str] = set()  # the scripts a test below runs, filled as this module is read


def covers(*names: str) -> None:
    TESTED.update(f"{name}.py" for name in names)


def run(script: str, *args, expect: int = 0, timeout: float = 300, env: dict | None = None) -> str:
    """Run benchmarks/SCRIPT.py with these arguments; its stdout and stderr together."""
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / f"{script}.py"), *map(str, args)], capture_output=True, text=True,
        timeout=timeout, cwd=REPO, env={**os.environ, **(env or {})},
    )
    output = done.stdout + done.stderr
    assert done.returncode == expect, f"{script}.py exited {done.returncode}, not {expect}:\n{output[-4000:]}"
    return output


def imported(script: str):
    """benchmarks/SCRIPT.py as a module of this process (they import each other by bare name)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(script)
    finally:
        sys.path.remove(str(BENCHMARKS))


def has(output: str, *patterns: str) -> None:
    """Each pattern (a regex, NUMBER standing for a number) matches a line of the output."""
    for pattern in patterns:
        assert re.search(pattern.replace("#", NUMBER), output, re.MULTILINE), f"no line matching {pattern!r} in:\n{output[-4000:]}"


@pytest.fixture(scope="module")
def tiny(tiny_model_factory) -> Path:
    return tiny_model_factory()


@pytest.fixture(scope="module")
def long_tiny(tmp_path_factory) -> Path:
    """The tiny model with room for 512 positions: openmp_teams.py's contexts reach 300 tokens, and
    its bench rounds' prompts 256 with 128 more out."""
    return make_tiny_model(tmp_path_factory.mktemp("long-tiny"), "llama-gqa-tied", overrides={"max_position_embeddings": 512})


@pytest.fixture(scope="module")
def talking_tiny(default_model, tmp_path_factory) -> Path:
    """A tiny random Llama with the default model's tokenizer and chat template (so its vocabulary), and
    room for spec_decode_bench.py's prompts of source code."""
    folder = make_tiny_model(
        tmp_path_factory.mktemp("talking-tiny"), "llama-gqa-tied",
        overrides={"vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2, "max_position_embeddings": 2048},
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (default_model / name).exists():
            shutil.copy(default_model / name, folder)
    return folder


# ---------------------------------------------------------------- kernels, no model


covers("nvtx_overhead")


def test_nvtx_overhead():
    out = run("nvtx_overhead", "--iterations", 100)
    has(out, r"^default +# +no$", r"^forced +# +yes$", r"^NVTX_DISABLE=1 +# +no$")


covers("elementwise_cpu")


def test_elementwise_cpu(built_cpu_kernels):
    out = run("elementwise_cpu", "--rows", 1, "--calls", 1)
    for dtype in ("float32", "bfloat16"):
        for op in ("rms_norm", "apply_rotary", "silu_and_mul"):
            has(out, rf"^\| {dtype} \| {op} \| 1 \| # \| # \| #x \|$")


covers("paged_attention_cpu")


def test_paged_attention_cpu(built_cpu_kernels):
    out = run("paged_attention_cpu", "--batch", 1, "--rounds", 1, "--calls", 1, "--threads", 1)
    has(out, r"^\| float32 \| 20-200 \| 1 \| # \| # \| #x \| # \|$", r"^\| bfloat16 \| 120-382 \| 1 \| # \| # \| #x \| # \|$")


covers("prefill_attention_cpu")


def test_prefill_attention_cpu(built_cpu_kernels):
    out = run("prefill_attention_cpu", "--chunks", "1x16", "--rounds", 1)
    has(out, r"^\| float32 \| 1x16 \| # \| # \| #x \| # \|$", r"^\| bfloat16 \| 1x16 \| # \| # \| #x \| # \|$")


covers("matmul_cpu")


def test_matmul_cpu():
    # Its shapes are the default model's, fixed (30 weights each, more than the L3 cache): ~15 s.
    out = run("matmul_cpu", "--dtype", "float32", "--rows", 1, "--repeats", 1)
    has(out, r"reading a 256 MB tensor: # GB/s")
    for shape in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"):
        has(out, rf"^\| {shape} \| 1 \| #, #, #")


# ---------------------------------------------------------------- the GPU benchmarks' CPU self-checks


covers("graph_replay_gpu", "kernels_gpu", "pp_throughput_gpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU these measure on it (scripts/gpu_check.sh runs them)")
@pytest.mark.parametrize("script", ["graph_replay_gpu", "kernels_gpu", "pp_throughput_gpu"])
def test_gpu_benchmark_without_cuda_says_so(script, capsys):
    # In this process (each script's `sys.exit(main())` passes the code on): a subprocess would
    # spend its seconds importing torch to print two lines.
    assert imported(script).main([]) == NO_CUDA_EXIT
    has(capsys.readouterr().out, rf"^{script}\.py measures on a GPU", r"no CUDA device: torch .* sees none")


def test_graph_replay_gpu_on_cpu():
    # The cache must hold the greedy check's prompts (up to 33 tokens + 16): one bucket of 64 tokens.
    out = run("graph_replay_gpu", "--device", "cpu", "--buckets", 1, "--repeats", 1, "--context", 64, "--max-model-len", 128)
    has(out, r"^\| 1 \| # \| # \| #x \| # \| # \| #% \| #% \| #e[+-]\d+ \|$", r"greedy tokens with graphs equal eager: yes")


def test_kernels_gpu_through_the_triton_interpreter():
    pytest.importorskip("triton")
    out = run("kernels_gpu", "--device", "cpu", "--dtype", "float32", "--batch-sizes", 1, "--contexts", 16, "--repeats", 1)
    for kernel in ("rms_norm \\+ residual", r"apply_rotary \(q, k\)", "silu_and_mul", "write_kv", "paged_decode_attention"):
        has(out, rf"^\| {kernel} \| .* \| #e[+-]\d+ \| # \| # \| #x \| # \| #% \|$")


def test_pp_throughput_gpu_on_cpu():
    out = run("pp_throughput_gpu", "--device", "cpu", "--pp", 1, "--batches", 1, "--prompt-len", 1, "--output-len", 2)
    has(out, r"^\| 1 \| # \| # \| \w+ \| 1 \| # \| # \| #x \| # \| #% \| # \| #% \| #% \| # \|$")


# ---------------------------------------------------------------- the engine, offline


covers("host_overhead")


def test_host_overhead():
    out = run("host_overhead", "--pp", 1, "--requests", 1, "--tokens", 2, "--stage-ms", 0)
    has(out, r"^host time per stage launch: # us", r"^host time per micro-batch launch: median # us, mean # us")


covers("ring_utilization")


def test_ring_utilization():
    # Its six cases (pp=4 tiny engines, 16 requests x 24 tokens) are fixed; 1 ms stages is the least.
    out = run("ring_utilization", "--stage-ms", 1, "--host-ms", 0)
    rows = re.findall(rf"^\| depth \d, .* \| {NUMBER}, {NUMBER}, {NUMBER}, {NUMBER} \| {NUMBER} \| .* \| (?:yes|NO) \|$", out, re.MULTILINE)
    assert len(rows) == 6, out[-4000:]


covers("procs_bench")


def test_procs_bench(tiny):
    out = run("procs_bench", "--model", tiny, "--pp", 2, "--requests", 1, "--input-len", 1, "--output-len", 2)
    for name in ("1 process, pp=1", "1 process, pp=2", "2 processes"):
        has(out, rf"^\| {name} \| # \| # \| # \|$")


covers("prefix_cache_bench")


def test_prefix_cache_bench(tiny):
    out = run("prefix_cache_bench", "--model", tiny, "--requests", 1, "--shared-prefix", 16, "--input-len", 1, "--output-len", 2,
              "--rounds", 1)
    has(out, r"^\| output tok/s \| # \| # \| #x \|$", r"^\| TTFT p50 \| # ms \| # ms \| #x lower \|$",
        r"^\| prefix cache hit rate \| \| #% \| \|$")


covers("decode_step_profile")


def test_decode_step_profile(tiny):
    out = run("decode_step_profile", "--model", tiny, "--rows", 1, "--min-ctx", 2, "--max-ctx", 4, "--steps", 1, "--rounds", 1,
              "--top", 3, "--dense", env={"GRAPHRT_MATMUL": "packed"})  # --dense needs weights not dense already
    has(out, r"^graphrt: median # ms per step", r"^graphrt dense: median # ms per step", r"^transformers: median # ms per step",
        r"^ +#% +# ms +\d+ calls  matmul$", r"^transformers / graphrt step time: #x$")


covers("cpu_decode_ab")


def test_cpu_decode_ab(tiny):
    # The baseline is the torch kernels at commit fa12662, read with `git show`: a checkout with history.
    if shutil.which("git") is None or subprocess.run(["git", "cat-file", "-e", "fa12662^{commit}"], cwd=REPO).returncode != 0:
        pytest.skip("cpu_decode_ab.py reads its baseline kernels from commit fa12662, which this checkout lacks")
    out = run("cpu_decode_ab", "--model", tiny, "--rounds", 1, "--requests", 1)
    for variant in ("baseline", "dense", "packed", "auto"):
        has(out, rf"^graphrt {variant}: median # tok/s of \[#\]$")


covers("cpu_bf16")


def test_cpu_bf16(talking_tiny):
    out = run("cpu_bf16", "--model", talking_tiny, "--tokens", 2, "--rounds", 1, "--batch", 2)
    has(out, r"graphrt: tokens before the first difference .*whole sequences identical: \d+ of 8",
        r"float32's tokens that bfloat16 ranks first on float32's text: \d+ of 16", r"^\| float32 \| # \| # \| # \| matmuls: ",
        r"^\| bfloat16 \| # \| # \| # \| matmuls: ")


covers("decode_batch1")


def test_decode_batch1(talking_tiny):
    # Its bandwidth probes are fixed (1 GiB read, 512 MB of batch-1 matmuls): a few seconds.
    out = run("decode_batch1", "--model", talking_tiny, "--tokens", 2, "--repeats", 1)
    has(out, r"^streaming read: # GB/s -> roofline # tok/s", r"^\| graphrt pp=1 \| # \| # \| #% \|$",
        r"^\| transformers generate \| # \| # \| #% \|$", r"^ratio graphrt / transformers: #x$")


covers("moe_bench")


@pytest.mark.parametrize(("family", "kv"), [
    ("qwen3-moe", r"128 values a token a layer \(K and V\)"),  # a key and a value of 64 for its one KV head
    ("deepseek-v3", r"48 values a token a layer \(MLA latent\), against 160 for its heads' keys and values uncompressed \(3\.3x\)"),
])
def test_moe_bench(family, kv):
    # A MoE of 4 experts, hidden 64, 2 layers: seconds, not the default's minute.
    out = run("moe_bench", "--family", family, "--experts", 4, "--top-k", 2, "--hidden", 64, "--layers", 2, "--expert-size", 32,
              "--vocab", 128, "--batches", "1,4", "--tokens", 3, "--prompt", 4, "--rounds", 1, "--switch-pause", 0)
    has(out, rf"^model: {family}, 2 layers, hidden 64, 4 experts of 32, top-2, vocab 128, float32, # MB of weights; KV cache: {kv}$",
        r"^\| 1 \| 2\.00 of 4 \| # \| # \(#-#\) \| # \(#-#\) \| #x \| # \| # \|$",
        r"^\| 4 \| 3\.75 of 4 \| # \| # \(#-#\) \| # \(#-#\) \| #x \| # \| # \|$")


covers("matmul_choice")


def test_matmul_choice(talking_tiny):
    out = run("matmul_choice", "--model", talking_tiny, "--dtypes", "float32", "--rounds", 1, "--tokens", 2, "--batch", 2)
    for mode in ("dense", "packed", "panel", "auto"):
        has(out, rf"^\| float32 \| {mode} \| # \| # \| # \|$", rf"^float32 {mode}: matmuls: ")
    has(out, r"^  lm_head \(49152, 64\): \w+ \(dense # / # us")


covers("openmp_teams")


def test_openmp_teams(long_tiny):
    out = run("openmp_teams", "--model", long_tiny, "--dtype", "float32", "--steps", 1, "--rounds", 1, "--requests", 1)
    for case in ("host thread, its team the only one", "stage thread, the host's team alive", "stage thread, the host's team given back"):
        has(out, rf"^  {re.escape(case)}: #$")
    for setup in ("the host keeps its team", "the host's team released", r"released, teams sized \(default\)"):
        has(out, rf"^  {setup}: # \(median #\)$")


covers("bench_ab")


def test_bench_ab_against_itself(tiny):
    venv = Path(sys.executable).parent.parent
    if not (venv / "bin" / "graphrt").exists():
        pytest.skip(f"bench_ab.py runs <venv>/bin/graphrt; {venv} has none")
    out = run("bench_ab", "--before", venv, "--after", venv, "--rounds", 1, "--", "--model", tiny, "--requests", 1,
              "--input-len", 1, "--output-len", 2)
    for metric in ("output tok/s", "TTFT p50 ms", "TPOT p50 ms"):
        # A time under a millisecond prints as 0, and the ratio against it as n/a.
        has(out, rf"^\| {metric} \| # \| # \| (?:#|n/a) \|$")


def test_bench_ab_serving_against_itself(talking_tiny):
    # Each side's server steps its engine on a thread (serve_bench.py's --serve-args, tested here):
    # what bench_ab.py adds is the same in either engine mode, and an engine process a side is an
    # interpreter start more; test_serve_bench_with_the_engine_alone_beside_it serves as a user does.
    venv = Path(sys.executable).parent.parent
    out = run("bench_ab", "--before", venv, "--after", venv, "--rounds", 1, "--serve", "--", "--model", talking_tiny,
              "--concurrency", "1,2", "--requests", 2, "--max-tokens", 2, "--serve-args=--no-engine-process")
    for level in (1, 2):
        for metric in ("output tok/s", "TTFT p50 ms", "TPOT p50 ms"):
            has(out, rf"^\| c{level} {metric} \| # \| # \| (?:#|n/a) \|$")


# ---------------------------------------------------------------- the server


covers("serve_bench")


def test_serve_bench_with_the_engine_alone_beside_it(talking_tiny):
    out = run("serve_bench", "--model", talking_tiny, "--concurrency", 1, "--requests", 1, "--max-tokens", 2, "--baseline")
    has(out, r"^\| 1 \| 1 \| # \| # / # / # \| # / # / # \| # \|$", r"^load average \(1/5/15 min\) at the end: ")


covers("soak")


def test_soak(talking_tiny):
    out = run("soak", "--model", talking_tiny, "--clients", 1, "--minutes", 0.02, "--max-tokens", 2, "--sample-s", 1,
              "--idle-s", 1)
    has(out, r"^1 clients, 0.02 min, \d+ requests \(\d+ hung up\), \d+ tokens streamed$",
        r"^RSS: # MiB before load, # MiB at 1 min, # MiB at the end \(#% after warm-up\)$",
        r"^RSS slope after warm-up: # MiB/min \(whole run #\); # MiB after 1 s idle$",
        r"^KV blocks in use once the load stopped: 0; server exit code 0$")


def test_soak_reads_the_memory_of_every_process_of_the_server():
    """The server is a front and an engine process (more with --procs): soak's figure is the sum
    over the process tree, here a parent of ~10 MiB whose grandchild holds 200 MiB."""
    pytest.importorskip("psutil")
    import psutil

    soak = imported("soak")
    holder = "import time; held = b'x' * (200 << 20); time.sleep(60)"
    spawner = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {holder!r}]).wait()"
    parent = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {spawner!r}]).wait()"])
    try:
        deadline = time.monotonic() + 30
        while soak.rss_mib(parent.pid) < 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert soak.rss_mib(parent.pid) >= 200
        assert psutil.Process(parent.pid).memory_info().rss < 100 << 20  # the parent's own figure is not it
    finally:
        for proc in psutil.Process(parent.pid).children(recursive=True):
            proc.kill()
        parent.kill()
        parent.wait()


# ---------------------------------------------------------------- --help only


covers("peer_vllm")


def test_peer_vllm_help():
    # Only --help: the comparison needs vLLM's CPU build in a venv of its own (.venv-vllm), which its
    # first run installs (minutes, from the network); and one sitting takes an hour.
    out = run("peer_vllm", "--help")
    has(out, r"^usage: peer_vllm\.py", r"--rows ROWS", r"--vllm-venv VLLM_VENV")


covers("peer_clients")


def test_peer_clients_without_the_clients_and_their_summaries(tmp_path):
    # The clients live in venvs of their own (vLLM's is gigabytes): without them the script says so
    # and stops before starting a server. Their summaries are read as both clients print them.
    out = run("peer_clients", "--vllm-venv", tmp_path / "none", "--sglang-venv", tmp_path / "none", expect=1)
    has(out, r"^skipped vLLM's client: .* does not exist", r"^skipped SGLang's client: .* does not exist", r"no client to run")
    printed = "Successful requests:                     32\nFailed requests:                         0\n" \
              "Output token throughput (tok/s):         170.25\nMedian TTFT (ms):                        812.40\n"
    summary = imported("peer_clients").summary
    assert summary(printed, 32) == {
        "completed": 32.0, "failed": 0.0, "output_tok_s": 170.25, "ttft_ms": 812.4, "tpot_ms": None,
    }
    # SGLang's summary has no "Failed requests" line: the prompts that did not succeed are the failures.
    sglang_printed = printed.replace("Successful requests:                     32", "Successful requests: 30")
    sglang_printed = sglang_printed.replace("Failed requests:                         0\n", "")
    assert summary(sglang_printed, 32)["failed"] == 2


covers("lm_eval_parity")


def test_lm_eval_parity_help_and_without_lm_eval(tmp_path):
    # Only --help and its refusal without lm-eval: the parity run needs lm-eval in .venv-eval (make eval).
    has(run("lm_eval_parity", "--help"), r"^usage: lm_eval_parity\.py", r"--lm-eval LM_EVAL")
    out = run("lm_eval_parity", "--lm-eval", tmp_path / "no-lm_eval", expect=1)
    has(out, r"no-lm_eval not found: make a separate venv with lm_eval")


covers("mutation")


def test_mutation_help_and_its_paths():
    # Only --help: a run needs cosmic-ray and takes hours (benchmarks/results.md). What the move
    # of issue 30 broke is checked instead: every file it mutates and every test it runs exists.
    has(run("mutation", "--help"), r"^usage: mutation\.py", r"--modules")
    mutation = imported("mutation")
    assert set(mutation.MODULE_PATHS) == set(mutation.TESTS)
    for paths in mutation.MODULE_PATHS.values():
        assert all((REPO / path).is_file() for path in paths), paths
    for tests in [*mutation.TESTS.values(), [mutation.NEW_TESTS]]:
        assert all((REPO / test).is_file() for test in tests), tests


def test_every_benchmark_script_is_tested_here():
    scripts = {path.name for path in BENCHMARKS.glob("*.py")} - HELPER_MODULES
    assert scripts - TESTED == set(), "benchmarks with no test in tests/test_benchmarks.py"
    assert TESTED - scripts == set(), "tests here of benchmarks that are gone"


covers("spec_decode_bench")


@pytest.mark.parametrize("workload", ["copy", "random"])
def test_spec_decode_bench(talking_tiny, workload):
    out = run("spec_decode_bench", "--model", talking_tiny, "--workload", workload, "--requests", 2, "--concurrency", 2,
              "--max-tokens", 4, "--rounds", 1, "--device", "cpu", "--dtype", "float32")
    has(out, r"^\| output tok/s \| # \(#-#\) \| # \(#-#\) \| #x \|$", r"^\| acceptance \| \| #%, # tokens per verify row \| \|$",
        r"^greedy tokens the same with and without speculation: 2 of 2 requests \(torch\.float32, cpu\)$")


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU it measures on it (scripts/gpu_check.sh runs it)")
def test_spec_decode_bench_on_cuda_without_a_gpu_says_so():
    out = run("spec_decode_bench", "--device", "cuda", expect=NO_CUDA_EXIT)
    has(out, r"no CUDA device: torch .* sees none")


covers("structured_bench")


def test_structured_bench(talking_tiny):
    # A random model under JSON schemas: the output ends at the grammar's end or at --max-tokens.
    out = run("structured_bench", "--model", talking_tiny, "--requests", 4, "--max-tokens", 8, "--rounds", 1)
    has(out, r"^free: # tok/s \(#-#\)$", r"^constrained: # tok/s \(#-#\)$", r"^constrained / free: #x$",
        r"^free, cut to the same lengths: # tok/s \(#-#\)$", r"^constrained / free, cut to the same lengths: #x$",
        r"^grammar compile: p50 # ms, p99 # ms over 4 schemas$")
