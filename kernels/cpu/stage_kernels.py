"""The CPU wing's one entry: what a stage on a CPU runs, chosen once when it is built.

`choose_matmuls` converts each weight shape of a stage to the form this machine runs fastest
(F.linear on the dense weight, packed oneDNN, or compiled panels: matmul_choice.py), or the one
forced or cached, a mixture of experts' routed experts included (kept one weight per expert where
not dense); `cpu_kernel_set` makes the `KernelSet` the stage then runs: each op compiled or its
torch reference (kernel_choice.py), a `linear` for whichever form a weight is in, the gate/up
matmul ending in silu_and_mul in one pass where that is compiled and the weight is in panels, a
mixture of experts' experts grouped by expert (moe.py), and,
where every op a decode step's layers call is compiled, a `decode_layers` that runs those layers
as one call of graphrt::decode_layers. The model (graphrt/model/) sees only the set.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import types
from typing import Callable

import torch
from torch import nn

from graphrt.kernels import KernelSet
from graphrt.kernels.cpu import paged_attention
from graphrt.kernels.cpu.forcing import ForcedModes, as_forced
from graphrt.kernels.cpu.kernel_choice import DECODE_LAYER_OPS, CpuKernelChoice
from graphrt.kernels.cpu.linear import convert, linear, panel_linear_silu_and_mul
from graphrt.kernels.cpu.matmul_choice import EXPERT_NAMES, MatmulChoice, MatmulPlan, available_paths, choose_path
from graphrt.kernels.cpu.moe import ExpertWeights, fused_moe_by_expert, in_panels
from graphrt.kernels.cpu.openmp import TeamSizer, openmp_available
from graphrt.kernels.mla import LATENT_NORM_EPS

# A stage here is a graphrt.model.llama.Stage, read by its attributes (the kernels sit below the
# model and do not import it): its layers, their weights by name, matmul_owners() and use_kernels(),
# and a sparse layer's `moe` (graphrt.model.moe.SparseMoE) with its stacked experts by name.
Stage = nn.Module

# graphrt::decode_layers (csrc/decode_layers_cpu.cpp) runs a decode step's layers with the
# DECODE_LAYER_OPS, compiled, and each layer's weights in this order (its LayerWeight enum; None
# where the layer has none), every matmul's in panels, a gate/up's with whole panels of up columns
# (it ends in silu_and_mul). The mlp's: the dense MLP's, or a sparse layer's shared expert.
LAYER_WEIGHTS = (
    "input_norm", "post_attention_norm", "o_proj",
    "qkv_proj", "qkv_bias", "q_norm", "k_norm",  # attention over keys and values per head
    "mla.qkv_a_proj", "mla.q_a_norm", "mla.q_b_proj", "mla.kv_a_norm", "mla.kv_b_proj",  # latent attention
    "mlp.gate_up", "mlp.down",
    "moe.router", "moe.e_score_correction_bias", "moe.shared_expert_gate",
)


def runs_cpu_kernels(stage: Stage) -> bool:
    """Whether `stage` runs what this wing chooses: a CPU stage does, unless it runs the Triton set
    (only through Triton's interpreter: graphrt.kernels.kernel_set), which reads dense weights as
    on a GPU."""
    return stage.device.type == "cpu" and stage.ops.name != "triton"


def choose_matmuls(
    stage: Stage,
    max_rows: int,
    mode: ForcedModes | str = "auto",
    previous: dict[str, MatmulChoice] | None = None,
    timer: Callable[[], float] = time.perf_counter,
) -> MatmulPlan:
    """Run each weight shape of `stage` on F.linear, packed oneDNN or the compiled panel kernel,
    whichever this machine runs fastest at one row and at `max_rows` (matmul_choice.py), or the path
    `mode` forces for it, and convert the stage's weights of each shape to its path's form. A CPU
    stage's routed experts are chosen the same way at the rows one expert gets (`choose_experts`).
    `previous`: choices to reuse by shape name (the graph cache's, or another stage's on the same
    device). Call it once per stage, then `stage.use_kernels` with the set that reads those forms."""
    owners_of = stage.matmul_owners()
    cpu = runs_cpu_kernels(stage)
    modes, previous = as_forced(mode if cpu else "dense"), previous or {}
    # Only the CPU's fused_moe (moe.py) reads experts one by one; the torch and Triton sets' read them stacked.
    sparse = [layer.moe for layer in stage.layers if layer.moe is not None] if cpu else []
    shapes = {name: tuple(getattr(*owners[0]).shape) for name, owners in owners_of.items()}
    shapes.update({name: tuple(getattr(sparse[0], name).shape[1:]) for name in EXPERT_NAMES if sparse})
    # Before the clock starts: finding out whether the panel kernel runs may mean building it.
    paths_of = {name: available_paths(stage.device, stage.dtype, shape, modes.of(name)) for name, shape in shapes.items()}
    start = timer()
    rows = tuple(sorted({1, max_rows}))
    choices = []
    for name, owners in owners_of.items():
        weights = [getattr(o, a) for o, a in owners]
        choice, trial = choose_path(name, weights, rows, modes.of(name), paths_of[name], previous.get(name), timer)
        del weights
        if choice.path != "dense":
            for index, (owner, attr) in enumerate(owners):
                # Each dense weight is freed as soon as its converted copy replaces it.
                converted = trial[index] if index < len(trial) else convert(choice.path, getattr(owner, attr))
                setattr(owner, attr, nn.Parameter(converted, requires_grad=False))
        del trial
        choices.append(choice)
    expert_rows = ()
    if sparse:
        moe_cfg = stage.cfg.moe
        expert_rows = tuple(sorted({1, rows_per_expert(max_rows, moe_cfg.num_experts_per_tok, moe_cfg.num_experts)}))
        for name in EXPERT_NAMES:
            choices.append(choose_experts(sparse, name, expert_rows, modes.of(name), paths_of[name], previous.get(name), timer))
    measured = any(c.source == "measured" and c.seconds for c in choices)
    return MatmulPlan(tuple(choices), rows, timer() - start if measured else 0.0, expert_rows)


def rows_per_expert(num_rows: int, top_k: int, num_experts: int) -> int:
    """The rows one expert runs on in a step of `num_rows` rows that each choose `top_k` of
    `num_experts`, on average (a router spreads them unevenly): at least one."""
    return max(1, round(num_rows * top_k / num_experts))


def choose_experts(
    sparse: list[nn.Module],
    name: str,
    rows: tuple[int, ...],
    mode: str,
    paths: tuple[str, ...],
    previous: MatmulChoice | None,
    timer: Callable[[], float],
) -> MatmulChoice:
    """choose_path for the routed experts `name` (experts_gate_up or experts_down) of the sparse
    layers `sparse` (SparseMoE), one weight per expert. Where a path other than dense wins, each
    layer's stacked experts are replaced by one weight per expert in that form (`ExpertWeights`,
    which fused_moe_by_expert reads as it reads the stack), and the stack is freed."""
    experts = [expert for moe in sparse for expert in getattr(moe, name)]  # (out_features, in_features) views
    choice, trial = choose_path(name, experts, rows, mode, paths, previous, timer)
    del experts
    if choice.path == "dense":
        return choice
    first = 0  # the index of this layer's first expert among all layers'
    for moe in sparse:
        stacked = getattr(moe, name)
        converted = [trial[i] if i < len(trial) else convert(choice.path, w) for i, w in enumerate(stacked, first)]
        first += len(converted)
        delattr(moe, name)  # a Parameter's name takes only a Parameter
        setattr(moe, name, ExpertWeights(converted, stacked.shape, stacked.dtype))
        del stacked, converted  # the stack's last reference: it is freed before the next layer's is converted
    return choice


def cpu_kernel_set(ops: KernelSet, choice: CpuKernelChoice) -> KernelSet:
    """`ops` (a CPU stage's, `--kernels torch`) with the kernels `choice` chose: each op's function,
    a prompt chunk's riding decode rows attending through the chosen decode attention too, matmuls
    for every weight form, the experts by expert, and the one-call decode step where it may run."""
    chosen = choice.functions()
    prefill = functools.partial(chosen["paged_prefill_attention"], decode_attention=chosen["paged_decode_attention"])
    silu_and_mul = chosen["silu_and_mul"]
    fused = choice.paths["silu_and_mul"] == "compiled"

    def gate_up_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if fused and weight.dim() == 4 and weight.shape[0] % 2 == 0:  # panels, whole ones of up columns
            return panel_linear_silu_and_mul(x, weight)  # bitwise the two ops below, in one pass
        return silu_and_mul(linear(x, weight))

    # Latent attention runs on the decode attention chosen (timed at its shapes: LayerShapes.latent_cache_dim).
    compiled_decode = choice.paths["paged_decode_attention"] == "compiled"
    latent_decode = paged_attention.paged_latent_decode_attention if compiled_decode else ops.paged_latent_decode_attention
    one_call = choice.one_call and all(choice.paths[op] == "compiled" for op in DECODE_LAYER_OPS)
    return dataclasses.replace(
        ops, **{**chosen, "paged_prefill_attention": prefill}, linear=linear, gate_up_silu=gate_up_silu,
        paged_latent_decode_attention=latent_decode,
        fused_moe=fused_moe_by_expert, decode_layers=bind_decode_layers if one_call else None,
        stream_hook=TeamSizer if openmp_available() else None,
    )


def bind_decode_layers(stage: Stage) -> Callable | None:
    """graphrt::decode_layers bound to the stage's weights: a decode step's layers in one call,
    bitwise the Python loop of DecoderLayer.forward. None where a layer's matmul weights are not all
    in panels (a gate/up's in whole panels of up columns), or a mixture of experts the op does not
    run (`runs_sparse_layer`): the loop runs those."""
    layers = stage.layers
    if not layers or not all(runs_layer(layer, stage.dtype) for layer in layers):
        return None
    weights = [weight for layer in layers for weight in layer_weights(layer)]
    sparse = [layer.moe for layer in layers if layer.moe is not None]
    experts = [w for moe in sparse for w in (*moe.experts_gate_up.weights, *moe.experts_down.weights)]
    cfg = stage.cfg
    mla, moe = cfg.mla, cfg.moe
    scale, latent_dims = layers[0].scale, []
    if mla is not None:
        scale = mla.softmax_scale
        latent_dims = [layers[0].mla.q_a_size, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim]
    scoring, top_k, renormalize, n_group, topk_group, routed_scaling = "softmax", 0, False, 1, 1, 1.0
    if moe is not None:
        scoring, top_k, renormalize = moe.scoring, moe.num_experts_per_tok, moe.norm_topk_prob
        if moe.scoring == "sigmoid":
            n_group, topk_group, routed_scaling = moe.n_group, moe.topk_group, moe.routed_scaling_factor

    def run(hidden, meta, cos, sin, kv) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ops.graphrt.decode_layers(
            hidden, weights, experts, stage.expert_tokens, stage.expert_reads, cos, sin, kv.k, kv.v, meta.slot_mapping, meta.block_tables,
            meta.seq_lens, cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps, scale, latent_dims, LATENT_NORM_EPS,
            scoring, top_k, renormalize, n_group, topk_group, routed_scaling,
        )

    return run


def layer_weights(layer: nn.Module) -> list[torch.Tensor | None]:
    """A layer's weights as graphrt::decode_layers takes them (LAYER_WEIGHTS), None where absent."""
    moe = layer.moe
    mlp = types.SimpleNamespace(
        gate_up=layer.gate_up_proj if moe is None else moe.shared_gate_up_proj,
        down=layer.down_proj if moe is None else moe.shared_down_proj,
    )
    owners = {"": layer, "mla": layer.mla, "moe": moe, "mlp": mlp}

    def weight(name: str) -> torch.Tensor | None:
        owner, _, attr = name.rpartition(".")
        return None if owners[owner] is None else getattr(owners[owner], attr)

    return [weight(name) for name in LAYER_WEIGHTS]


def runs_layer(layer: nn.Module, dtype: torch.dtype) -> bool:
    """Whether graphrt::decode_layers runs this layer: every matmul weight in panels (latent
    attention's kv_b_proj, read per head by bmm, stays dense), its MLP a gated one in panels or a
    sparse layer it runs."""
    attention = [layer.qkv_proj] if layer.mla is None else [layer.mla.qkv_a_proj, layer.mla.q_b_proj]
    if not all(weight.dim() == 4 for weight in (layer.o_proj, *attention) if weight is not None):
        return False
    if layer.moe is not None:
        return runs_sparse_layer(layer.moe, dtype)
    return is_gated_mlp_in_panels(layer.gate_up_proj, layer.down_proj)


def runs_silu_and_mul_alone(stage: Stage) -> bool:
    """Whether some gate/up matmul of the stage would run the set's silu_and_mul as an op of its own:
    a dense MLP's or shared expert's not in panels of whole halves (those end in it in the matmul's
    pass, where it is compiled). Routed experts never call the op (kernels/cpu/moe.py), so for a
    stage of routed experts alone it never runs (kernel_choice.choose_cpu_kernels' fused_silu)."""
    gate_ups = [layer.gate_up_proj if layer.moe is None else layer.moe.shared_gate_up_proj for layer in stage.layers]
    return any(w.dim() != 4 or w.shape[0] % 2 for w in gate_ups if w is not None)


def is_gated_mlp_in_panels(gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether a gated MLP's weights are in panels, gate/up's halves whole panels (it ends in silu_and_mul)."""
    return gate_up.dim() == 4 and gate_up.shape[0] % 2 == 0 and down.dim() == 4


def runs_sparse_layer(moe: nn.Module, dtype: torch.dtype) -> bool:
    """Whether graphrt::decode_layers runs this sparse layer (graphrt.model.moe.SparseMoE): a dense
    router, every routed expert in panels (`in_panels`), the shared expert (if any) in panels too,
    and no all-reduce over expert ranks (--ep keeps the loop)."""
    shared_in_panels = moe.shared_gate_up_proj is None or is_gated_mlp_in_panels(moe.shared_gate_up_proj, moe.shared_down_proj)
    return (
        moe.combine is None and len(moe.experts) == moe.router.shape[0]  # every routed expert here: no --ep shard
        and moe.router.dim() == 2 and not moe.router.is_mkldnn
        and in_panels(moe.experts_gate_up, moe.experts_down, dtype) and shared_in_panels
    )
