"""Typed configuration, validated once at the edge.

`EngineConfig` is what the user chooses (pipeline size, dtype, KV cache, chunk size); it raises
`ValueError` with a message that says what was wrong and what would be right. What graphrt reads
from a model's config.json is `graphrt.model.config.ModelConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphrt.kernels.cpu.info import cpu_bf16_support
from graphrt.model.config import ModelConfig
from graphrt.speculative import SpeculativeConfig

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,  # vLLM's names: float and half
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float64": torch.float64,
    "fp64": torch.float64,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; use auto (the default) or one of {', '.join(sorted(set(DTYPES)))}")
    return DTYPES[name]


def default_devices(pp: int, ep: int = 1) -> list[str]:
    """Each stage's device (its leader's, under --ep), chosen from the machine: rank r on cuda:r
    with a GPU per rank (stage s's leader, rank s * ep, on cuda:s*ep); with fewer GPUs than ranks
    but one per stage, cuda:s (under --ep only torchrun over several hosts gets there: this host
    holds some of the ranks, and the stages are on GPUs of their own); every stage on cuda:0 with
    fewer; cpu without CUDA. Without --devices a worker takes cuda:LOCAL_RANK (graphrt.distributed.worker)."""
    if not torch.cuda.is_available():
        return ["cpu"] * pp
    if torch.cuda.device_count() >= pp * ep:
        return [f"cuda:{stage * ep}" for stage in range(pp)]
    if torch.cuda.device_count() >= pp:
        return [f"cuda:{stage}" for stage in range(pp)]
    return ["cuda:0"] * pp


def num_concurrent_stages(devices: list[str | torch.device]) -> int:
    """How many of the stages placed on `devices` (one per stage) compute at the same moment: one
    per distinct GPU, and every CPU stage.

    Stages on one GPU share its SMs and its HBM, and a decode step is bound by reading weights, so
    they work in turn, not at once. Each CPU stage runs on a worker thread of its own with an
    OpenMP team sized to the cores left to it (graphrt.runtime.streams, graphrt.kernels.cpu.openmp), so CPU stages do
    overlap, and each counts: with its rows in one micro-batch, one thread would wait for the other.
    """
    distinct, cpu_stages = set(), 0
    for device in map(torch.device, devices):
        if device.type == "cpu":
            cpu_stages += 1
        else:  # "cuda" is the current device, cuda:0 unless a caller chose another
            distinct.add((device.type, device.index or 0))
    return len(distinct) + cpu_stages


@dataclass
class EngineConfig:
    """What the user chooses. Validated in `__post_init__`."""

    pp: int = 1
    devices: list[str] | None = None  # one per stage, one per rank under ep > 1 (stage-major); None: chosen from the machine
    dtype: str | torch.dtype = "auto"  # auto: see resolve_dtype
    block_size: int = 16
    kv_cache_tokens: int | None = None  # None: sized from memory (see kv_cache.default_num_blocks)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 64
    prefill_chunk_size: int = 512
    seed: int = 0
    kernels: str = "auto"  # auto: triton on CUDA, torch elsewhere
    use_graphs: bool = True  # False (--no-graphs): decode runs eagerly over the same static buffers
    buckets: list[int] | None = None  # decode batch sizes with a graph; None: 1, 2, 4, 8, then every 8
    max_batch: int | None = None  # largest bucket; None: capture.buckets.default_max_batch
    allow_eager: bool = False  # a (stage, bucket) that fails capture runs eagerly instead of aborting
    depth: int | None = None  # micro-batches beyond one per stage (ring of pp + depth); None: default_depth()
    async_scheduling: bool = True  # launch a slot's next step before its tokens are read back (graphrt.runtime.ring)
    prefix_caching: bool = True  # reuse the KV blocks of prompt prefixes computed before (graphrt.engine.block_allocator)
    timeline: bool = False  # record when each stage works on which micro-batch (graphrt.profiling)
    procs: bool = False  # stages 1..pp-1 in worker processes over torch.distributed (graphrt.distributed.remote)
    ep: int = 1  # expert parallelism: ranks (processes) per stage, splitting each sparse layer's routed experts; > 1 implies procs
    watchdog_s: float = 30.0  # with procs: a stage silent this long is declared dead
    # Speculative decoding (--speculative-config): a SpeculativeConfig, its dict or JSON; None: off.
    speculative_config: SpeculativeConfig | dict | str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.pp, int) or self.pp < 1:
            raise ValueError(f"pp must be a positive integer, got {self.pp!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.prefill_chunk_size < 1:
            raise ValueError(f"prefill_chunk_size must be at least 1, got {self.prefill_chunk_size}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or isinstance(self.max_model_len, bool) or self.max_model_len < 1):
            raise ValueError(f"max_model_len must be a positive number of tokens (or None: the model's), got {self.max_model_len!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.block_size:
            raise ValueError(
                f"kv_cache_tokens must hold at least one block ({self.block_size} tokens), got {self.kv_cache_tokens}"
            )
        if not isinstance(self.ep, int) or self.ep < 1:
            raise ValueError(f"ep must be a positive integer (ranks per stage), got {self.ep!r}")
        if self.devices is not None:
            self.check_devices()
        if self.depth is None:
            self.depth = self.default_depth()
        if not isinstance(self.depth, int) or self.depth < 0:
            raise ValueError(f"depth must be a non-negative integer (micro-batches beyond one per stage), got {self.depth!r}")
        for name in ("async_scheduling", "prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.max_batch is not None and self.max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {self.max_batch}")
        if self.buckets is not None and (not self.buckets or min(self.buckets) < 1):
            raise ValueError(f"buckets must be positive batch sizes, got {self.buckets}")
        if self.kernels not in ("auto", "torch", "triton"):
            raise ValueError(f"kernels must be auto, torch or triton, got {self.kernels!r}")
        if self.ep > 1:
            self.procs = True  # the expert ranks are processes
        if self.procs and self.pp * self.ep < 2:
            raise ValueError(f"procs needs at least two ranks (--pp 2 or more, or --ep 2 or more), got pp={self.pp}")
        if not self.watchdog_s > 0:
            raise ValueError(f"watchdog_s must be a positive number of seconds, got {self.watchdog_s!r}")
        if self.dtype != "auto":
            self.dtype = parse_dtype(self.dtype)
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.speculative_config is not None and self.ep > 1:
            raise ValueError("speculative decoding with --ep is not supported yet; drop one of --speculative-config and --ep")

    def check_devices(self) -> None:
        """`devices` names one device per stage, or under ep > 1 one per rank, stage-major: the
        workers each take `devices[rank]` (graphrt.distributed.worker.parse_options)."""
        for name in self.devices:
            try:
                torch.device(name)
            except RuntimeError:
                raise ValueError(f"--devices: {name!r} is not a device; name each as cpu, cuda or cuda:N") from None
        if self.ep == 1 and len(self.devices) != self.pp:
            raise ValueError(f"--devices names {len(self.devices)} devices for {self.pp} stages; give one per stage")
        num_ranks = self.pp * self.ep
        if self.ep > 1 and len(self.devices) != num_ranks:
            raise ValueError(
                f"--devices names {len(self.devices)} devices for --pp {self.pp} --ep {self.ep}: give one per rank, "
                f"{num_ranks}, stage-major (rank = stage * ep + expert rank)"
            )
        # Stage processes share one process group, whose backend is chosen from rank 0's device.
        if (self.procs or self.ep > 1) and len({torch.device(d).type == "cuda" for d in self.devices}) > 1:
            processes = "under --ep" if self.ep > 1 else "with --procs"
            raise ValueError(
                f"--devices {','.join(self.devices)} mixes CUDA and CPU devices; {processes} every rank takes part in one "
                "process group (NCCL on GPUs, gloo on CPUs): name only GPUs or only CPUs"
            )

    def check_devices_here(self) -> None:
        """The devices this process's stages run on exist here: every stage's without stage
        processes, stage 0's with them (the others belong to their workers, perhaps on another host)."""
        devices = self.stage_devices() if not (self.procs or self.ep > 1) else self.stage_devices()[:1]
        for device in map(torch.device, devices):
            if device.type != "cuda":
                continue
            source = "--devices names" if self.devices is not None else "the stages were placed on"
            if not torch.cuda.is_available():
                cpu_build = torch.version.cuda is None and getattr(torch.version, "hip", None) is None
                why = "this torch is a CPU build" if cpu_build else "CUDA sees no GPU here (driver, CUDA_VISIBLE_DEVICES)"
                raise ValueError(f"{source} {device}, but {why}; run on the CPU by leaving out --devices, or give cpu")
            count = torch.cuda.device_count()
            if device.index is not None and device.index >= count:
                raise ValueError(
                    f"{source} {device}, but this machine shows {count} GPU{'s' if count != 1 else ''} (cuda:0 to cuda:{count - 1}); "
                    "name one of those (CUDA_VISIBLE_DEVICES renumbers them)"
                )

    def stage_devices(self) -> list[str]:
        """Each stage's device: under --ep its leader's (rank stage * ep), the rank that talks to
        the stages around it; from the machine without --devices."""
        if self.devices is None:
            return default_devices(self.pp, self.ep)
        return self.devices[:: self.ep]

    def default_depth(self) -> int:
        """1 for CUDA stages on several GPUs, else 0 (measured: benchmarks/results.md, "ring depth").

        A deeper ring hides the host's turnaround behind other micro-batches, which matters when a
        stage's work takes about as long as that turnaround (GPU stages: milliseconds). It also
        splits each decode round into more, smaller micro-batches, each reading the stage's weights
        once: on one stage, on stages that share one GPU, or on CPU stages sharing the same cores,
        that only costs throughput.
        """
        devices = self.stage_devices()
        on_cuda = all(d.startswith("cuda") for d in devices)
        return 1 if on_cuda and num_concurrent_stages(devices) > 1 else 0

    def num_decode_micro_batches(self, devices: list[str]) -> int:
        """How many micro-batches a decode round's rows are spread over (Scheduler.schedule): one
        per stage that computes at the same time as the others, plus `depth`.

        Stages that share a GPU take turns on its memory bandwidth, so rows split between them only
        read the same weights again from the same HBM: pp 4 on one GPU at batch 64 would run 5
        micro-batches of 12 rows, each re-reading every weight, for 0.35-0.5x of pp 1. With the
        rows in one micro-batch those stages read each weight once per round, as pp 1 does.
        """
        return num_concurrent_stages(devices) + self.depth

    def resolve_dtype(self, model: ModelConfig, device: torch.device) -> torch.dtype:
        """auto: on CUDA the model's half dtype (bfloat16 unless it is float16); on a CPU bfloat16
        where the CPU has bfloat16 matmul instructions (AMX or AVX512-BF16: half the bytes per
        weight, and matmuls accumulate in float32), float32 where it would emulate them."""
        if self.dtype != "auto":
            return self.dtype
        if device.type == "cpu":
            return torch.bfloat16 if cpu_bf16_support() is not None else torch.float32
        return {"float16": torch.float16}.get(model.torch_dtype or "", torch.bfloat16)
