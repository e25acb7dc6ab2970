"""Where one CPU decode step goes: graphrt's stage forward vs transformers' decode forward.

    python benchmarks/decode_step_profile.py [--rows 32] [--min-ctx 17] [--max-ctx 192] [--steps 10] [--dense]

Both run the default model (or --model) at the same batch and context lengths: graphrt through the
real decode path (static buffers of the eager stage graph, paged KV cache, greedy sampling),
transformers through `LlamaForCausalLM.forward` with a DynamicCache as long as the longest context
(left padding masked, as its static-batch `generate` runs). Prints each side's time per step and
the share of its profile taken by each group of ops, so the two are read against each other.
`--dense` adds graphrt with its matmul weights dense (F.linear, MKL) instead of in the forms its
stage chose (packed for oneDNN, or compiled panels), timed in the same process, interleaved with
the others.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from graphrt import LLM, SamplingParams
from graphrt.kernels.cpu.linear import dense_weight, weight_form
from graphrt.model.batch import StepMetadata

# aten op -> what it is in a decode step (ops not listed are reported under their own name).
GROUPS = {
    "mkldnn::_linear_pointwise": "matmul",
    "aten::addmm": "matmul",
    "aten::mm": "matmul",
    "aten::linear": "matmul",
    "aten::matmul": "matmul",
    "aten::bmm": "attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
    "aten::scaled_dot_product_attention": "attention",
    "aten::_safe_softmax": "attention",
    "aten::_softmax": "attention",
    "aten::softmax": "attention",
}


def build_decode_step(llm: LLM, context_lens: list[int]) -> tuple[torch.Tensor, StepMetadata]:
    """Token ids and metadata of one decode step for sequences of these context lengths, their
    earlier KV already in the cache (random values: attention's cost does not depend on them)."""
    engine = llm.engine
    block_size = engine.config.block_size
    positions, slots, tables = [], [], []
    for context_len in context_lens:
        blocks = engine.allocator.allocate(engine.allocator.blocks_for(context_len))
        pos = context_len - 1
        positions.append(pos)
        slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        tables.append(blocks)
    width = max(len(t) for t in tables)
    tables = [t + [0] * (width - len(t)) for t in tables]
    for cache in engine.pipeline.caches:
        cache.k.normal_(0, 0.5)
        cache.v.normal_(0, 0.5)
    rows = len(context_lens)
    meta = StepMetadata(
        positions=torch.tensor(positions),
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor(tables),
        seq_lens=torch.tensor(context_lens),
        logits_indices=torch.arange(rows),
        seq_lens_host=list(context_lens),
    )
    token_ids = torch.randint(3, engine.model_config.vocab_size, (rows,))
    return token_ids, meta


def graphrt_step(llm: LLM, token_ids: torch.Tensor, meta: StepMetadata):
    engine = llm.engine
    params = [SamplingParams(temperature=0)] * len(token_ids)
    generators = [None] * len(token_ids)

    def step() -> torch.Tensor:
        x = token_ids
        for graphs in engine.graphs:  # every stage, one after another (pp=1 by default)
            x = graphs.run(x, meta)
        return engine.sampler(x, params, generators)

    return step


def swap_weights(stage, weights: dict[tuple[int, str], torch.Tensor]) -> dict[tuple[int, str], torch.Tensor]:
    """Put these matmul weights into the stage ((layer or -1 for the stage itself, name) -> weight);
    return the ones they replace. The stage's kernel set then decides again whether its decode
    steps run in one call (only where every matmul weight is in panels)."""
    replaced = {}
    for (index, name), weight in weights.items():
        owner = stage if index < 0 else stage.layers[index]
        replaced[(index, name)] = getattr(owner, name)
        setattr(owner, name, torch.nn.Parameter(weight, requires_grad=False))
    stage.use_kernels(stage.ops)
    return replaced


def dense_twin(step, stage):
    """The same step with the stage's converted matmul weights swapped for dense ones while it runs."""
    names = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    owners = [(i, n) for i in range(len(stage.layers)) for n in names] + ([(-1, "lm_head")] if stage.is_last else [])
    chosen = {(i, n): getattr(stage if i < 0 else stage.layers[i], n) for i, n in owners}
    if all(weight_form(w) == "dense" for w in chosen.values()):
        raise SystemExit("--dense: this stage's weights are dense already (F.linear was chosen or is the only path)")
    dense = {key: dense_weight(w) for key, w in chosen.items()}

    def step_dense() -> torch.Tensor:
        swap_weights(stage, dense)
        try:
            return step()
        finally:
            swap_weights(stage, chosen)

    return step_dense


def transformers_step(model_dir, dtype: torch.dtype, context_lens: list[int]):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    rows, width = len(context_lens), max(context_lens)
    past_len = width - 1
    mask = torch.tensor([[0] * (width - c) + [1] * c for c in context_lens])
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cache = transformers.DynamicCache()
    for layer in range(cfg.num_hidden_layers):
        shape = (rows, cfg.num_key_value_heads, past_len, head_dim)
        cache.update(torch.randn(shape, dtype=dtype) * 0.5, torch.randn(shape, dtype=dtype) * 0.5, layer)
    token_ids = torch.randint(3, cfg.vocab_size, (rows, 1))
    positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -1:]

    def step() -> torch.Tensor:
        with torch.no_grad():
            out = model(
                input_ids=token_ids, attention_mask=mask, position_ids=positions, cache=cache,
                use_cache=True, logits_to_keep=1,
            )
        cache.crop(-1)  # drop this step's token: every timed step sees the same context
        return out.logits[:, -1].argmax(-1)

    return step


def time_steps(step, num_steps: int) -> list[float]:
    step()
    times = []
    for _ in range(num_steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def profile_shares(step, num_steps: int) -> tuple[float, list[tuple[str, float, int]]]:
    """(profiled ms per step, [(group, share of self CPU time, calls per step)]) heaviest first."""
    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(num_steps):
            step()
    self_us: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for event in prof.key_averages():
        group = GROUPS.get(event.key, event.key)
        self_us[group] += event.self_cpu_time_total
        calls[group] += event.count
    total = sum(self_us.values())
    rows = sorted(((g, us / total, calls[g] // num_steps) for g, us in self_us.items()), key=lambda r: -r[1])
    return total / num_steps / 1000, rows


def report(name: str, times: list[float], total_ms: float, shares, top: int) -> None:
    print(f"\n{name}: median {statistics.median(times) * 1000:.1f} ms per step "
          f"(min {min(times) * 1000:.1f}), {total_ms:.1f} ms per step under the profiler")
    for group, share, num_calls in shares[:top]:
        print(f"  {share * 100:5.1f}%  {share * total_ms:6.2f} ms  {num_calls:5d} calls  {group}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="Hugging Face style folder (default: the default model)")
    parser.add_argument("--dtype", default="auto", help="as `graphrt serve --dtype` (default: auto)")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--min-ctx", type=int, default=17, help="shortest context, this step's token included")
    parser.add_argument("--max-ctx", type=int, default=192)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3, help="timing rounds, the two sides interleaved")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--no-hf", action="store_true", help="graphrt only")
    parser.add_argument("--dense", action="store_true", help="also graphrt with dense matmul weights (MKL)")
    args = parser.parse_args()

    rng = random.Random(0)
    context_lens = [rng.randint(args.min_ctx, args.max_ctx) for _ in range(args.rows)]
    llm = LLM(model=args.model, dtype=args.dtype, kv_cache_tokens=args.rows * (args.max_ctx + 16) + 64, buckets=[args.rows])
    token_ids, meta = build_decode_step(llm, context_lens)
    sides = {"graphrt": graphrt_step(llm, token_ids, meta)}
    if args.dense:
        if len(llm.engine.pipeline.stages) != 1:
            raise SystemExit("--dense needs a single stage")
        sides["graphrt dense"] = dense_twin(sides["graphrt"], llm.engine.pipeline.stages[0])
    if not args.no_hf:
        sides["transformers"] = transformers_step(llm.engine.model_dir, llm.engine.dtype, context_lens)
    print(f"{args.rows} rows, contexts {min(context_lens)}..{max(context_lens)} (mean {statistics.mean(context_lens):.0f}), "
          f"{torch.get_num_threads()} threads, {llm.engine.dtype}")
    times: dict[str, list[float]] = defaultdict(list)
    for _ in range(args.rounds):
        for name, step in sides.items():
            times[name] += time_steps(step, args.steps)
    for name, step in sides.items():
        total_ms, shares = profile_shares(step, args.steps)
        report(name, times[name], total_ms, shares, args.top)
    print()
    for name, side_times in times.items():
        if name != "graphrt":
            ratio = statistics.median(side_times) / statistics.median(times["graphrt"])
            print(f"{name} / graphrt step time: {ratio:.2f}x")
    llm.engine.close()


if __name__ == "__main__":
    main()
