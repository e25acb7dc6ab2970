"""The GPU check's first step, in seconds: does graphrt import, capture and replay CUDA graphs of a
tiny random model, and give the same greedy tokens with graphs as without?

    python scripts/gpu_smoke.py [--device cuda|cpu]

Two stages of graphrt.tools.synthetic's 4-layer random Llama share the one device (each stage on its own
stream), float32, torch kernels (no Triton compile here: kernels have their own step), buckets 1-8.
Exits 0 when all of that holds, 3 when there is no CUDA device, 1 otherwise; the last line printed
says which and why, for scripts/gpu_check.sh, which stops the check early unless this passes.
`--device cpu` runs the same on the eager backend: a check of this script.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
from pathlib import Path

NO_CUDA_EXIT = 3
BUCKETS = [1, 2, 4, 8]
# Both stages share the GPU at depth 0, so a decode round's rows travel as one micro-batch
# (EngineConfig.num_decode_micro_batches counts GPUs, not stages): 7 rows in bucket 8 with a padding
# row, then one prompt alone in bucket 1.
PROMPT_SETS = [[[5, 9, 2], *[[3 + i] * (2 + 3 * i) for i in range(6)]], [[4, 8, 15, 16]]]


class SmokeFailure(Exception):
    """What went wrong, in one line for the summary."""


def check(device: str) -> str:
    from graphrt import LLM, SamplingParams
    from graphrt.tools.synthetic import make_tiny_model

    started = time.perf_counter()
    stage_device = "cuda:0" if device == "cuda" else device
    options = dict(pp=2, devices=[stage_device] * 2, dtype="float32", kernels="torch", buckets=BUCKETS, kv_cache_tokens=4096, depth=0)
    with tempfile.TemporaryDirectory(prefix="graphrt-smoke-") as scratch:
        model_dir = make_tiny_model(Path(scratch), "llama3-rope")
        graphed = LLM(model=model_dir, **options)
        eager = LLM(model=model_dir, use_graphs=False, **options)
    built = time.perf_counter()
    engine = graphed.engine
    if device == "cuda":
        if engine.backend != "cuda":
            raise SmokeFailure(f"the engine chose the {engine.backend!r} backend on CUDA devices")
        not_graphs = [(r.stage, r.bucket, r.note) for r in engine.graph_records if r.mode != "graph"]
        if not_graphs:
            raise SmokeFailure(f"(stage, bucket, why) not captured as CUDA graphs: {not_graphs}")
        # Counted nodes are evidence; uncounted ones (no cuda-python, say) are not a capture failure.
        no_kernels = [(r.stage, r.bucket) for r in engine.graph_records if r.nodes is not None and not r.nodes["kernel"]]
        if no_kernels:
            raise SmokeFailure(f"graphs with no kernel nodes (nothing recorded?) at (stage, bucket) {no_kernels}")
        uncounted = {r.note for r in engine.graph_records if r.nodes is None}
        if uncounted:
            print(f"graph nodes not counted: {'; '.join(sorted(uncounted))}")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with_graphs = [o.token_ids for prompts in PROMPT_SETS for o in graphed.generate(prompts, params)]
    without = [o.token_ids for prompts in PROMPT_SETS for o in eager.generate(prompts, params)]
    if with_graphs != without:
        parted = [i for i, (g, e) in enumerate(zip(with_graphs, without)) if g != e]
        raise SmokeFailure(f"greedy tokens differ with graphs for prompts {parted}: {with_graphs[parted[0]]} vs {without[parted[0]]}")
    if engine.num_eager_fallbacks:
        raise SmokeFailure(f"{engine.num_eager_fallbacks} decode micro-batches fell back to eager")
    for llm in (graphed, eager):
        llm.engine.close()
    capture_ms = sum(r.capture_ms for r in engine.graph_records)
    warmup_ms = sum(r.warmup_ms for r in engine.graph_records)
    return (
        f"smoke ok on {device}: {len(engine.graph_records)} (stage, bucket) pairs recorded ({engine.backend} backend, "
        f"warm-up {warmup_ms:.0f} ms, recording {capture_ms:.0f} ms), greedy tokens with graphs equal eager for {len(with_graphs)} prompts; "
        f"build {built - started:.1f} s, generate {time.perf_counter() - built:.1f} s"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        import torch

        import graphrt  # noqa: F401  (the first thing that breaks on a new image: say so plainly)
    except Exception as exc:
        traceback.print_exc()
        print(f"smoke failed: graphrt does not import: {type(exc).__name__}: {exc}")
        return 1
    print(f"imports {time.perf_counter() - started:.1f} s; torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"no CUDA device: torch {torch.__version__} sees none (torch.cuda.is_available() is False)")
        return NO_CUDA_EXIT
    try:
        print(check(args.device))
    except SmokeFailure as failure:
        print(f"smoke failed: {failure}")
        return 1
    except Exception as exc:
        traceback.print_exc()
        print(f"smoke failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
