"""Prometheus metrics for /metrics, in a registry of the server's own (no process-wide state).

Each stage's busy fraction is `rate(graphrt_stage_busy_seconds_total[1m])`: the counter adds the
seconds the stage spent on micro-batches (with --procs, the other processes' stages as of the last
micro-batch that came back from them).
"""

from __future__ import annotations

import itertools
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from graphrt.engine.core import EngineSnapshot
from graphrt.engine.grammar import COMPILE_SECONDS_BUCKETS
from graphrt.server.responses import ChoiceState

# stop / length: finished normally; abort: the client went away or the server shut down;
# rejected: answered with a 4xx; error: answered with a 5xx
OUTCOMES = ("stop", "length", "abort", "rejected", "error")
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)  # vLLM's


class EngineCollector(Collector):
    """Reads the engine thread's latest snapshot at scrape time."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot]):
        self._snapshot = snapshot

    def collect(self):
        snap = self._snapshot()
        usable_blocks = snap.num_blocks - 1  # block 0 is scratch
        yield GaugeMetricFamily("graphrt_requests_running", "Requests that have produced a token and are not finished", value=snap.num_running)
        yield GaugeMetricFamily("graphrt_requests_waiting", "Requests in the engine that have not produced a token yet", value=snap.num_waiting)
        yield GaugeMetricFamily("graphrt_kv_blocks_used", "KV cache blocks held by requests", value=usable_blocks - snap.num_free_blocks)
        yield GaugeMetricFamily(
            "graphrt_kv_blocks_free", "KV cache blocks free or cached for later prefix hits (the scratch block not counted)",
            value=snap.num_free_blocks,
        )
        yield GaugeMetricFamily(
            "graphrt_kv_blocks_cached", "Of the free blocks, those holding a prefix a later prompt may reuse", value=snap.num_cached_blocks
        )
        yield CounterMetricFamily(
            "graphrt_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", value=snap.prefix_queried_tokens
        )
        yield CounterMetricFamily(
            "graphrt_prefix_cache_hits", "Prompt tokens taken from the prefix cache instead of computed", value=snap.prefix_hit_tokens
        )
        hit_rate = snap.prefix_hit_tokens / snap.prefix_queried_tokens if snap.prefix_queried_tokens else 0.0
        yield GaugeMetricFamily("graphrt_prefix_cache_hit_rate", "Prefix cache hits over queries, in tokens, since start", value=hit_rate)
        yield CounterMetricFamily("graphrt_eager_fallbacks", "Decode micro-batches that ran eagerly instead of replaying a graph", value=snap.num_eager_fallbacks)
        yield CounterMetricFamily(
            "graphrt_preemptions", "Sequences that gave their KV blocks back when the cache was full, to be recomputed", value=snap.num_preemptions
        )
        busy = CounterMetricFamily(
            "graphrt_stage_busy_seconds", "Seconds each pipeline stage spent on micro-batches; its rate is the busy fraction",
            labels=["stage"],
        )
        for stage, seconds in enumerate(snap.stage_busy_s):
            busy.add_metric([str(stage)], seconds)
        yield busy
        # Speculative decoding, named as vLLM names it (0 while it is off).
        yield CounterMetricFamily("graphrt_spec_decode_num_drafts", "Rows verified with drafts", value=snap.spec_num_drafts)
        yield CounterMetricFamily("graphrt_spec_decode_num_draft_tokens", "Draft tokens verified", value=snap.spec_num_draft_tokens)
        yield CounterMetricFamily(
            "graphrt_spec_decode_num_accepted_tokens", "Draft tokens accepted", value=snap.spec_num_accepted_tokens
        )
        per_position = CounterMetricFamily(
            "graphrt_spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position in the row's drafts",
            labels=["position"],
        )
        for position, count in enumerate(snap.spec_accepted_per_position):
            per_position.add_metric([str(position)], count)
        yield per_position
        if any(snap.stage_expert_tokens):
            yield from expert_load(snap.stage_expert_tokens)
        if snap.expert_ranks:
            yield from expert_ranks(snap.expert_ranks)
        yield from structured_outputs(snap)


def structured_outputs(snap: EngineSnapshot):
    """Grammar-constrained requests (graphrt.engine.grammar): how many, their grammars' compile times,
    and the rows that waited for their newest token to be read back before their next mask."""
    yield CounterMetricFamily("graphrt_structured_output_requests", "Requests added with a grammar (structured output)", value=snap.num_constrained)
    cumulative = list(itertools.accumulate(snap.grammar_compile_counts or [0] * (len(COMPILE_SECONDS_BUCKETS) + 1)))
    buckets = [(str(bound), count) for bound, count in zip(COMPILE_SECONDS_BUCKETS, cumulative)] + [("+Inf", cumulative[-1])]
    yield HistogramMetricFamily(
        "graphrt_grammar_compile_seconds", "Seconds each distinct grammar took to compile (a cached one compiles once)",
        buckets=buckets, sum_value=snap.grammar_compile_seconds,
    )
    yield GaugeMetricFamily(
        "graphrt_structured_output_rows_waiting", "Constrained rows that waited for their newest token before their next mask, at the last schedule",
        value=snap.num_waiting_on_mask,
    )


def expert_load(stage_expert_tokens: tuple[tuple[int, ...], ...]):
    """A mixture of experts' load: each stage's tokens per expert (summed over its sparse layers, a
    graph's padding rows not counted), the histogram over experts a dashboard draws, and how far
    its busiest expert is above the mean (1 is perfectly even; expert parallelism waits on the busiest)."""
    tokens = CounterMetricFamily(
        "graphrt_moe_expert_tokens", "Tokens a stage's sparse layers routed to each expert (one per layer and choice)",
        labels=["stage", "expert"],
    )
    imbalance = GaugeMetricFamily(
        "graphrt_moe_expert_load_imbalance", "A stage's busiest expert's tokens over the mean expert's, since start",
        labels=["stage"],
    )
    for stage, counts in enumerate(stage_expert_tokens):
        for expert, count in enumerate(counts):
            tokens.add_metric([str(stage), str(expert)], count)
        if counts and sum(counts):
            imbalance.add_metric([str(stage)], max(counts) * len(counts) / sum(counts))
    yield tokens
    yield imbalance


def expert_ranks(ranks: tuple[tuple[int, int, float, float, int], ...]):
    """Expert parallelism, rank by rank (labelled by stage and global rank): busy time, time waiting
    in the sparse layers' all-reduces (its share of busy is what the collective costs; gloo only),
    and the tokens the rank's own experts served (how even the split is)."""
    families = [
        CounterMetricFamily("graphrt_ep_rank_busy_seconds", "Seconds each expert rank spent on micro-batches", labels=["stage", "rank"]),
        CounterMetricFamily(
            "graphrt_ep_combine_seconds", "Seconds each expert rank waited in its sparse layers' all-reduces (gloo; 0 on NCCL, inside the graphs)",
            labels=["stage", "rank"],
        ),
        CounterMetricFamily(
            "graphrt_ep_rank_expert_tokens", "Tokens routed to each expert rank's experts (one per sparse layer and choice)", labels=["stage", "rank"],
        ),
    ]
    ep = 1 + max(expert_rank for _, expert_rank, *_ in ranks)
    for stage, expert_rank, *values in ranks:
        for family, value in zip(families, values):
            family.add_metric([str(stage), str(stage * ep + expert_rank)], value)
    yield from families


# graphrt's families under the names vLLM's dashboards read (its V1 engine's), each with vLLM's
# model_name label; counters keep their _total. graphrt's own names stay beside them.
VLLM_NAMES = {
    "graphrt_requests_running": "vllm:num_requests_running",
    "graphrt_requests_waiting": "vllm:num_requests_waiting",
    "graphrt_prompt_tokens": "vllm:prompt_tokens",
    "graphrt_generation_tokens": "vllm:generation_tokens",
    "graphrt_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "graphrt_time_per_output_token_seconds": "vllm:time_per_output_token_seconds",
    "graphrt_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "graphrt_prefix_cache_queries": "vllm:prefix_cache_queries",
    "graphrt_prefix_cache_hits": "vllm:prefix_cache_hits",
    "graphrt_preemptions": "vllm:num_preemptions",
    "graphrt_spec_decode_num_drafts": "vllm:spec_decode_num_drafts",
    "graphrt_spec_decode_num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "graphrt_spec_decode_num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
    "graphrt_spec_decode_num_accepted_tokens_per_pos": "vllm:spec_decode_num_accepted_tokens_per_pos",
}
FINISHED_REASONS = ("stop", "length", "abort")  # the outcomes vLLM's vllm:request_success counts, by finished_reason


class VllmNames(Collector):
    """At scrape time, the `sources`' families named in VLLM_NAMES again under vLLM's names, and
    vllm:kv_cache_usage_perc and vllm:request_success from graphrt's block gauges and outcomes."""

    def __init__(self, sources: list[Collector], model_name: str):
        self.sources, self.model_name = sources, model_name

    def collect(self):
        families = {family.name: family for source in self.sources for family in source.collect()}
        label = {"model_name": self.model_name}
        for name, vllm_name in VLLM_NAMES.items():
            family = families.get(name)
            if family is None:
                continue
            renamed = Metric(vllm_name, family.documentation, family.type)
            for sample in family.samples:
                if not sample.name.endswith("_created"):
                    renamed.add_sample(vllm_name + sample.name.removeprefix(name), {**sample.labels, **label}, sample.value)
            yield renamed
        used, free = (families[name].samples[0].value for name in ("graphrt_kv_blocks_used", "graphrt_kv_blocks_free"))
        for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):  # the second: vLLM's name before 0.10, in many dashboards
            usage = GaugeMetricFamily(name, "KV cache usage, 1 is full", labels=list(label))
            usage.add_metric([self.model_name], used / (used + free) if used + free else 0.0)
            yield usage
        success = CounterMetricFamily("vllm:request_success", "Finished requests, by finished_reason", labels=["model_name", "finished_reason"])
        by_outcome = {sample.labels["outcome"]: sample.value for sample in families["graphrt_requests"].samples if sample.name.endswith("_total")}
        for reason in FINISHED_REASONS:
            success.add_metric([self.model_name, reason], by_outcome[reason])
        yield success


class ServerMetrics:
    def __init__(self, snapshot: Callable[[], EngineSnapshot], model_name: str = "graphrt"):
        """`model_name`: the served model's name, the label vLLM's names carry."""
        self.registry = CollectorRegistry()
        self.requests = Counter("graphrt_requests", "Requests by outcome: " + ", ".join(OUTCOMES), ["outcome"], registry=self.registry)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)  # show every outcome from the start, at 0
        self.prompt_tokens = Counter("graphrt_prompt_tokens", "Prompt tokens of admitted requests", registry=self.registry)
        self.generation_tokens = Counter("graphrt_generation_tokens", "Tokens generated, all choices", registry=self.registry)
        self.ttft = Histogram(
            "graphrt_time_to_first_token_seconds", "From the request's arrival to its first token",
            buckets=TTFT_BUCKETS, registry=self.registry,
        )
        self.tpot = Histogram(
            "graphrt_time_per_output_token_seconds", "Mean time between a choice's tokens after its first",
            buckets=TPOT_BUCKETS, registry=self.registry,
        )
        self.e2e = Histogram(
            "graphrt_e2e_request_latency_seconds", "From a request's arrival to its last token (requests the engine ran)",
            buckets=E2E_BUCKETS, registry=self.registry,
        )
        engine = EngineCollector(snapshot)
        self.registry.register(engine)
        own = [self.requests, self.prompt_tokens, self.generation_tokens, self.ttft, self.tpot, self.e2e, engine]
        self.registry.register(VllmNames(own, model_name))

    def count(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()

    def count_tokens(self, count: int, first_token_s: float | None = None) -> None:
        """A request's new tokens, as they come: dashboards see throughput and time to first token
        while the request runs (as vLLM counts them each step), not in one jump when it ends.
        `first_token_s`: the request's first token came now, this long after it arrived."""
        self.generation_tokens.inc(count)
        if first_token_s is not None:
            self.ttft.observe(first_token_s)

    def observe(self, arrived_at: float, choices: list[ChoiceState], finished: bool) -> None:
        """Time per output token of a request the engine ran (finished or aborted), and, as vLLM
        counts it, the whole latency of one that finished (stop or length)."""
        if finished:
            self.e2e.observe(max(c.last_at for c in choices if c.last_at is not None) - arrived_at)
        for choice in choices:
            if choice.num_tokens > 1:
                self.tpot.observe((choice.last_at - choice.first_at) / (choice.num_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
