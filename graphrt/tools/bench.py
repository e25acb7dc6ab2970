"""`graphrt bench`: an offline workload through the ring, and optionally through transformers.

Requests are random token ids with seeded random prompt and output lengths, all submitted at
once; EOS is ignored so every request produces exactly its output length. With a shared prefix,
every prompt starts with the same tokens (a system prompt) before its own, which the prefix cache
computes once. transformers runs the
same requests in static batches of the same maximum size (left-padded, each batch generating
until its longest request is done); only the requested tokens count for both.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch

from graphrt.engine.stats import SpecStats
from graphrt.frontend.output_processor import OutputProcessor
from graphrt.llm import LLM
from graphrt.sampling_params import SamplingParams


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    output_len: int


def make_workload(
    num_requests: int, input_range: tuple[int, int], output_range: tuple[int, int], vocab_size: int, seed: int, shared_prefix: int = 0,
) -> list[Request]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab_size) for _ in range(shared_prefix)]
    return [
        Request(
            prompt=prefix + [rng.randrange(3, vocab_size) for _ in range(rng.randint(*input_range))],
            output_len=rng.randint(*output_range),
        )
        for _ in range(num_requests)
    ]


def percentiles(values: list[float]) -> dict[str, float] | None:
    """Mean, median, p90 and p99, interpolated between neighbours as numpy's percentile (which vLLM's
    and SGLang's benchmarks use: at a dozen requests, the nearest rank made p90 = p99 = the
    largest); None for no values (TPOT where every request made one token)."""
    if not values:
        return None
    ordered = sorted(values)

    def at(q: float) -> float:
        position = q * (len(ordered) - 1)
        low = int(position)
        high = min(low + 1, len(ordered) - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (position - low)

    return {"mean": sum(ordered) / len(ordered), "p50": at(0.50), "p90": at(0.90), "p99": at(0.99)}


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


@dataclass
class BenchResult:
    name: str
    seconds: float
    output_tokens: int
    num_requests: int
    prompt_tokens: int
    ttft_s: dict[str, float] | None = None
    tpot_s: dict[str, float] | None = None
    weight_gb_s: float | None = None
    weight_note: str = ""  # what weight_gb_s counts, where not every weight (WeightReads.counting_note)
    prefix_hit_rate: float | None = None  # prompt tokens taken from the prefix cache, of those looked up
    spec: SpecStats | None = None  # speculative decoding's counts over the run, where it was on

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tok_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.seconds

    def lines(self) -> list[str]:
        out = [
            f"{self.name}: {plural(self.output_tokens, 'output token')} from {plural(self.num_requests, 'request')} "
            f"({plural(self.prompt_tokens, 'prompt token')}) in {self.seconds:.2f} s",
            # vLLM's `bench throughput` line's words (indented under the run's name), for the scripts that grep it
            f"  Throughput: {self.num_requests / self.seconds:.2f} requests/s, {self.total_tok_s:.2f} total tokens/s, "
            f"{self.output_tok_s:.2f} output tokens/s",
        ]
        if self.ttft_s:
            fmt = lambda d: ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in d.items()) if d else "- (every request made one token)"  # noqa: E731
            out.append(f"  TTFT {fmt(self.ttft_s)}; TPOT {fmt(self.tpot_s)}")
        if self.weight_gb_s is not None:
            out.append(f"  weight bandwidth during decode: {self.weight_gb_s:.1f} GB/s{self.weight_note}")
        if self.prefix_hit_rate is not None:
            out.append(f"  prefix cache hit rate: {self.prefix_hit_rate:.1%} of prompt tokens")
        if self.spec is not None:
            out.append(f"  {self.spec.describe()}")
        return out

    def to_json(self) -> dict:
        """For --output-json: vLLM's `bench throughput` keys, then graphrt's own."""
        ms = lambda d: {k: v * 1000 for k, v in d.items()} if d else None  # noqa: E731
        return {
            "elapsed_time": self.seconds, "num_requests": self.num_requests, "total_num_tokens": self.prompt_tokens + self.output_tokens,
            "requests_per_second": self.num_requests / self.seconds, "tokens_per_second": self.total_tok_s,
            "output_tokens_per_second": self.output_tok_s, "name": self.name, "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens, "ttft_ms": ms(self.ttft_s), "tpot_ms": ms(self.tpot_s),
            "weight_gb_per_s": self.weight_gb_s, "prefix_cache_hit_rate": self.prefix_hit_rate,
            "spec_decode_acceptance_rate": self.spec.acceptance_rate if self.spec is not None else None,
        }


def run_graphrt(llm: LLM, workload: list[Request]) -> BenchResult:
    engine = llm.engine
    # Warm-up: one short request, so first-call costs don't count; its prompt is the first one
    # reversed, which shares no prefix with any request.
    llm.generate([workload[0].prompt[::-1]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    allocator = engine.allocator
    stats = engine.stats
    before = (stats.decode_weight_bytes, stats.decode_seconds, allocator.num_queried_tokens, allocator.num_hit_tokens)
    spec_before = engine.stats.spec.copy()
    start = time.perf_counter()
    seqs = [
        engine.add_request(r.prompt, SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True))
        for r in workload
    ]
    processor = OutputProcessor(llm.tokenizer)  # detokenizing is part of serving
    for seq in seqs:
        processor.add(seq.request_id, seq.params)
    try:
        while engine.has_work():
            processor.process(engine.step())
    except BaseException:  # Ctrl+C: nothing left to run when the caller closes the engine
        for seq in seqs:
            engine.abort(seq)
        raise
    seconds = time.perf_counter() - start
    ttft = [s.first_token_time - s.arrival_time for s in seqs]
    tpot = [(s.last_token_time - s.first_token_time) / (len(s.output_ids) - 1) for s in seqs if len(s.output_ids) > 1]
    weight_bytes = engine.stats.decode_weight_bytes - before[0]
    decode_seconds = engine.stats.decode_seconds - before[1]
    queried, hits = allocator.num_queried_tokens - before[2], allocator.num_hit_tokens - before[3]
    return BenchResult(
        name=f"graphrt pp={engine.stage_plan.pp} depth={engine.depth} {str(engine.dtype).removeprefix('torch.')}",
        seconds=seconds,
        output_tokens=sum(len(s.output_ids) for s in seqs),
        num_requests=len(seqs),
        prompt_tokens=sum(len(r.prompt) for r in workload),
        ttft_s=percentiles(ttft),
        tpot_s=percentiles(tpot),
        weight_gb_s=weight_bytes / decode_seconds / 1e9 if decode_seconds else None,
        weight_note=engine.weight_reads.counting_note(),
        prefix_hit_rate=hits / queried if engine.config.prefix_caching and queried else None,
        spec=engine.stats.spec.since(spec_before) if engine.config.speculative_config is not None else None,
    )


def run_transformers(model_dir, workload: list[Request], batch_size: int, dtype: torch.dtype) -> BenchResult:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.generation_config.pad_token_id = 0
    start = time.perf_counter()
    for first in range(0, len(workload), batch_size):
        batch = workload[first : first + batch_size]
        width = max(len(r.prompt) for r in batch)
        ids = torch.tensor([[0] * (width - len(r.prompt)) + r.prompt for r in batch])
        mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in batch])
        new_tokens = max(r.output_len for r in batch)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    seconds = time.perf_counter() - start
    return BenchResult(
        name=f"transformers generate (static batches of {batch_size})",
        seconds=seconds,
        output_tokens=sum(r.output_len for r in workload),
        num_requests=len(workload),
        prompt_tokens=sum(len(r.prompt) for r in workload),
    )


def summarize(ours: BenchResult, theirs: BenchResult | None) -> str:
    lines = ours.lines()
    if theirs is not None:
        lines += theirs.lines()
        lines.append(f"graphrt / transformers output tok/s: {ours.output_tok_s / theirs.output_tok_s:.2f}x")
    return "\n".join(lines)
