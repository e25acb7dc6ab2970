"""The engine: pipeline, KV cache, scheduler and sampler, stepped until done; token ids in, token ids out."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

from graphrt.capture.buckets import CPU_DEFAULT_MAX_BATCH, GPU_MAX_BATCH_LIMIT, BucketPlan, default_buckets, default_max_batch
from graphrt.capture.capture import capture_stage
from graphrt.capture.manifest import (
    StaleCacheError,
    cached_cpu_kernels,
    cached_matmul_plans,
    device_name,
    model_fingerprint,
    read_manifest,
    software_versions,
    stale_fields,
)
from graphrt.capture.report import layer_span
from graphrt.config import EngineConfig
from graphrt.distributed.handshake import StagePlan
from graphrt.distributed.remote import Cluster, load_first_stage
from graphrt.distributed.transport import RankStats, StageFailure
from graphrt.engine.block_allocator import BlockAllocator
from graphrt.engine.draft_model import DraftModelDrafter
from graphrt.engine.drafter import Drafter, NgramDrafter, StepCosts
from graphrt.engine.grammar import Grammars
from graphrt.engine.kv_budget import kv_blocks_that_fit, measure_headroom
from graphrt.engine.scheduler import Scheduler
from graphrt.engine.sequence import FinishReason, Sequence, SequenceOutput
from graphrt.engine.stats import EngineStats
from graphrt.errors import GraphrtError, ModelLoadError, RequestError, StageError
from graphrt.kernels import argmax
from graphrt.kernels.cpu.kernel_choice import argmax_path, choose_greedy_argmax
from graphrt.kernels.cpu.kernel_choice import mode_from_env as cpu_kernel_mode_from_env
from graphrt.kernels.cpu.openmp import LoadWatch, release_thread_pool
from graphrt.model.config import ModelConfig
from graphrt.model.eos import tokenizer_eos_token_id
from graphrt.model.kv_cache import bytes_per_block
from graphrt.model.moe import ExpertShard, check_expert_parallel
from graphrt.model.weight_reads import WeightReads
from graphrt.model.weights import WeightFiles
from graphrt.profiling.nvtx import Ranges
from graphrt.profiling.timeline import Timeline
from graphrt.runtime.pipeline import Pipeline, partition_layers, stage_read_shares
from graphrt.runtime.ring import MicroBatch, Ring, build_inputs
from graphrt.runtime.sampler import Sampler
from graphrt.runtime.step import ScheduledStep
from graphrt.sampling_params import SamplingParams

logger = logging.getLogger("graphrt")

CPU_KV_CACHE_BYTES = 1 << 30  # default KV budget on a CPU (on GPUs: graphrt.engine.kv_budget)
GRAMMAR_WAIT_S = 0.005  # an idle engine waits this long at most for a grammar to compile, then looks for new requests


class Engine:
    def __init__(
        self, model_dir: Path, config: EngineConfig, cache_dir: Path | None = None, show_progress: bool = False,
        eos_token_id: Callable[[], int | None] | None = None,
        load_colleagues: tuple[int, ...] = (),
    ):
        """The engine takes token ids only; text stays with its caller. `eos_token_id`: a function
        returning the tokenizer's EOS id (a caller loading the tokenizer for text waits for it
        there); None reads it from the model folder (graphrt.model.eos). Either runs on a thread
        beside the weights and is waited for before the kernels are timed. `load_colleagues`: processes
        whose CPU counts as this one's while it loads (see LoadWatch), not as a busy neighbour's."""
        load_watch = LoadWatch(colleagues=load_colleagues)  # what other processes do while this loads: the kernels are timed for it
        self.model_dir = Path(model_dir)
        if self.model_dir.is_file():
            raise ModelLoadError(f"--model {self.model_dir} is a file; pass the Hugging Face style folder that holds it (--model {self.model_dir.parent})")
        if not self.model_dir.is_dir():
            parts = self.model_dir.parts  # a hub id reads as "HuggingFaceTB/SmolLM2-135M": no such first folder either
            hub_id = not self.model_dir.is_absolute() and len(parts) == 2 and not Path(parts[0]).exists()
            hint = f" (graphrt reads local folders, not hub ids: `hf download {self.model_dir} --local-dir DIR` first)" if hub_id else ""
            raise ModelLoadError(
                f"model folder {self.model_dir} does not exist{hint}; pass a Hugging Face style model folder (--model DIR, LLM(model=DIR))"
            )
        config.check_devices_here()
        self.config = config
        self.model_config = ModelConfig.from_dir(self.model_dir)
        loader = ThreadPoolExecutor(1, thread_name_prefix="graphrt-tokenizer")
        eos_id = loader.submit(eos_token_id or functools.partial(tokenizer_eos_token_id, self.model_dir))
        loader.shutdown(wait=False)
        files = WeightFiles(self.model_dir)
        self.devices = [torch.device(d) for d in config.stage_devices()]  # one per stage: under --ep, each leader's
        self.dtype = config.resolve_dtype(self.model_config, self.devices[0])
        too_long = config.max_model_len is not None and config.max_model_len > self.model_config.max_position
        if too_long and cache_dir is None:  # a cache's own is checked with the rest of it (_check_graph_cache)
            raise ValueError(
                f"max_model_len {config.max_model_len} is longer than {self.model_dir.name} can attend to "
                f"({self.model_config.max_position} positions: its max_position_embeddings, or a sliding window below it); "
                "pass at most that, or leave it out"
            )
        self.max_model_len = min(config.max_model_len or self.model_config.max_position, self.model_config.max_position)
        check_expert_parallel(self.model_config, config.ep)
        # With procs, stages 1..pp-1 (and with --ep every stage's other expert ranks) live in worker
        # processes (started now, so they boot meanwhile).
        self.cluster = Cluster.start(self.model_dir, config) if config.procs else None
        try:
            self._start(files, cache_dir, show_progress, eos_id, load_watch)
        except BaseException as exc:
            if self.cluster is None:
                raise
            self.cluster.fail_soon(f"the engine (rank 0) failed to start: {exc}")  # workers must not wait out their timeouts
            self.cluster.close()
            if isinstance(exc, StageFailure) and self.cluster.first_exit is not None:
                # rank 0 lost a worker mid-way (an expert rank's all-reduce, a hop): the worker's failure is the news
                name, code = self.cluster.first_exit
                if code < 0:  # a signal (the OOM killer's, say): the worker could print nothing
                    raise StageFailure(f"{name} was killed by signal {-code} while the stages started") from None
                raise StageFailure(f"{name} exited with code {code} while the stages started; its own output says why") from None
            raise

    def _start(
        self, files: WeightFiles, cache_dir: Path | None, show_progress: bool, eos_id: Future, load_watch: LoadWatch
    ) -> None:
        """Load the stages, size the KV cache, capture the graphs, and build the ring."""
        config = self.config
        # Decided once here, before the KV cache is sized, and sent to stage processes in the plan.
        self.partition_rows = self._partition_rows()
        self.layers = partition_layers(self.model_config, config.pp, self.partition_rows)
        self.ranges = Ranges()
        if self.cluster:  # stage 0 (of its routed experts, expert rank 0's share)
            self.pipeline = load_first_stage(
                self.model_config, files, self.devices, self.dtype, self.max_model_len, config.kernels, self.layers,
                ExpertShard(0, config.ep),
            )
        else:
            self.pipeline = Pipeline.load(
                self.model_config, files, self.devices, self.dtype, self.max_model_len, config.kernels, self.layers
            )
        self.backend = "cuda" if config.use_graphs and all(d.type == "cuda" for d in self.devices) else "eager"
        # Before the KV cache is sized: a draft model's weights are in the free memory read, its K/V in a block's bytes.
        draft_model = self._load_draft_model()
        num_blocks = self._num_kv_blocks(draft_model)
        self.pipeline.allocate_kv(num_blocks, config.block_size)
        self.allocator = BlockAllocator(num_blocks, config.block_size)
        self.plan = self._bucket_plan(num_blocks)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        forced_eager = self._check_graph_cache() if self.cache_dir is not None else set()
        # Before timing the matmuls, which the tokenizer's thread would disturb.
        self.tokenizer_eos_id = eos_id.result()
        manifest = read_manifest(self.cache_dir) if self.cache_dir is not None else {}
        cached_matmuls = cached_matmul_plans(manifest) if manifest else None
        cached_ops, cached_argmax = cached_cpu_kernels(manifest)
        greedy_argmax, self.argmax_summary = argmax.greedy_argmax, None
        on_cpu = any(device.type == "cpu" for device in self.devices)
        # Beside busy neighbours the CPU kernels are timed on the smaller team the stage threads will run.
        with load_watch.timing_team() if on_cpu else contextlib.nullcontext() as self.timing_note:
            # Before capture: graphs read the weights in the forms chosen here.
            self.pipeline.choose_kernels(self.plan.max_batch, config.block_size, cached_matmuls, cached_ops)
            if self.samples_here:  # else the last stage's process samples, and chooses its own
                greedy_argmax, self.argmax_summary = choose_greedy_argmax(
                    self.devices[-1], self.model_config.vocab_size, self.plan.max_batch, cpu_kernel_mode_from_env(),
                    cached=cached_argmax,
                )
        self.stage_plan = self._stage_plan(num_blocks)
        if self.cluster:  # the workers load and capture meanwhile; stage 0's other expert ranks capture with this one
            self.cluster.handshake(self.stage_plan)
            if config.ep > 1:
                # Only now: the KV budget's probe above ran stage 0 alone. Its other ranks run what it chose.
                self.cluster.link.publish_kernels(self.pipeline.kernels[0])
                self.pipeline.stages[0].combine_experts_with(self.cluster.link.combine_experts, self.ranges)
        self._capture_graphs(forced_eager, show_progress)
        if self.cluster:
            self.cluster.wait_ready()
            self.cluster.link.started()  # collectives wait at most the watchdog now, and count for the figures
        self.eos_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer_eos_id is not None:
            self.eos_ids.add(self.tokenizer_eos_id)
        self.scheduler = Scheduler(
            self.allocator, config.max_num_seqs, config.prefill_chunk_size, self.max_model_len, self.plan.max_batch,
            eos_ids=frozenset(self.eos_ids), prefix_root=self._prefix_root() if config.prefix_caching else None,
            drafter=self._make_drafter(draft_model, num_blocks),
        )
        self.grammars = Grammars(self.model_dir, self.model_config.vocab_size, sorted(self.eos_ids))
        # With stage processes the last rank samples (and makes each seeded request's generator from
        # the seed it is sent): a sampler here would open a CUDA context on a GPU this rank never uses.
        self.sampler = Sampler(self.devices[-1], config.seed, greedy_argmax) if self.samples_here else None
        local_devices = [stage.device for stage in self.pipeline.stages]
        self.timeline = Timeline(local_devices) if config.timeline else None
        self._chunks_read: dict[int, int] = {}  # worker rank -> timeline chunks gathered (gather_rank_timelines)
        # Decode rows go to as many micro-batches as stages can run at once (+ depth), not to every slot.
        self.num_decode_micro_batches = config.num_decode_micro_batches(self.devices)
        self.ring = (self.cluster.make_ring if self.cluster else Ring)(
            self.pipeline, self.graphs, self.sampler, num_slots=self.stage_plan.num_slots,
            max_tokens=self.stage_plan.max_tokens, block_size=config.block_size,
            max_per_slot=1 + int(config.async_scheduling), timeline=self.timeline, ranges=self.ranges,
            pin=self.devices[0].type == "cuda", eos_ids=frozenset(self.eos_ids),
        )
        self.scheduler.defer_masks = config.async_scheduling and self.ring.defers_masks
        speculation = self.scheduler.speculation
        if speculation is not None:  # what a verify step's extra tokens must pay for, and the guesses where a model makes them
            speculation.step_costs = StepCosts(self.ring.time_decode_steps())
            drafter = speculation.drafter
            drafter.measure_guess_costs([size for size in self.plan.sizes if size < config.max_num_seqs] + [config.max_num_seqs])
            logger.info("speculative decoding: %s", speculation.step_costs.describe())
            if drafter.guess_costs is not None:
                logger.info("draft model: %s", drafter.guess_costs.describe("a round of guesses, ms by rows"))
        self._decode_busy_until = 0.0
        self._blocked_until: float | None = None  # when a blocking read-back that emptied the ring returned, until the next step
        self.synthetic_host_s = 0.0  # host time a synthetic engine adds per micro-batch read back (graphrt.tools.synthetic)
        self.weight_reads = self.pipeline.weight_reads() + (self.cluster.remote_weight_reads if self.cluster else WeightReads(0))
        self.weight_bytes = self.weight_reads.total_bytes  # all of them; a decode step reads weight_reads.decode_bytes
        self.stats = EngineStats(spec=self.scheduler.spec)
        self._experts_read = sum(self.ring.stage_expert_reads)  # by the stages' decode steps, as of the last read-back
        self._ids = itertools.count()
        self._undelivered: list[SequenceOutput] = []  # deltas of a step that raised before returning them
        # The stage threads compute from here on: the calling thread's OpenMP workers go, here and
        # at every step, since torch work the caller does between steps (its own model, say) brings
        # them back, and their idle team alone cut a 32-row MoE decode to a third (graphrt.kernels.cpu.openmp).
        self._releases_host_team = on_cpu
        if self._releases_host_team:
            release_thread_pool()

    def cpu_kernels_record(self) -> dict | None:
        """What a graph cache records of the CPU kernels, so that a start with --cache runs the same:
        the first CPU stage's op paths (all CPU stages share them) and the greedy argmax's; None
        without a CPU stage."""
        choice = self.pipeline.cpu_kernels()
        if choice is None:
            return None
        record = {"ops": choice.to_json()}
        if self.samples_here and self.devices[-1].type == "cpu":
            record["greedy_argmax"] = argmax_path(self.sampler.greedy_argmax)
        return record

    def kernel_summary(self) -> str:
        """The start-up banner's line on kernels: the stages' (Pipeline.kernel_summary), the sampler's
        greedy argmax where it was chosen, and the smaller team they were timed on, if they were."""
        return "; ".join(filter(None, [self.pipeline.kernel_summary(), self.argmax_summary, self.timing_note]))

    def _prefix_root(self) -> bytes:
        """Where prefix-cache keys start: what, besides the tokens, decides a block's K/V."""
        identity = f"{model_fingerprint(self.model_dir)}|{self.dtype}|{self.config.block_size}"
        return hashlib.blake2b(identity.encode(), digest_size=16).digest()

    def _stage_plan(self, num_blocks: int) -> StagePlan:
        """What every stage must agree on, decided once here (and sent to stage processes)."""
        config = self.config
        return StagePlan(
            fingerprint=model_fingerprint(self.model_dir),
            dtype=str(self.dtype).removeprefix("torch."),
            pp=config.pp,
            layers=self.layers,
            partition_rows=self.partition_rows,
            buckets=list(self.plan.sizes),
            num_blocks=num_blocks,
            block_size=config.block_size,
            max_model_len=self.max_model_len,
            num_slots=config.pp + config.depth,  # the ring: L = pp + depth
            max_tokens=max(config.prefill_chunk_size, self.plan.max_batch),  # a prompt chunk or the largest bucket
            seed=config.seed,
            use_cuda_graphs=self.backend == "cuda",
            kernels=config.kernels,
            allow_eager=config.allow_eager,
            ep=config.ep,
            timeline=config.timeline,
        )

    def _partition_rows(self) -> int:
        """The decode rows the stage partition weighs a mixture of experts at: the largest bucket. The
        stages load before the KV cache is sized, and on a GPU the cache's size sets the default largest
        bucket; so where --buckets or --max-batch do not fix it (or a CPU's default, 32), the largest it
        can be stands in: GPU_MAX_BATCH_LIMIT, or the most rows a decode step carries (max_num_seqs,
        with speculation's drafts) where that is fewer."""
        cfg = self.config
        if cfg.buckets:
            return max(cfg.buckets)
        max_batch = cfg.max_batch or (GPU_MAX_BATCH_LIMIT if self.devices[0].type == "cuda" else CPU_DEFAULT_MAX_BATCH)
        return min(max_batch, self._max_decode_tokens())

    def stage_summary(self) -> str:
        """The start-up banner's words on stages: each one's layers and its share of the weight bytes
        a decode step reads at the rows the partition weighed them at (for a mixture of experts, the
        expected experts)."""
        cfg, rows = self.model_config, self.partition_rows
        shares = stage_read_shares(cfg, self.layers, rows)
        described = [
            layer_span(r.start, r.stop)
            + (" + LM head" if i == len(self.layers) - 1 else "") + f" {share:.0%}"
            for i, (r, share) in enumerate(zip(self.layers, shares))
        ]
        expected = " (expected experts)" if cfg.moe is not None else ""
        return f"a {rows}-row decode step's weight bytes{expected} by stage: {', '.join(described)}"

    def rank_weight_reads(self) -> list[WeightReads]:
        """Each rank's resident weights: this one's (stage 0), then every worker's in rank order."""
        return [self.pipeline.weight_reads(), *(self.cluster.rank_weight_reads if self.cluster else [])]

    def expert_rank_stats(self) -> list[tuple[int, int, RankStats]]:
        """Under --ep, (stage, expert rank, figures) of every rank: this one's now, the workers' as
        they last published them (graphrt.distributed.transport.RankStats); [] without."""
        if self.config.ep == 1:
            return []
        stage = self.pipeline.stages[0]
        experts = stage.shard.experts(self.model_config.moe.num_experts)
        own = RankStats(self.ring.busy_s[0], self.cluster.link.combine_s, sum(stage.seen_expert_tokens()[experts.start : experts.stop]))
        return [(*divmod(rank, self.config.ep), stats) for rank, stats in enumerate([own, *self.cluster.rank_stats])]

    def gather_rank_timelines(self) -> None:
        """With --procs and the timeline on: add every worker's slices that it has published (every
        STATS_INTERVAL_S) since the last call to this engine's timeline."""
        if self.cluster is None or self.timeline is None:
            return
        for rank in range(1, self.cluster.link.world_size):
            slices, self._chunks_read[rank] = self.cluster.link.read_slices(rank, self._chunks_read.get(rank, 0))
            self.timeline.add_remote(slices)

    def expert_rank_summary(self) -> str:
        """The start-up banner's words on expert parallelism: what each rank holds."""
        ep, mib = self.config.ep, 1 << 20
        ranks = [
            f"rank {rank} {reads.total_bytes / mib:.1f} MiB ({reads.expert_bytes / mib:.1f} MiB experts)"
            for rank, reads in enumerate(self.rank_weight_reads())
        ]
        return f"--ep {ep}: each rank holds 1/{ep} of every sparse layer's routed experts; weights by rank: {', '.join(ranks)}"

    @property
    def depth(self) -> int:
        return self.stage_plan.num_slots - self.stage_plan.pp

    def describe(self) -> str:
        """The one line every start-up banner and report gives of this engine's shape."""
        spec = self.config.speculative_config
        return (
            f"pp={self.stage_plan.pp}{f' ep={self.config.ep}' if self.config.ep > 1 else ''} depth={self.depth} on {','.join(map(str, self.devices))}, "
            f"{str(self.dtype).removeprefix('torch.')}, {self.backend} decode, "
            f"{'async' if self.config.async_scheduling else 'no async'} scheduling"
            + (f", speculative decoding ({spec.method}, {spec.num_speculative_tokens} tokens)" if spec is not None else "")
            + (f", graph cache {self.cache_dir}" if self.cache_dir is not None else "")
        )

    @property
    def samples_here(self) -> bool:
        """Whether this process samples: no stage processes, or one stage split over expert ranks."""
        return self.cluster is None or self.cluster.samples_here

    @property
    def failure(self) -> StageFailure | None:
        """What stopped the stage processes (--procs), or None: a pipeline that is up."""
        return self.cluster.failure if self.cluster is not None else None

    def _capture_graphs(self, forced_eager: set[tuple[int, int]], show_progress: bool) -> None:
        self.graphs, self.graph_records = [], []
        max_blocks = -(-self.max_model_len // self.config.block_size)
        for stage, cache in zip(self.pipeline.stages, self.pipeline.caches):
            graphs, records = capture_stage(
                stage, cache, self.plan, max_blocks, self.backend == "cuda", self.config.allow_eager,
                {bucket for s, bucket in forced_eager if s == stage.index}, show_progress, self.ranges,
            )
            self.graphs.append(graphs)
            self.graph_records += records
        self.eager_pairs = {(r.stage, r.bucket) for r in self.graph_records if r.mode == "eager"}
        self.num_eager_fallbacks = 0  # decode micro-batches that ran eagerly on a CUDA-graph engine

    def _num_kv_blocks(self, draft_model: DraftModelDrafter | None) -> int:
        """Every stage holds every block id (for its own layers), so the device that needs the most
        bytes per block, relative to its free memory, decides how many blocks there are. On GPUs,
        what graph pools, ring buffers and activations will take is measured first and left free
        (graphrt.engine.kv_budget), and free memory is read after that probe. A draft model's cache
        has a block for each of the target's, plus its rows' guesses (`_draft_guess_blocks`): its
        device counts its bytes per block, and its guesses' blocks are kept free."""
        cfg, block_size = self.config, self.config.block_size
        if cfg.kv_cache_tokens is not None:
            return -(-cfg.kv_cache_tokens // block_size) + 1  # + the scratch block
        per_block: dict[torch.device, int] = {}
        for stage in self.pipeline.stages:
            per_block[stage.device] = per_block.get(stage.device, 0) + bytes_per_block(
                self.model_config, len(stage.layers), block_size, self.dtype
            )
        reserved = dict.fromkeys(per_block, 0)
        if draft_model is not None:
            device, draft_bytes = self._draft_device(), draft_model.kv_bytes_per_block(block_size)
            per_block[device] += draft_bytes
            reserved[device] += self._draft_guess_blocks() * draft_bytes
        if self.devices[0].type == "cuda":
            # The plan's largest bucket depends on the cache's size: measure at the most it can be.
            max_batch = self.partition_rows
            headroom = measure_headroom(
                self.pipeline, block_size=block_size, max_model_len=self.max_model_len, max_batch=max_batch,
                prefill_chunk_size=cfg.prefill_chunk_size, num_slots=cfg.pp + cfg.depth,
                max_tokens=max(cfg.prefill_chunk_size, max_batch), use_cuda_graphs=self.backend == "cuda",
            )
            free = {d: torch.cuda.mem_get_info(d)[0] for d in per_block}
            fits = kv_blocks_that_fit(free, headroom, per_block, reserved=reserved)
            logger.info(
                "KV cache: %d blocks; kept free besides it: %s", fits,
                ", ".join(f"{d} {h.total / 2**20:.0f} MiB" for d, h in headroom.items()),
            )
        else:
            fits = (CPU_KV_CACHE_BYTES - sum(reserved.values())) // sum(per_block.values())
            if fits < 2:
                raise GraphrtError(
                    f"the CPU's KV budget of {CPU_KV_CACHE_BYTES / 2**30:.1f} GiB holds no cache: the draft model's "
                    f"guesses take {sum(reserved.values()) / 2**30:.2f} GiB of it; lower max_num_seqs or "
                    "num_speculative_tokens, or give kv_cache_tokens"
                )
        # No need for more than every sequence at full context.
        enough = self.config.max_num_seqs * -(-self.max_model_len // block_size) + 1
        return max(2, min(fits, enough))

    def _bucket_plan(self, num_blocks: int) -> BucketPlan:
        if self.config.buckets:
            return BucketPlan(tuple(sorted(set(self.config.buckets))))
        kv_tokens = (num_blocks - 1) * self.config.block_size
        max_batch = self.config.max_batch or default_max_batch(self.devices[0].type, kv_tokens)
        return BucketPlan(tuple(default_buckets(min(max_batch, self._max_decode_tokens()))))

    def _draft_device(self) -> torch.device:
        return self.pipeline.stages[-1].device  # this process's last (with stage processes, rank 0's)

    def _draft_guess_blocks(self) -> int:
        """Blocks a draft model's cache holds past the target's: each row's guesses."""
        spec = self.config.speculative_config
        return self.config.max_num_seqs * -(-spec.num_speculative_tokens // self.config.block_size)

    def _load_draft_model(self) -> DraftModelDrafter | None:
        spec = self.config.speculative_config
        if spec is None or spec.method != "draft_model":
            return None
        return DraftModelDrafter(
            Path(spec.model).expanduser(), spec.num_speculative_tokens, self._draft_device(), self.dtype,
            self.max_model_len, self.model_config.vocab_size, self.ranges,
        )

    def _make_drafter(self, draft_model: DraftModelDrafter | None, num_blocks: int) -> Drafter | None:
        spec = self.config.speculative_config
        if spec is None:
            return None
        if spec.method == "ngram":
            return NgramDrafter(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
        draft_model.allocate(num_blocks + self._draft_guess_blocks(), self.config.block_size, self.config.max_num_seqs)
        return draft_model

    def _max_decode_tokens(self) -> int:
        """The most tokens a decode step can carry: a row each, and with speculation a row per draft
        too (a verify step is a decode step whose drafts are rows), as vLLM sizes its graphs."""
        spec = self.config.speculative_config
        return self.config.max_num_seqs * (1 + (spec.num_speculative_tokens if spec else 0))

    def identity(self) -> dict:
        """What a graph cache must agree with to be used by this engine."""
        return {
            "model_fingerprint": model_fingerprint(self.model_dir),
            "architecture": self.model_config.architecture,
            "dtype": str(self.dtype).removeprefix("torch."),
            "pp": len(self.pipeline.stages),
            "stages": [{"layers": [s.layer_ids.start, s.layer_ids.stop], "device": str(s.device)} for s in self.pipeline.stages],
            "device_names": [device_name(d) for d in self.devices],
            "kernels": self.pipeline.stages[0].ops.name,
            "backend": self.backend,
            "block_size": self.config.block_size,
            "max_model_len": self.max_model_len,
            "buckets": list(self.plan.sizes),
            **software_versions(),
        }

    def _check_graph_cache(self) -> set[tuple[int, int]]:
        """Refuse a cache made for another model or machine; return the pairs it marks eager."""
        manifest = read_manifest(self.cache_dir)
        stale = stale_fields(manifest, self.identity())
        if stale:
            captured_from = manifest.get("model_dir")
            if any(field.startswith("model_fingerprint") for field in stale) and captured_from:
                # refreshing it would overwrite another model's cache
                advice = (f"it was captured from {captured_from}: pass --model {captured_from}, or capture this model's "
                          "graphs into another folder (`graphrt capture --out NEW_DIR`)")
            else:
                advice = f"refresh it with `graphrt capture --out {self.cache_dir}` and the same options as this run"
            raise StaleCacheError(f"the graph cache {self.cache_dir} was made for something else: " + "; ".join(stale) + f". {advice}")
        return {(g["stage"], g["bucket"]) for g in manifest["graphs"] if g.get("mode") == "eager"}

    # -- requests -------------------------------------------------------------------------------

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """Validate one request's token ids and queue it. Raises RequestError for this request only."""
        if isinstance(prompt_ids, str):
            raise RequestError("the engine takes token ids; text is tokenized in front of it (LLM.generate does)")
        prompt_ids = list(prompt_ids)
        bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]!r} is outside the vocabulary [0, {self.model_config.vocab_size})")
        self._check_sampling(params)
        max_tokens = self.scheduler.check(len(prompt_ids), params.max_tokens)
        if params.structured_output is not None:
            self.grammars.check(params.structured_output)
        seq = Sequence(
            request_id=next(self._ids),
            prompt_ids=prompt_ids,
            params=params,
            max_tokens=max_tokens,
            generator=self.sampler.request_generator(params.seed) if self.sampler is not None else None,
            grammar=self.grammars.compile(params.structured_output) if params.structured_output is not None else None,
        )
        self.scheduler.add(seq)
        return seq

    def _check_sampling(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: the token ids it names against the vocabulary."""
        vocab_size = self.model_config.vocab_size
        for name, token in params.token_ids_named():
            if token >= vocab_size:
                raise RequestError(f"{name}: token id {token} is outside the vocabulary [0, {vocab_size})")
        if params.bad_words and params.bad_words_token_ids is None:
            raise RequestError(
                "bad_words must be tokenized before they reach the engine (LLM.generate and the server do it); "
                "give bad_words_token_ids instead"
            )

    def abort(self, seq: Sequence) -> None:
        """Stop a request now; its KV blocks return as soon as no micro-batch in flight uses them."""
        if not seq.finished:
            self.finish(seq, FinishReason.ABORT)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a request for a reason the engine can't see (a stop string in its text, an abort)."""
        self.scheduler.finish(seq, reason)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self.ring.busy

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (benchmarks do between runs: vLLM's /reset_prefix_cache,
        SGLang's /flush_cache), only while no request runs or waits, as SGLang does; False then."""
        if self.has_work():
            return False
        self.allocator.forget_cache()
        return True

    # -- stepping -------------------------------------------------------------------------------

    def step(self) -> list[SequenceOutput]:
        """One scheduler tick: poll -> update -> schedule -> launch. Returns the delta of every
        sequence that got a new token (finished ones included).

        The finished micro-batch is taken first, so a freed slot is refilled before the host does
        anything else. The host blocks only when nothing else can launch, and then only on the
        oldest micro-batch, launched a whole ring earlier; it then launches into the slot that
        freed before returning. Either way the rows just read back may be launched again before the
        caller reads their tokens: a stop string the caller then finds drops that one more token.
        """
        tick_start = self.timeline.now() if self.timeline else 0.0
        if self._releases_host_team:
            release_thread_pool()  # under a microsecond unless the caller made a team since the last step
        with self.ranges.tick():
            # Kept until returned: a launch that fails raises past the return (see _recover), and
            # the next step hands these out, so no request that survives misses a token.
            self._undelivered += self._update(self._poll(block=False))
            launched = self._launch_next()
            self._measure_host_gap()
            self._undelivered += self.scheduler.take_ended()
            if not launched and not self._undelivered and self.ring.busy:
                finished = self._poll(block=True)
                returned = time.perf_counter()
                self._undelivered += self._update(finished)
                # The device now waits for the next launch, if there is one to come at once
                # (not at the end of the work, before a caller's next requests).
                if not self.ring.busy and self.scheduler.running:
                    self._blocked_until = returned
                # Refill the freed slot now: the next tick would first read back another finished
                # micro-batch, and with host work longer than a stage's the freed slot then sat
                # idle for it (pp 2, 5 ms stages, 8 ms of host work: 38% busy against 59%).
                if self._launch_next():
                    self._measure_host_gap()
                self._undelivered += self.scheduler.take_ended()  # what that scheduling ended (a grammar that failed)
            elif not launched and not self._undelivered:
                self.scheduler.wait_for_grammars(GRAMMAR_WAIT_S)  # nothing to run but requests whose grammars compile
        if self.timeline:
            self.timeline.record_tick(tick_start, self.timeline.now())
        outputs, self._undelivered = self._undelivered, []
        return outputs

    def _measure_host_gap(self) -> None:
        """After a step that blocked on a read-back and left the ring empty: how long the device
        then waited for this step's decode launch, which speculative decoding weighs
        (Scheduler.record_host_gap)."""
        if self._blocked_until is None:
            return
        newest = self.ring.in_flight[-1] if self.ring.busy else None
        if newest is not None and not newest.step.is_prefill:
            self.scheduler.record_host_gap(time.perf_counter() - self._blocked_until)
        self._blocked_until = None

    def _launch_next(self) -> bool:
        """Schedule a step for the first open slot that has work, and launch it there.

        An empty slot takes only rows whose tokens are back (or prompt chunks); a slot with a
        micro-batch in flight also takes the rows that one samples, so with fewer rows than slots
        async scheduling still launches ahead. schedule() changes nothing when it finds no work
        (it may admit waiting requests), so trying the next slot is safe.
        """
        for slot in self.ring.open_slots():
            step = self.scheduler.schedule(self.num_decode_micro_batches, follows=slot.in_flight[-1].id if slot.in_flight else None)
            if step is not None:
                break
        else:
            return False
        if not step.is_prefill and self.eager_pairs and self.backend == "cuda":
            self._count_eager_fallbacks(step.num_tokens)
        try:
            self.ring.launch(slot, step)
        except Exception as exc:  # enqueuing itself failed (on CUDA, e.g. out of memory)
            self._recover(exc, extra=step.seqs)
        return True

    def _poll(self, block: bool) -> MicroBatch | None:
        try:
            return self.ring.poll(block)
        except Exception as exc:  # a stage raised while running the oldest micro-batch
            self._recover(exc)

    def _update(self, mb: MicroBatch | None) -> list[SequenceOutput]:
        """Hand a finished micro-batch's tokens to the scheduler."""
        if mb is None:
            return []
        now = time.perf_counter()
        try:
            logprobs = mb.logprobs.read_back(mb.token_ids) if mb.logprobs is not None else None
            updated = self.scheduler.update_from_output(mb.step, mb.token_ids, now, logprobs)
            self.ring.fill_pending_masks()  # constrained rows launched after mb need its tokens for their masks
        except BaseException:
            # The masks waiting for mb's tokens would never come, and the next poll would wait
            # forever on the stage that waits for them (the caller fails the requests).
            self.ring.release_pending_masks()
            raise
        self._account(mb, now, sum(len(output.new_token_ids) for output in updated))
        return updated

    def _recover(self, exc: Exception, extra: list[Sequence] = ()) -> None:
        """A stage failed, so every micro-batch in flight is lost: fail the requests they carried
        (their KV blocks go back), start the ring afresh, and raise. Requests not in flight and
        later ones are served as usual."""
        lost = {id(seq): seq for mb in self.ring.in_flight for seq in mb.step.seqs}
        lost.update((id(seq), seq) for seq in extra)
        self.ring.reset(f"{type(exc).__name__} in stage 0: {exc}")
        self.scheduler.fail(list(lost.values()))
        pipeline_down = self.failure is not None
        raise StageError(
            f"a pipeline stage failed ({type(exc).__name__}: {exc}); the {len(lost)} requests in flight "
            "were ended with an error"
            + ("; the stage processes are gone, restart graphrt" if pipeline_down else " and the engine goes on with the rest")
        ) from exc

    def _account(self, mb: MicroBatch, now: float, new_tokens: int) -> None:
        if self.synthetic_host_s:
            time.sleep(self.synthetic_host_s)
        if mb.step.is_prefill:
            self.stats.prefill_tokens += sum(mb.step.query_lens)
            return
        # Decode time is the union of the intervals in which a decode micro-batch was in flight.
        self.stats.decode_seconds += max(0.0, now - max(mb.launched_at, self._decode_busy_until))
        self._decode_busy_until = now
        self.stats.decode_steps += 1
        self.stats.decode_tokens += new_tokens
        # A mixture of experts' experts read, as the stages counted them on the device: what the
        # published counters gained since the last read-back (steps in flight since may be in it
        # early; once the engine is idle the sum is exact). Nothing waits for them.
        experts_read = sum(self.ring.stage_expert_reads)
        self.stats.decode_weight_bytes += self.weight_reads.decode_bytes(experts_read - self._experts_read)
        self._experts_read = experts_read

    def run(self, step: ScheduledStep) -> torch.Tensor:
        """Push one scheduled step through every stage on this thread; return each sequence's
        last-token logits (nothing is sampled). A synchronous path for checks and tests, never
        mixed with the ring."""
        if self.ring.busy:
            raise RuntimeError("Engine.run while micro-batches are in flight would race the stage workers")
        token_ids, meta = build_inputs(step, self.config.block_size)
        if not step.is_prefill and self.eager_pairs and self.backend == "cuda":
            self._count_eager_fallbacks(step.num_tokens)
        logits = self.pipeline.forward(token_ids, meta, self.graphs)  # (batch, vocab)
        self.scheduler.update_from_output(step, None, time.perf_counter())
        return logits

    def _count_eager_fallbacks(self, tokens: int) -> None:
        bucket = self.plan.bucket_for(tokens)
        eager_stages = [s for s, b in self.eager_pairs if b == bucket]
        if eager_stages:
            if self.num_eager_fallbacks == 0:
                logger.warning("decode bucket %d runs eagerly on stages %s (capture failed for them)", bucket, eager_stages)
            self.num_eager_fallbacks += 1

    def close(self) -> None:
        self.grammars.close()
        self.ring.close()
