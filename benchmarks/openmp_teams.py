"""What a second OpenMP team costs the stage thread (graphrt/openmp.py).

One 32-row decode step of the default model, timed on the host thread while it holds the only
OpenMP team, then on the stage thread while the host's team is alive, then on the stage thread
after the host gave its team back (`release_thread_pool`); then `graphrt bench`'s workload in this
process with and without the release, interleaved.

    python benchmarks/openmp_teams.py [--dtype bfloat16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_step_profile import build_decode_step, graphrt_step, time_steps  # noqa: E402

from graphrt.cpu_info import cpu_model_name  # noqa: E402
from graphrt.llm import LLM  # noqa: E402
from graphrt.openmp import release_thread_pool  # noqa: E402

BENCH_CODE = """
import sys, graphrt.engine
from graphrt.bench import make_workload, run_graphrt
from graphrt.llm import LLM
if sys.argv[2] == "keep":
    graphrt.engine.release_thread_pool = lambda: False
llm = LLM(dtype=sys.argv[1])
work = make_workload(64, (16, 256), (16, 128), llm.engine.model_config.vocab_size, 0)
run_graphrt(llm, work[:8])  # warm-up
result = run_graphrt(llm, work)
print(result.seconds, result.output_tokens)
"""


def step_times(args) -> None:
    llm = LLM(dtype=args.dtype)
    rng = random.Random(0)
    step = graphrt_step(llm, *build_decode_step(llm, [rng.randint(32, 300) for _ in range(32)]))
    stage = llm.engine.ring.streams[0]

    def on_stage(fn):
        box = {}
        stage.submit(lambda: box.update(result=fn()))
        stage.record().synchronize()
        return box["result"]

    def host_first():
        # Engine start-up already gave the host's team back; the first op here starts it again,
        # and until the stage thread runs a parallel op there is one team.
        return time_steps(step, args.steps)

    cases = [
        ("host thread, its team the only one", host_first),
        ("stage thread, the host's team alive", lambda: on_stage(lambda: time_steps(step, args.steps))),
        ("stage thread, the host's team given back", lambda: (release_thread_pool(), on_stage(lambda: time_steps(step, args.steps)))[1]),
    ]
    print(f"{cpu_model_name()}, {args.dtype}, one 32-row decode step (contexts 32-300), median of {args.steps} steps, ms")
    for name, run in cases:
        print(f"  {name}: {statistics.median(run()) * 1e3:.1f}")
    llm.engine.close()


def bench_pairs(args) -> None:
    print(f"graphrt bench's 64 requests in this process, {args.rounds} interleaved rounds (output tok/s)")
    results = {"keep": [], "release": []}
    for _ in range(args.rounds):
        for mode in results:
            out = subprocess.run([sys.executable, "-c", BENCH_CODE, args.dtype, mode], check=True, capture_output=True, text=True)
            seconds, tokens = map(float, out.stdout.split()[-2:])
            results[mode].append(tokens / seconds)
    for mode, rates in results.items():
        label = "host keeps its team" if mode == "keep" else "host gives it back"
        print(f"  {label}: " + ", ".join(f"{rate:.1f}" for rate in rates) + f" (median {statistics.median(rates):.1f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    step_times(args)
    bench_pairs(args)


if __name__ == "__main__":
    main()
