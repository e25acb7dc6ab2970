"""The GPU check's mixture-of-experts step: do tiny random Qwen3-MoE and DeepSeek-V3 models (routing,
the fused-MoE kernel, DeepSeek's latent attention) capture as CUDA graphs on one GPU and give the
same greedy tokens replayed as eager?

    python scripts/moe_graph_check.py [--device cuda|cpu]

pp 1 and --ep 1 on the one GPU, float32, the Triton kernels (the fused MoE and the MLA decode
kernel run inside the graphs), buckets 1-8. Expert parallelism across GPUs (--ep 2 or more) needs
several GPUs, which the one-GPU check machine does not have: it is tested over gloo on CPUs
(tests/distributed/test_expert_parallel.py) and not here. Exits 0 when all holds, 3 without a
CUDA device, 1 otherwise; the last line says which and why. `--device cpu` runs the same on the
eager backend with the torch kernels: a check of this script.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
from pathlib import Path

NO_CUDA_EXIT = 3
VARIANTS = ["qwen3-moe", "deepseek-v3"]
BUCKETS = [1, 2, 4, 8]
PROMPTS = [[5, 9, 2], *[[3 + i] * (2 + 3 * i) for i in range(6)]]  # 7 rows: bucket 8 with a padding row


class CheckFailure(Exception):
    """What went wrong, in one line for the summary."""


def check(device: str) -> str:
    from graphrt import LLM, SamplingParams
    from graphrt.tools.synthetic import make_tiny_model

    kernels = "triton" if device == "cuda" else "torch"
    options = dict(pp=1, devices=[device], dtype="float32", kernels=kernels, buckets=BUCKETS, kv_cache_tokens=4096)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    said = []
    with tempfile.TemporaryDirectory(prefix="graphrt-moe-check-") as scratch:
        for variant in VARIANTS:
            started = time.perf_counter()
            model_dir = make_tiny_model(Path(scratch) / variant, variant)
            graphed = LLM(model=model_dir, **options)
            eager = LLM(model=model_dir, use_graphs=False, **options)
            engine = graphed.engine
            if device == "cuda":
                not_graphs = [(r.bucket, r.note) for r in engine.graph_records if r.mode != "graph"]
                if not_graphs:
                    raise CheckFailure(f"{variant}: (bucket, why) not captured as CUDA graphs: {not_graphs}")
            with_graphs = [o.token_ids for o in graphed.generate(PROMPTS, params)]
            without = [o.token_ids for o in eager.generate(PROMPTS, params)]
            if with_graphs != without:
                parted = [i for i, (g, e) in enumerate(zip(with_graphs, without)) if g != e]
                raise CheckFailure(f"{variant}: greedy tokens differ with graphs for prompts {parted}")
            if engine.num_eager_fallbacks:
                raise CheckFailure(f"{variant}: {engine.num_eager_fallbacks} decode micro-batches fell back to eager")
            routed = sum(map(sum, engine.ring.stage_expert_tokens))
            for llm in (graphed, eager):
                llm.engine.close()
            said.append(f"{variant} {len(engine.graph_records)} buckets, {routed} tokens routed, {time.perf_counter() - started:.1f} s")
    return (
        f"moe graphs ok on {device} ({engine.backend} backend, {kernels} kernels, pp 1, ep 1): greedy with graphs "
        f"equals eager for {len(PROMPTS)} prompts; {'; '.join(said)}. EP across GPUs not run: one GPU"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"no CUDA device: torch {torch.__version__} sees none (torch.cuda.is_available() is False)")
        return NO_CUDA_EXIT
    try:
        print(check(args.device))
    except CheckFailure as failure:
        print(f"moe graphs failed: {failure}")
        return 1
    except Exception as exc:  # noqa: BLE001 - the summary gets one line; the log the traceback
        traceback.print_exc()
        print(f"moe graphs failed: {type(exc).__name__}: {str(exc)[:300]}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
