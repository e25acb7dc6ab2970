"""One way to build a pipeline stage, for rank 0 (every stage of an in-process pipeline, stage 0
under --procs) and for each stage process (graphrt.distributed.worker) alike: load the stage's
weights (`load_stage`), then choose what it runs: its kernel set's matmuls on every weight shape
(graphrt.kernels.cpu.stage_kernels.choose_matmuls) and, on a CPU, the kernels the CPU wing chooses
for its ops (`choose_stage_ops`), which read the weight forms chosen (graphrt.kernels.cpu). Capture
(graphrt.capture.capture.capture_stage) comes after.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphrt.kernels import kernel_set
from graphrt.kernels.cpu.forcing import ForcedModes
from graphrt.kernels.cpu.kernel_choice import CpuKernelChoice, LayerShapes, choose_cpu_kernels
from graphrt.kernels.cpu.matmul_choice import MatmulPlan
from graphrt.kernels.cpu.stage_kernels import cpu_kernel_set, runs_cpu_kernels, runs_silu_and_mul_alone
from graphrt.model.config import ModelConfig
from graphrt.model.llama import Stage
from graphrt.model.moe import WHOLE, ExpertShard
from graphrt.model.weights import WeightFiles


@dataclass(frozen=True)
class StageKernels:
    """What was chosen for one stage: each weight shape's matmul form, and on a CPU each op's
    kernel (None on CUDA, where the stage runs its kernel set's). The banner says it; a graph
    cache records it."""

    matmuls: MatmulPlan
    cpu: CpuKernelChoice | None


def load_stage(
    cfg: ModelConfig, index: int, num_stages: int, layers: range, device: torch.device, dtype: torch.dtype,
    max_position: int, kernels: str, files: WeightFiles, shard: ExpertShard = WHOLE, head: bool = True,
) -> Stage:
    """Stage `index` of `num_stages`, holding `layers` (of their routed experts, the `shard`'s; on the
    last stage the LM head unless not `head`), its weights loaded onto `device`; it runs the
    `kernels` set (--kernels) until `choose_stage_ops`."""
    stage = Stage(cfg, index, num_stages, layers, device, dtype, max_position, kernel_set(kernels, device.type), shard, head)
    stage.load(files)
    return stage


def choose_stage_ops(
    stage: Stage,
    matmuls: MatmulPlan,
    max_rows: int,
    block_size: int,
    cpu_mode: ForcedModes | str,
    cached_ops: dict[str, str] | None = None,
    cpu_choice: CpuKernelChoice | None = None,
    silu_alone: bool | None = None,
) -> StageKernels:
    """After its matmul forms (`choose_matmuls`, whose plan is `matmuls`), what `stage` runs at up to
    `max_rows` decode rows: on a CPU the kernel of each op (`cpu_mode` forcing, `cached_ops` the graph
    cache's, or `cpu_choice` already made for another stage on the same device); a CUDA stage its
    kernel set's. `silu_alone`: whether some stage on the device runs SiLU-and-mul as an op of its own
    (`runs_silu_and_mul_alone`; None: this stage, alone on its device); where none does, that op is
    not timed."""
    if not runs_cpu_kernels(stage):
        stage.use_kernels(stage.ops)  # a CUDA stage (or an interpreted Triton one) keeps its --kernels set, over its new weights
        return StageKernels(matmuls, None)
    if cpu_choice is None:
        silu_alone = runs_silu_and_mul_alone(stage) if silu_alone is None else silu_alone
        cpu_choice = choose_cpu_kernels(
            LayerShapes.of(stage.cfg), block_size, stage.dtype, stage.device, max_rows, cpu_mode, cached=cached_ops,
            fused_silu=not silu_alone,
        )
    stage.use_kernels(cpu_kernel_set(stage.ops, cpu_choice))
    return StageKernels(matmuls, cpu_choice)
