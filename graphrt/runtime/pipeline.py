"""Splitting the model into stages, placing them on devices, and running a step through them."""

from __future__ import annotations

import torch

from graphrt.errors import GraphrtError
from graphrt.kernels.cpu.forcing import ForcedModes
from graphrt.kernels.cpu.kernel_choice import CpuKernelChoice
from graphrt.kernels.cpu.kernel_choice import mode_from_env as cpu_kernel_mode_from_env
from graphrt.kernels.cpu.matmul_choice import MatmulChoice, MatmulPlan, mode_from_env, summarize
from graphrt.kernels.cpu.stage_kernels import choose_matmuls, runs_silu_and_mul_alone
from graphrt.model.batch import StepMetadata
from graphrt.model.config import ModelConfig
from graphrt.model.kv_cache import StageKVCache
from graphrt.model.llama import Stage
from graphrt.model.weight_reads import WeightReads, head_read_elements, layer_read_elements
from graphrt.model.weights import WeightFiles
from graphrt.runtime.stage_builder import StageKernels, choose_stage_ops, load_stage


def partition_layers(cfg: ModelConfig, pp: int, decode_rows: int = 1) -> list[range]:
    """Contiguous layer ranges that balance the weight bytes each stage reads per decode step.

    The LM head weighs as much as several small layers (SmolLM2: 8), so an even split by layer
    count would make the last stage the bottleneck. Minimises the heaviest stage exactly (small DP).
    A dense layer reads all its weights every step. A sparse (MoE) layer is weighed at the expected
    bytes of a step of `decode_rows` rows, the largest decode bucket (the engine passes it): its
    attention, router and shared expert, plus E * (1 - (1 - k/E)^B) of its E experts, the distinct
    experts B rows choose on average with top-k routed uniformly (graphrt/model/weight_reads.py).
    Dense models ignore `decode_rows`.
    """
    num_layers = cfg.num_layers
    if pp > num_layers:
        raise GraphrtError(f"--pp {pp} is larger than the model's {num_layers} layers; use --pp {num_layers} or fewer")
    # before[i]: what layers [0, i) read, so a stage's cost is one subtraction.
    before = [0]
    for layer in range(num_layers):
        before.append(before[-1] + layer_read_elements(cfg, layer, decode_rows))
    head_cost = head_read_elements(cfg)

    def cost(first: int, end: int, last_stage: bool) -> float:
        return before[end] - before[first] + (head_cost if last_stage else 0)

    # best[s][i]: minimal max cost of splitting layers [0, i) into s stages (not the last one).
    inf = float("inf")
    best = [[inf] * (num_layers + 1) for _ in range(pp + 1)]
    cut = [[0] * (num_layers + 1) for _ in range(pp + 1)]
    best[0][0] = 0
    for s in range(1, pp + 1):
        for i in range(s, num_layers + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], cost(j, i, last_stage=(s == pp and i == num_layers)))
                if value <= best[s][i]:  # on ties, the later stage takes fewer layers
                    best[s][i], cut[s][i] = value, j
    bounds = [num_layers]
    for s in range(pp, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    bounds.reverse()
    return [range(bounds[s], bounds[s + 1]) for s in range(pp)]


def stage_read_shares(cfg: ModelConfig, layers: list[range], decode_rows: int) -> list[float]:
    """Each stage's share of the weight bytes a decode step of `decode_rows` rows reads, weighed as
    `partition_layers` weighs them (the last stage holds the LM head); the shares sum to 1."""
    costs = [sum(layer_read_elements(cfg, layer, decode_rows) for layer in stage) for stage in layers]
    costs[-1] += head_read_elements(cfg)
    total = sum(costs)
    return [c / total for c in costs]


class Pipeline:
    """The stages of one model, each with its KV cache, run one after another for a step.

    The ring scheduler overlaps micro-batches across stages; this class is the plain data path.
    """

    def __init__(self, stages: list[Stage], caches: list[StageKVCache]):
        self.stages = stages
        self.caches = caches
        self.kernels: list[StageKernels] = []  # what each stage runs, once chosen (choose_kernels)

    @staticmethod
    def load(
        cfg: ModelConfig,
        files: WeightFiles,
        devices: list[torch.device],
        dtype: torch.dtype,
        max_position: int,
        kernels: str = "auto",
        layers: list[range] | None = None,
    ) -> Pipeline:
        """One stage per device, holding `layers` (partition_layers' ranges; None: partitioned here
        for a batch-1 step, which only a mixture of experts would weigh differently)."""
        num_stages = len(devices)
        stages = [
            load_stage(cfg, index, num_stages, stage_layers, devices[index], dtype, max_position, kernels, files)
            for index, stage_layers in enumerate(layers or partition_layers(cfg, num_stages))
        ]
        return Pipeline(stages, [])

    def choose_kernels(
        self,
        max_rows: int,
        block_size: int,
        cached_matmuls: list[MatmulPlan] | None = None,
        cached_ops: dict[str, str] | None = None,
        matmul_mode: ForcedModes | str | None = None,
        cpu_mode: ForcedModes | str | None = None,
    ) -> None:
        """What each stage runs at up to `max_rows` decode rows (runtime/stage_builder.py): each weight
        shape on F.linear, packed oneDNN or compiled panels, whichever is fastest here at one row and at
        `max_rows`, and on a CPU each hot-path op on its compiled kernel or its torch reference. A stage
        reuses what `cached_matmuls` (the graph cache's plans, by stage) or an earlier stage on the
        same device chose for a shape, and the op choice of an earlier CPU stage, so each is timed
        once per device; `cached_ops` is the graph cache's op choice. The modes: auto, dense, packed
        or panel for matmuls, auto, torch or compiled for ops, for all or by name; None reads
        GRAPHRT_MATMUL and GRAPHRT_CPU_KERNELS. What they force comes before the cache."""
        matmul_mode = mode_from_env() if matmul_mode is None else matmul_mode
        cpu_mode = cpu_kernel_mode_from_env() if cpu_mode is None else cpu_mode
        known: dict[torch.device, dict[str, MatmulChoice]] = {}
        plans = []
        for position, stage in enumerate(self.stages):
            previous = dict(known.get(stage.device, {}))
            if cached_matmuls is not None and position < len(cached_matmuls):
                previous.update(cached_matmuls[position].by_name())
            plans.append(choose_matmuls(stage, max_rows, matmul_mode, previous))
            known.setdefault(stage.device, {}).update(plans[-1].by_name())
        # Then the ops, once per device, knowing the forms every stage there runs.
        cpu_choices: dict[torch.device, CpuKernelChoice] = {}
        self.kernels = []
        for stage, plan in zip(self.stages, plans):
            on_device = [s for s in self.stages if s.device == stage.device]
            silu_alone = stage.device.type != "cpu" or any(map(runs_silu_and_mul_alone, on_device))
            chosen = choose_stage_ops(
                stage, plan, max_rows, block_size, cpu_mode, cached_ops, cpu_choices.get(stage.device), silu_alone
            )
            if chosen.cpu is not None:
                cpu_choices[stage.device] = chosen.cpu
            self.kernels.append(chosen)

    def cpu_kernels(self) -> CpuKernelChoice | None:
        """The op choice of the CPU stages (one per device; on a CPU there is one), None without one."""
        return next((k.cpu for k in self.kernels if k.cpu is not None), None)

    def kernel_summary(self) -> str:
        """One line for the start-up banner: the kernels of the first stage (all stages of a device
        share them; a CUDA stage runs its kernel set's)."""
        stage = self.stages[0]
        choice = self.kernels[0].cpu if self.kernels else None
        if choice is None:
            return f"kernels: the {stage.ops.name} kernels on {stage.device.type}"
        cpu_stages = [s for s in self.stages if s.device.type == "cpu"]
        one_call = all(s.decode_layers_in_one_call() for s in cpu_stages)
        return choice.summary() + ("; a decode step's layers in one call (graphrt::decode_layers)" if one_call else "")

    def matmul_plans(self) -> list[MatmulPlan]:
        """What each stage chose (what a graph cache records), in stage order."""
        return [k.matmuls for k in self.kernels]

    def matmul_summary(self) -> str:
        """One line for the start-up banner: which weight shapes run packed, which on F.linear."""
        plans = self.matmul_plans()
        return summarize(plans) if plans else "matmuls: not chosen yet"

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        self.caches = [
            StageKVCache.allocate(s.cfg, len(s.layers), num_blocks, block_size, s.device, s.dtype) for s in self.stages
        ]

    def weight_bytes(self) -> int:
        return sum(s.weight_bytes() for s in self.stages)

    def weight_reads(self) -> WeightReads:
        """The stages' weight bytes, split as a decode step reads them (graphrt/model/weight_reads.py)."""
        return sum((s.weight_reads() for s in self.stages), WeightReads(0))

    def forward(self, token_ids: torch.Tensor, meta: StepMetadata, graphs: list | None = None) -> torch.Tensor:
        """token_ids: (tokens,) -> logits (batch, vocab) on the last stage's device.

        Decode steps replay each stage's graph for the batch's bucket when `graphs` is given;
        prefill chunks always run eagerly.
        """
        x = token_ids
        for index, (stage, cache) in enumerate(zip(self.stages, self.caches)):
            x = x.to(stage.device, non_blocking=True)
            if graphs is not None and not meta.is_prefill:
                x = graphs[index].run(x, meta)
            else:
                x = stage(x, meta.to(stage.device), cache)
        return x
