"""Mixture-of-experts decode: graphrt against transformers' `generate` on the same random model (issue 32).

    python benchmarks/moe_bench.py [--family qwen3-moe|deepseek-v3] [--experts 16] [--top-k 2]
        [--hidden 512] [--layers 8] [--expert-size 512] [--batches 1,32] [--tokens 16] [--prompt 16] [--rounds 3]
        [--switch-pause 2.5]

The model is random, written with graphrt.tools.synthetic.make_tiny_model, float32 on both sides:
a Qwen3-MoE (every layer sparse, top-k renormalized), or a DeepSeek-V3 (latent attention with a
low-rank query, kv_lora_rank hidden / 4, heads of 64 + 32 rotary dimensions, the experts in 4 groups
of which tokens choose among the best 2 (one group where the experts are too few), one shared expert, every layer sparse). At each batch size B both engines decode B
prompts of --prompt random tokens greedily (EOS ignored); decode tok/s is (N - 1) * B over the time
of an N-token generation less that of a 1-token one (the prompt's time cancels), on the wall clock
for both. Rounds interleave the engines and batch sizes; medians with the spread (min-max) are
reported, since other programs may share the machine. transformers runs in a process of its own:
in one process each engine's idle OpenMP threads throttled the other's (libgomp shortens every
team's spin once it manages more threads than there are cores; graphrt.kernels.cpu.openmp), which
cut graphrt to about a third and transformers by a fifth at 32 rows. Each switch from one engine to
the other waits --switch-pause seconds, so neither starts while the other's threads wind down.

Weight GB/s counts what a decode step reads by graphrt/model/weight_reads.py: the dense weights
plus, per layer, E * (1 - (1 - k/E)^B) experts (the expected distinct experts B rows choose), at
the measured steps per second.
"""

from __future__ import annotations

import argparse
import multiprocessing
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers

from graphrt import LLM, SamplingParams
from graphrt.model.kv_cache import values_per_token
from graphrt.model.weight_reads import expected_experts_read
from graphrt.tools.synthetic import make_tiny_model

# Longer than graphrt's team sizer keeps a measurement (kernels/cpu/openmp.py TeamSizer.STALE_S, 2 s):
# graphrt's stage threads never size their team by what transformers' process did before them.
SWITCH_PAUSE_S = 2.5


def write_model(folder: Path, args: argparse.Namespace) -> Path:
    """A random model of `args.family` and the sizes asked for; heads of 64 (or the hidden size, if smaller)."""
    head_dim = min(64, args.hidden)
    overrides = dict(
        hidden_size=args.hidden, num_hidden_layers=args.layers, num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.expert_size, intermediate_size=args.expert_size, vocab_size=args.vocab,
        num_attention_heads=args.hidden // head_dim, max_position_embeddings=args.prompt + args.tokens + 8,
    )
    if args.family == "deepseek-v3":
        grouped = args.experts % 4 == 0 and args.experts >= 8 and args.top_k <= args.experts // 2
        overrides.update(
            n_routed_experts=args.experts, n_group=4 if grouped else 1, topk_group=2 if grouped else 1, first_k_dense_replace=0, n_shared_experts=1,
            num_key_value_heads=args.hidden // head_dim, q_lora_rank=args.hidden // 2, kv_lora_rank=args.hidden // 4,
            qk_nope_head_dim=head_dim, qk_rope_head_dim=head_dim // 2, v_head_dim=head_dim,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        )
    else:
        overrides.update(num_experts=args.experts, num_key_value_heads=max(1, args.hidden // head_dim // 2), head_dim=head_dim)
    return make_tiny_model(folder, args.family, overrides=overrides)


def kv_values_per_token(llm: LLM) -> str:
    """What one layer caches per token, and for latent attention what its heads' keys and values would take."""
    cfg = llm.engine.model_config
    cached = values_per_token(cfg)
    if cfg.mla is None:
        return f"{cached} values a token a layer (K and V)"
    plain = cfg.num_heads * (cfg.mla.qk_head_dim + cfg.mla.v_head_dim)
    return (f"{cached} values a token a layer (MLA latent), against {plain} for its heads' keys and values "
            f"uncompressed ({plain / cached:.1f}x)")


def prompts(batch: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(length)] for _ in range(batch)]


def graphrt_seconds(llm: LLM, batch_prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(batch_prompts, params)
    return time.perf_counter() - start


def transformers_seconds(model, batch_prompts: list[list[int]], new_tokens: int) -> float:
    ids = torch.tensor(batch_prompts)  # every prompt has the same length: no padding
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return time.perf_counter() - start


def serve_transformers(model_dir: str, conn) -> None:
    """The child process: load the model, then time each (prompts, new tokens) it is sent until None."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    conn.send("ready")
    while (job := conn.recv()) is not None:
        conn.send(transformers_seconds(model, *job))


class TransformersProcess:
    """transformers' generate on the same model, in a process of its own (see the module's docstring)."""

    def __init__(self, model_dir: str):
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no OpenMP state inherited
        self.conn, child_conn = context.Pipe()
        self.process = context.Process(target=serve_transformers, args=(model_dir, child_conn), daemon=True)
        self.process.start()
        child_conn.close()  # the child's end lives in the child: its death is an EOF here
        if self._answer() != "ready":
            raise RuntimeError("the transformers process did not load the model")

    def seconds(self, batch_prompts: list[list[int]], new_tokens: int) -> float:
        self.conn.send((batch_prompts, new_tokens))
        return self._answer()

    def _answer(self):
        try:
            return self.conn.recv()
        except EOFError:
            self.process.join(5)
            raise RuntimeError(f"the transformers process exited with code {self.process.exitcode}; its output says why") from None

    def close(self) -> None:
        self.conn.send(None)
        self.process.join(30)


def decode_rate(run, batch_prompts: list[list[int]], new_tokens: int) -> float:
    """Decode tok/s: the tokens after the first over the time they add to a 1-token generation."""
    return (new_tokens - 1) * len(batch_prompts) / (run(batch_prompts, new_tokens) - run(batch_prompts, 1))


def step_bytes(llm: LLM, batch: int) -> float:
    """Weight bytes a decode step of `batch` rows reads, by the rule of graphrt/model/weight_reads.py
    (transformers runs the same model, so its steps read the same)."""
    return llm.engine.weight_reads.at(batch)


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=["qwen3-moe", "deepseek-v3"], default="qwen3-moe")
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--expert-size", type=int, default=512, help="each expert's intermediate size")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--batches", default="1,32", help="decode batch sizes, comma-separated")
    parser.add_argument("--tokens", type=int, default=16, help="new tokens per request in the timed generation")
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens per request")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--switch-pause", type=float, default=SWITCH_PAUSE_S,
                        help="seconds to wait before each run of the other engine (0: a quick check)")
    args = parser.parse_args()
    if args.tokens < 2:
        parser.error("--tokens must be at least 2: the decode rate is the tokens after the first")
    batches = [int(b) for b in args.batches.split(",")]

    with tempfile.TemporaryDirectory() as folder:
        model_dir = write_model(Path(folder) / "moe", args)
        reference = TransformersProcess(str(model_dir))
        llm = LLM(model=model_dir, dtype="float32", max_num_seqs=max(batches), max_batch=max(batches))
        try:
            measure(args, batches, llm, reference)
        finally:
            llm.engine.close()
            reference.close()


def measure(args: argparse.Namespace, batches: list[int], llm: LLM, reference: TransformersProcess) -> None:
    """Interleaved rounds of both engines at each batch size, then the table."""
    engines = {"graphrt": lambda p, n: graphrt_seconds(llm, p, n), "transformers": reference.seconds}
    inputs = {batch: prompts(batch, args.prompt, args.vocab, seed=batch) for batch in batches}
    for name, run in engines.items():  # warm-up: first calls, kernel choices, allocator growth
        run(inputs[max(batches)], 2)
    rates = {(name, batch): [] for name in engines for batch in batches}
    for _ in range(args.rounds):
        for batch in batches:
            for name, run in engines.items():
                time.sleep(args.switch_pause)
                rates[name, batch].append(decode_rate(run, inputs[batch], args.tokens))

    total = llm.engine.weight_reads.total_bytes
    print(f"machine: {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"transformers {transformers.__version__}")
    print(f"model: {args.family}, {args.layers} layers, hidden {args.hidden}, {args.experts} experts of {args.expert_size}, "
          f"top-{args.top_k}, vocab {args.vocab}, float32, {total / 1e6:.1f} MB of weights; KV cache: {kv_values_per_token(llm)}")
    print(f"decode: {args.tokens} new tokens after {args.prompt}-token prompts, {args.rounds} interleaved rounds, "
          "median (min-max)")
    print("| batch | expected experts per layer | MB read per step | graphrt tok/s | transformers tok/s | ratio | "
          "graphrt GB/s | transformers GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    for batch in batches:
        ours, theirs = rates["graphrt", batch], rates["transformers", batch]
        read = step_bytes(llm, batch)
        experts = expected_experts_read(args.experts, args.top_k, batch)
        gb_s = lambda rate: f"{statistics.median(rate) / batch * read / 1e9:.2f}"  # noqa: E731 - steps/s * bytes/step
        print(f"| {batch} | {experts:.2f} of {args.experts} | {read / 1e6:.1f} | {spread(ours)} | {spread(theirs)} | "
              f"{statistics.median(ours) / statistics.median(theirs):.2f}x | {gb_s(ours)} | {gb_s(theirs)} |")


if __name__ == "__main__":
    main()
