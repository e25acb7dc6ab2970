"""What OpenMP teams cost the stage thread (kernels/cpu/openmp.py).

First one 32-row decode step of the default model (or --model), timed on the host thread while it holds the
only OpenMP team, then on the stage thread while the host's team is alive, then on the stage thread
after the host gave its team back (`release_thread_pool`). Then `graphrt bench`'s workload (64
requests, --requests), each round in a fresh process, in three setups, interleaved: as before kernels/cpu/openmp.py
(the host keeps its team, so libgomp spins briefly), the host's team released (workers spin), and
released with each stage thread's team sized to the cores other processes leave (the default).
`--busy 2` runs two busy loops beside the bench rounds.

    python benchmarks/openmp_teams.py [--dtype bfloat16] [--steps 20] [--rounds 3] [--busy 0] [--requests 64] [--model DIR]
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

from graphrt.kernels.cpu.info import cpu_model_name  # noqa: E402
from graphrt.kernels.cpu.openmp import release_thread_pool  # noqa: E402
from graphrt.llm import LLM  # noqa: E402

SETUPS = {
    "before": "the host keeps its team",
    "release": "the host's team released",
    "sized": "released, teams sized (default)",
}
BENCH_CODE = """
import sys, graphrt.engine.engine, graphrt.kernels.cpu.openmp
from graphrt.tools.bench import make_workload, run_graphrt
from graphrt.llm import LLM
for owner, name in ((graphrt.engine.engine, "release_thread_pool"), (graphrt.kernels.cpu.openmp.TeamSizer, "fit")):
    assert hasattr(owner, name), f"{owner.__name__}.{name} is gone: the setups below would not differ"
if sys.argv[2] == "before":
    graphrt.engine.engine.release_thread_pool = lambda: False
if sys.argv[2] in ("before", "release"):
    graphrt.kernels.cpu.openmp.TeamSizer.fit = lambda self: None
llm = LLM(model=sys.argv[3] or None, dtype=sys.argv[1])
result = run_graphrt(llm, make_workload(int(sys.argv[4]), (16, 256), (16, 128), llm.engine.model_config.vocab_size, 0))
print(result.seconds, result.output_tokens)
"""


def step_times(args) -> None:
    llm = LLM(model=args.model, dtype=args.dtype)
    rng = random.Random(0)
    step = graphrt_step(llm, *build_decode_step(llm, [rng.randint(32, 300) for _ in range(32)]))
    stage = llm.engine.ring.streams[0]

    def on_stage_thread() -> list[float]:
        box = {}
        stage.submit(lambda: box.update(times=time_steps(step, args.steps)))
        stage.record().synchronize()
        return box["times"]

    def after_release() -> list[float]:
        release_thread_pool()
        return on_stage_thread()

    cases = [
        # Start-up gave the host's team back; timing here starts it again, and until the stage
        # thread runs a parallel op it is the only team.
        ("host thread, its team the only one", lambda: time_steps(step, args.steps)),
        ("stage thread, the host's team alive", on_stage_thread),
        ("stage thread, the host's team given back", after_release),
    ]
    print(f"{cpu_model_name()}, {args.dtype}, one 32-row decode step (contexts 32-300), median of {args.steps} steps, ms")
    for name, run in cases:
        print(f"  {name}: {statistics.median(run()) * 1e3:.1f}")
    llm.engine.close()


def bench_rounds(args) -> None:
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        rates = {setup: [] for setup in SETUPS}
        for _ in range(args.rounds):
            for setup in SETUPS:
                command = [sys.executable, "-c", BENCH_CODE, args.dtype, setup, args.model or "", str(args.requests)]
                out = subprocess.run(command, capture_output=True, text=True)
                if out.returncode != 0:
                    sys.exit(f"the {setup} round failed:\n{out.stderr[-3000:]}")
                seconds, tokens = map(float, out.stdout.split()[-2:])
                rates[setup].append(tokens / seconds)
    finally:
        for loop in loops:
            loop.kill()
    print(f"graphrt bench's {args.requests} requests, {args.busy} busy loops beside them, {args.rounds} interleaved rounds (output tok/s)")
    for setup, label in SETUPS.items():
        print(f"  {label}: " + ", ".join(f"{rate:.1f}" for rate in rates[setup]) + f" (median {statistics.median(rates[setup]):.1f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--busy", type=int, default=0, help="busy loops beside the bench rounds")
    parser.add_argument("--no-steps", action="store_true", help="only the bench rounds")
    parser.add_argument("--requests", type=int, default=64, help="requests of each bench round")
    parser.add_argument("--model", default=None, help="model folder [default: SmolLM2-135M-Instruct]")
    args = parser.parse_args()
    if not args.no_steps:
        step_times(args)
    bench_rounds(args)


if __name__ == "__main__":
    main()
