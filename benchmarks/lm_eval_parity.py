"""lm-eval parity: two small local tasks through lm-eval's `hf` model and through `graphrt serve`.

    .venv-eval/bin/python benchmarks/lm_eval_parity.py [--model DIR] [--url URL] [--batch-size 4]
                                                       [--skip-hf] [--out DIR]

lm-eval runs the tasks in `benchmarks/lm_eval_tasks/` (a loglikelihood task, `graphrt_last_word`,
and a multiple-choice task, `graphrt_facts_mc`, both read from JSON Lines files there; nothing is
downloaded) twice: with `--model hf` (transformers, float32, on the CPU) and with
`--model local-completions` against `graphrt serve`, each with `--batch_size 4`. It prints each
task's acc and acc_norm from both side by side, the largest difference between the two runs'
log-probabilities over all requests, and the wall times, then a markdown snippet for
`benchmarks/results.md`. It exits 1 if an accuracy differs.

lm-eval lives in its own virtual environment (`--lm-eval`, default `.venv-eval/bin/lm_eval`),
graphrt in the project's (`--graphrt`, default `.venv/bin/graphrt`); this script needs only the
standard library, so any Python 3.10+ runs it. Without `--url` it starts
`graphrt serve --port 0 --model DIR` and stops it at the end; with `--url` it uses a server that
is already running. Everything lm-eval writes (results, per-request samples, logs) goes under
`--out` (default: a new temporary folder, printed at the end).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TASKS_DIR = REPO / "benchmarks" / "lm_eval_tasks"
TASKS = ("graphrt_last_word", "graphrt_facts_mc")
ACCURACY_METRICS = ("acc", "acc_norm")
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               # the repo root holds a `kernels/` folder that transformers would import as the
               # `kernels` package if the current directory were on sys.path
               "PYTHONSAFEPATH": "1"}


@dataclass
class EvalRun:
    """One lm-eval run: its metrics per task, its per-request (loglikelihood, is_greedy), its wall time."""

    label: str
    wall_s: float
    metrics: dict[str, dict[str, float]]  # task -> metric -> value
    responses: dict[str, dict[tuple[int, int], tuple[float, bool]]] = field(default_factory=dict)


def default_model_dir(graphrt_bin: Path) -> str:
    """The default model folder, asked of the project's environment (this one may not have graphrt)."""
    python = graphrt_bin.parent / "python"
    code = "from graphrt.model.default_model import default_model_dir; print(default_model_dir())"
    result = subprocess.run([str(python), "-c", code], capture_output=True, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONSAFEPATH": "1"})
    if result.returncode != 0:
        sys.exit(f"could not find the default model with {python}:\n{result.stderr.strip()}\n"
                 "Run `make run` once to convert it, or pass --model DIR.")
    return result.stdout.strip().splitlines()[-1]


def run_lm_eval(label: str, lm_eval_bin: Path, model: str, model_args: str, extra: list[str],
                batch_size: int, out_dir: Path, env: dict[str, str]) -> EvalRun:
    """Run the lm-eval CLI on both tasks; its output goes to out_dir/label.log."""
    run_dir = out_dir / label
    command = [str(lm_eval_bin), "run", "--model", model, "--model_args", model_args, *extra,
               "--tasks", ",".join(TASKS), "--include_path", str(TASKS_DIR),
               "--batch_size", str(batch_size), "--output_path", str(run_dir), "--log_samples"]
    log_path = out_dir / f"{label}.log"
    print(f"[{label}] {' '.join(command)}", file=sys.stderr)
    start = time.perf_counter()
    with open(log_path, "w") as log:
        returncode = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                    env={**os.environ, **OFFLINE_ENV, **env}).returncode
    wall_s = time.perf_counter() - start
    if returncode != 0:
        tail = log_path.read_text(errors="replace").replace("\r", "\n").splitlines()[-25:]
        sys.exit(f"[{label}] lm-eval exited with code {returncode}; the end of {log_path}:\n" + "\n".join(tail))
    print(f"[{label}] done in {wall_s:.1f} s", file=sys.stderr)
    return EvalRun(label, wall_s, read_metrics(run_dir), read_responses(run_dir))


def newest(pattern: str) -> str:
    found = sorted(glob.glob(pattern, recursive=True), key=os.path.getmtime)
    if not found:
        sys.exit(f"lm-eval wrote no file matching {pattern}")
    return found[-1]


def read_metrics(run_dir: Path) -> dict[str, dict[str, float]]:
    with open(newest(f"{run_dir}/**/results_*.json")) as f:
        results = json.load(f)["results"]
    # lm-eval keys metrics as "name,filter"; these tasks have the one filter "none"
    return {task: {key.split(",")[0]: value for key, value in results[task].items()
                   if key.endswith(",none") and "_stderr" not in key} for task in TASKS}


def read_responses(run_dir: Path) -> dict[str, dict[tuple[int, int], tuple[float, bool]]]:
    """task -> (doc_id, choice) -> (loglikelihood, is_greedy), from lm-eval's samples files."""
    responses = {}
    for task in TASKS:
        per_request = {}
        with open(newest(f"{run_dir}/**/samples_{task}_*.jsonl")) as f:
            for line in f:
                sample = json.loads(line)
                for choice, (loglikelihood, is_greedy) in enumerate(sample["filtered_resps"]):
                    per_request[(sample["doc_id"], choice)] = (float(loglikelihood), is_greedy in (True, "True"))
        responses[task] = per_request
    return responses


def start_server(graphrt_bin: Path, model_dir: str, log_path: Path) -> tuple[subprocess.Popen, str]:
    """`graphrt serve` on a free port; returns the process and its base URL once it listens."""
    env = {key: value for key, value in os.environ.items() if key != "GRAPHRT_API_KEY"}
    command = [str(graphrt_bin), "serve", "--port", "0", "--model", model_dir]
    print(f"[graphrt] {' '.join(command)}", file=sys.stderr)
    log = open(log_path, "w")  # a file, not a pipe: the server's access log never blocks it
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        found = re.search(r"serving \S+ on (http://\S+)", log_path.read_text(errors="replace"))
        if found:
            return proc, found.group(1).rstrip("/")
        if proc.poll() is not None:
            sys.exit(f"graphrt serve exited with code {proc.returncode} before serving:\n{log_path.read_text()}")
        time.sleep(0.2)
    proc.terminate()
    sys.exit(f"graphrt serve did not start within 300 s; see {log_path}")


def get_json(url: str, api_key: str | None) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as response:
        return json.load(response)


def wait_healthy(base_url: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            pass
        if time.monotonic() > deadline:
            sys.exit(f"{base_url}/health did not answer 200 within {timeout_s:.0f} s")
        time.sleep(0.5)


def max_loglikelihood_diff(reference: EvalRun, other: EvalRun) -> tuple[float, int, int]:
    """Largest |difference| of a request's loglikelihood, requests whose is_greedy differs, requests."""
    largest, greedy_flips, num_requests = 0.0, 0, 0
    for task in TASKS:
        for key, (loglikelihood, is_greedy) in reference.responses[task].items():
            other_loglikelihood, other_greedy = other.responses[task][key]
            largest = max(largest, abs(loglikelihood - other_loglikelihood))
            greedy_flips += is_greedy != other_greedy
            num_requests += 1
    return largest, greedy_flips, num_requests


def closest_choice_margin(run: EvalRun) -> float:
    """The smallest gap between a question's two best choices: how much noise could flip an answer."""
    by_doc: dict[int, list[float]] = {}
    for (doc_id, _), (loglikelihood, _) in run.responses["graphrt_facts_mc"].items():
        by_doc.setdefault(doc_id, []).append(loglikelihood)
    return min(best[-1] - best[-2] for best in (sorted(v) for v in by_doc.values()))


def comparison_rows(hf: EvalRun, served: EvalRun) -> list[tuple[str, str, float, float, bool]]:
    rows = []
    for task in TASKS:
        for metric in (*ACCURACY_METRICS, "perplexity"):
            if metric in hf.metrics[task]:
                hf_value, served_value = hf.metrics[task][metric], served.metrics[task][metric]
                # accuracies must match exactly; perplexity is shown for reading, not judged
                same = hf_value == served_value if metric in ACCURACY_METRICS else True
                rows.append((task, metric, hf_value, served_value, same))
    return rows


def markdown(rows, hf: EvalRun, served: EvalRun, batch_size: int, server_start_s: float | None) -> str:
    largest, greedy_flips, num_requests = max_loglikelihood_diff(hf, served)
    lines = [
        f"`.venv-eval/bin/python benchmarks/lm_eval_parity.py` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{platform.machine()}, {os.cpu_count()} cores, float32 on the CPU, lm-eval `--batch_size {batch_size}`, "
        f"load average {os.getloadavg()[0]:.1f} at the end):",
        "",
        "| task | metric | lm-eval `hf` (transformers) | lm-eval `local-completions` (graphrt serve) | equal |",
        "|---|---|---|---|---|",
    ]
    for task, metric, hf_value, served_value, same in rows:
        equal = ("yes" if same else "**no**") if metric in ACCURACY_METRICS else "-"
        lines.append(f"| {task} | {metric} | {hf_value:.4f} | {served_value:.4f} | {equal} |")
    start = f" plus {server_start_s:.1f} s to start the server" if server_start_s is not None else ""
    lines += [
        "",
        f"Largest difference in a request's log-likelihood: {largest:.2e} over {num_requests} requests; "
        f"is_greedy differs on {greedy_flips}. Closest call in graphrt_facts_mc (gap between the two "
        f"best choices, hf): {closest_choice_margin(hf):.3f} nats. Wall time of each lm-eval run "
        f"(start-up included): hf {hf.wall_s:.1f} s, local-completions {served.wall_s:.1f} s{start}.",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="Model folder [default: graphrt's default model].")
    parser.add_argument("--url", default=None, help="A running graphrt server, e.g. http://127.0.0.1:8000 "
                        "[default: start `graphrt serve` here].")
    parser.add_argument("--api-key", default=None, help="The running server's bearer token (with --url).")
    parser.add_argument("--batch-size", type=int, default=4, help="lm-eval's --batch_size for both runs.")
    parser.add_argument("--skip-hf", action="store_true", help="Only run the graphrt side; print its figures.")
    parser.add_argument("--skip-server", action="store_true", help="Only run the hf side; print its figures.")
    parser.add_argument("--lm-eval", type=Path, default=REPO / ".venv-eval" / "bin" / "lm_eval")
    parser.add_argument("--graphrt", type=Path, default=REPO / ".venv" / "bin" / "graphrt")
    parser.add_argument("--out", type=Path, default=None, help="Folder for lm-eval's output [default: a temporary one].")
    args = parser.parse_args()
    if not args.lm_eval.exists():
        sys.exit(f"{args.lm_eval} not found: make a separate venv with lm_eval[hf,api]==0.4.13 or pass --lm-eval")
    if args.skip_hf and args.skip_server:
        sys.exit("--skip-hf and --skip-server leave nothing to run")
    model_dir = str(Path(args.model).resolve()) if args.model else default_model_dir(args.graphrt)
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="lm_eval_parity_"))
    out_dir.mkdir(parents=True, exist_ok=True)

    hf = None
    if not args.skip_hf:
        hf = run_lm_eval("hf", args.lm_eval, "hf", f"pretrained={model_dir},dtype=float32", ["--device", "cpu"],
                         args.batch_size, out_dir, env={})
    served, server_start_s = None, None
    if not args.skip_server:
        proc, base_url, api_key = None, args.url, args.api_key
        try:
            if base_url is None:
                start = time.perf_counter()
                proc, base_url = start_server(args.graphrt, model_dir, out_dir / "graphrt_serve.log")
                wait_healthy(base_url)
                server_start_s = time.perf_counter() - start
            base_url = base_url.rstrip("/")
            served_model = get_json(f"{base_url}/v1/models", api_key)["data"][0]["id"]
            # num_concurrent=1: one batch of --batch_size prompts per request, in order;
            # tokenizer: lm-eval tokenizes here and sends token ids, so both runs score the same ids
            model_args = (f"base_url={base_url}/v1/completions,model={served_model},tokenizer={model_dir},"
                          "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1")
            served = run_lm_eval("local-completions", args.lm_eval, "local-completions", model_args, [],
                                 args.batch_size, out_dir, env={"OPENAI_API_KEY": api_key or ""})
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(30)

    print(f"lm-eval output: {out_dir}")
    if hf is None or served is None:
        only = hf or served
        for task in TASKS:
            print(f"{only.label} {task}: " + ", ".join(f"{m} {v:.4f}" for m, v in only.metrics[task].items()))
        print(f"{only.label}: lm-eval wall time {only.wall_s:.1f} s")
        return
    rows = comparison_rows(hf, served)
    print(f"{'task':<20} {'metric':<11} {'hf':>9} {'graphrt':>9}  equal")
    for task, metric, hf_value, served_value, same in rows:
        print(f"{task:<20} {metric:<11} {hf_value:>9.4f} {served_value:>9.4f}  "
              f"{('yes' if same else 'NO') if metric in ACCURACY_METRICS else '-'}")
    largest, greedy_flips, num_requests = max_loglikelihood_diff(hf, served)
    print(f"largest |loglikelihood difference| {largest:.2e} over {num_requests} requests; is_greedy differs on {greedy_flips}")
    print(f"wall time: hf {hf.wall_s:.1f} s, local-completions {served.wall_s:.1f} s"
          + (f" (+ {server_start_s:.1f} s server start)" if server_start_s is not None else ""))
    print("\n--- for benchmarks/results.md ---\n")
    print(markdown(rows, hf, served, args.batch_size, server_start_s))
    if not all(same for *_, same in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
