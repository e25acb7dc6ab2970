"""The GPU check's serve step: `graphrt serve` starts, answers one completion, and stops cleanly on SIGTERM.

    python scripts/serve_check.py --model DIR [--max-tokens 8] [-- SERVE_ARGS...]

Starts `python -m graphrt serve --model DIR --port 0 SERVE_ARGS`, reads the address from its
"serving ... on http://HOST:PORT" line, sends one /v1/completions request whose prompt is token ids
(the check's random models have no tokenizer; the OpenAI API takes a list of ids as `prompt`)
with python's urllib (no openai client on the GPU image), checks that it got max_tokens tokens,
then SIGTERM and exit status 0 within the grace period. The last line printed says what happened.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request

PROMPT = [5, 9, 2, 7, 11, 3]


def read_lines(stream, lines: queue.Queue) -> None:
    for line in stream:
        print(line, end="", flush=True)
        lines.put(line)
    lines.put(None)


def wait_for_address(server: subprocess.Popen, lines: queue.Queue, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            break
        if line is None:
            raise RuntimeError(f"graphrt serve exited with status {server.wait()} before it served")
        if "serving " in line and " on http://" in line:
            return line.split(" on ", 1)[1].split()[0]
    raise RuntimeError(f"graphrt serve did not say where it serves within {timeout_s:.0f} s")


def complete(address: str, model: str, max_tokens: int) -> dict:
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    request = urllib.request.Request(f"{address}/v1/completions", data=body.encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--start-timeout", type=float, default=120.0)
    parser.add_argument("--stop-timeout", type=float, default=20.0)
    parser.add_argument("serve_args", nargs="*", help="more `graphrt serve` options, after --")
    args = parser.parse_args(argv)
    command = [sys.executable, "-m", "graphrt", "serve", "--model", args.model, "--port", "0", *args.serve_args]
    print("$ " + " ".join(command), flush=True)
    started = time.monotonic()
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=read_lines, args=(server.stdout, lines), daemon=True).start()
    try:
        address = wait_for_address(server, lines, args.start_timeout)
        up_s = time.monotonic() - started
        served_name = os.path.basename(os.path.normpath(args.model))
        answer = complete(address, served_name, args.max_tokens)
        tokens = answer["usage"]["completion_tokens"]
        if tokens != args.max_tokens:
            raise RuntimeError(f"asked for {args.max_tokens} tokens, got {tokens}: {json.dumps(answer)[:300]}")
    except Exception as exc:  # the server must not outlive the check
        server.kill()
        server.wait()
        print(f"serve FAILED: {type(exc).__name__}: {exc}")
        return 1
    server.send_signal(signal.SIGTERM)
    try:
        status = server.wait(timeout=args.stop_timeout)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
        print(f"serve FAILED: still running {args.stop_timeout:.0f} s after SIGTERM (killed)")
        return 1
    if status != 0:
        print(f"serve FAILED: exit status {status} after SIGTERM")
        return 1
    print(f"serve ok: up in {up_s:.1f} s at {address}, {tokens} tokens for a {len(PROMPT)}-token-id prompt, exit 0 on SIGTERM")
    return 0


if __name__ == "__main__":
    sys.exit(main())
