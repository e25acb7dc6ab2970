"""A Llama-family decoder cut into pipeline stages.

One `Stage` owns a contiguous range of layers; stage 0 also owns the embedding, the last stage the
final norm and the LM head. Llama 2/3, SmolLM2 and Mistral are plain Llama; Qwen2 adds a bias to
q/k/v, Qwen3 an RMSNorm on each head of q and k. q/k/v and gate/up are fused into one matmul each.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from graphrt.kernels import KernelSet
from graphrt.kernels.cpu.forcing import ForcedModes, as_forced
from graphrt.kernels.cpu.kernel_choice import DECODE_LAYER_OPS, CpuKernelChoice, compiled_ops
from graphrt.kernels.cpu.linear import convert, linear, panel_linear_silu_and_mul
from graphrt.kernels.cpu.matmul_choice import MatmulChoice, MatmulPlan, available_paths, choose_path
from graphrt.kernels.rotary import rotary_cos_sin
from graphrt.model.batch import StepMetadata
from graphrt.model.config import ModelConfig
from graphrt.model.kv_cache import StageKVCache
from graphrt.model.weights import WeightFiles

# What graphrt::decode_layers (kernels/cpu/csrc/decode_layers_cpu.cpp) runs a CPU decode step's layers
# with: the DECODE_LAYER_OPS, compiled, and each layer's weights in this order (its LayerWeight
# enum), the matmuls' in panels, gate/up's with whole panels of up columns (it ends in silu_and_mul).
DECODE_LAYER_WEIGHTS = ("input_norm", "qkv_proj", "o_proj", "post_attention_norm", "gate_up_proj", "down_proj")
DECODE_LAYER_MATMULS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: KernelSet):
        super().__init__()
        self.cfg = cfg
        self.ops = ops
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        empty = lambda *shape: nn.Parameter(torch.empty(*shape, device="meta"), requires_grad=False)  # noqa: E731
        self.input_norm = empty(cfg.hidden_size)
        self.qkv_proj = empty(self.q_size + 2 * self.kv_size, cfg.hidden_size)
        self.qkv_bias = empty(self.q_size + 2 * self.kv_size) if cfg.qkv_bias else None
        self.q_norm = empty(cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = empty(cfg.head_dim) if cfg.qk_norm else None
        self.o_proj = empty(cfg.hidden_size, self.q_size)
        self.post_attention_norm = empty(cfg.hidden_size)
        self.gate_up_proj = empty(2 * cfg.intermediate_size, cfg.hidden_size)
        self.down_proj = empty(cfg.hidden_size, cfg.intermediate_size)
        self.compiled_silu_and_mul: Callable | None = None  # set by Stage.use_cpu_kernels

    def ends_gate_up_in_silu_and_mul(self) -> bool:
        """Whether the gate/up matmul ends in silu_and_mul (kernels/cpu/linear.py): where the layer
        runs the compiled silu_and_mul and its gate/up weight is in panels, up's as whole panels."""
        gate_up = self.gate_up_proj
        return (
            self.ops.silu_and_mul is self.compiled_silu_and_mul and gate_up.dim() == 4 and gate_up.shape[0] % 2 == 0
        )

    @staticmethod
    def hf_names(cfg: ModelConfig, layer: int) -> dict[str, list[str]]:
        """Our parameter -> the Hugging Face tensors concatenated (in order) to make it."""
        p = f"model.layers.{layer}."
        names = {
            "input_norm": [p + "input_layernorm.weight"],
            "qkv_proj": [p + f"self_attn.{x}_proj.weight" for x in "qkv"],
            "o_proj": [p + "self_attn.o_proj.weight"],
            "post_attention_norm": [p + "post_attention_layernorm.weight"],
            "gate_up_proj": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
            "down_proj": [p + "mlp.down_proj.weight"],
        }
        if cfg.qkv_bias:
            names["qkv_bias"] = [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        if cfg.qk_norm:
            names["q_norm"] = [p + "self_attn.q_norm.weight"]
            names["k_norm"] = [p + "self_attn.k_norm.weight"]
        return names

    def forward(
        self,
        hidden: torch.Tensor,  # (tokens, hidden_size)
        residual: torch.Tensor | None,
        meta: StepMetadata,
        cos: torch.Tensor,  # (tokens, head_dim)
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # kernels/cpu/csrc/decode_layers_cpu.cpp runs this same loop body for CPU decode steps
        # (Stage.forward): a change here is a change there (tests/test_decode_layers_cpu.py).
        cfg, ops = self.cfg, self.ops
        eps = cfg.rms_norm_eps
        hidden, residual = ops.rms_norm(hidden, self.input_norm, eps, residual)
        qkv = linear(hidden, self.qkv_proj, self.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, cfg.num_heads, cfg.head_dim)
        k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None:
            q, _ = ops.rms_norm(q, self.q_norm, eps)
            k, _ = ops.rms_norm(k, self.k_norm, eps)
        q, k = ops.apply_rotary(q, k, cos, sin)
        # The whole micro-batch's K/V goes in before any attention reads: the scheduler lets a prompt
        # read blocks an earlier prompt of the same chunk writes here (graphrt/engine/scheduler.py).
        ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_prefill:
            attn = ops.paged_prefill_attention(  # the decode rows read meta.seq_lens, on the device once per micro-batch
                q, k_cache, v_cache, meta.block_tables, meta.query_lens, meta.seq_lens_host, self.scale,
                device_seq_lens=meta.seq_lens,
            )
        else:
            attn = ops.paged_decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, self.scale, meta.max_seq_len
            )
        hidden = linear(attn.reshape(-1, self.q_size), self.o_proj)
        hidden, residual = ops.rms_norm(hidden, self.post_attention_norm, eps, residual)
        if self.ends_gate_up_in_silu_and_mul():
            hidden = linear(panel_linear_silu_and_mul(hidden, self.gate_up_proj), self.down_proj)
        else:
            hidden = linear(ops.silu_and_mul(linear(hidden, self.gate_up_proj)), self.down_proj)
        return hidden, residual


class Stage(nn.Module):
    """Layers [first_layer, last_layer) of the model, plus the ends of the model it holds."""

    def __init__(
        self,
        cfg: ModelConfig,
        index: int,
        num_stages: int,
        layers: range,
        device: torch.device,
        dtype: torch.dtype,
        max_position: int,
        ops: KernelSet,
    ):
        super().__init__()
        self.cfg = cfg
        self.ops = ops
        self.index = index
        self.is_first = index == 0
        self.is_last = index == num_stages - 1
        self.layer_ids = layers
        self.device = device
        self.dtype = dtype
        self.matmul_plan: MatmulPlan | None = None  # set by choose_matmuls
        self.cpu_kernels: CpuKernelChoice | None = None  # set by use_cpu_kernels
        self.compiled_functions: dict[str, Callable] = {}  # op -> its compiled kernel: set by use_cpu_kernels
        # What decode_layers_in_one_call decided, and for which layer ops: see _decode_layers_weights.
        self._decode_layers_decision: tuple[list[KernelSet], tuple | None] | None = None
        meta = lambda *shape: nn.Parameter(torch.empty(*shape, device="meta"), requires_grad=False)  # noqa: E731
        self.embed_tokens = meta(cfg.vocab_size, cfg.hidden_size) if self.is_first else None
        self.layers = nn.ModuleList(DecoderLayer(cfg, ops) for _ in layers)
        self.norm = meta(cfg.hidden_size) if self.is_last else None
        self.lm_head = meta(cfg.vocab_size, cfg.hidden_size) if self.is_last else None
        cos, sin = rotary_cos_sin(cfg.rope, cfg.head_dim, max_position)
        self.register_buffer("cos", cos.to(device), persistent=False)
        self.register_buffer("sin", sin.to(device), persistent=False)

    def hf_names(self) -> dict[str, list[str]]:
        names: dict[str, list[str]] = {}
        if self.is_first:
            names["embed_tokens"] = ["model.embed_tokens.weight"]
        for i, layer_id in enumerate(self.layer_ids):
            for ours, theirs in DecoderLayer.hf_names(self.cfg, layer_id).items():
                names[f"layers.{i}.{ours}"] = theirs
        if self.is_last:
            names["norm"] = ["model.norm.weight"]
            # A tied LM head is stored once, as the embedding; the last stage keeps its own copy.
            names["lm_head"] = ["model.embed_tokens.weight" if self.cfg.tie_word_embeddings else "lm_head.weight"]
        return names

    def load(self, files: WeightFiles) -> None:
        names = self.hf_names()
        if self.is_last and not self.cfg.tie_word_embeddings and "lm_head.weight" not in files:
            names["lm_head"] = ["model.embed_tokens.weight"]  # checkpoints that tie without saying so
        wanted = sorted({n for group in names.values() for n in group})
        tensors = files.load(wanted, self.device, self.dtype)
        state = {
            ours: tensors[theirs[0]] if len(theirs) == 1 else torch.cat([tensors[n] for n in theirs])
            for ours, theirs in names.items()
        }
        self.load_state_dict(state, strict=True, assign=True)
        # Weights stay dense until choose_matmuls, which needs the largest decode bucket.

    def matmul_owners(self) -> dict[str, list[tuple[nn.Module, str]]]:
        """Weight shape name -> where each weight of that shape lives (one per layer; the LM head
        on the last stage). The embedding is not a matmul, it is a gather."""
        owners = {name: [(layer, name) for layer in self.layers] for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}
        owners = {name: places for name, places in owners.items() if places}
        if self.is_last:
            owners["lm_head"] = [(self, "lm_head")]
        return owners

    def choose_matmuls(
        self,
        max_rows: int,
        mode: ForcedModes | str = "auto",
        previous: dict[str, MatmulChoice] | None = None,
        timer: Callable[[], float] = time.perf_counter,
    ) -> MatmulPlan:
        """Run each weight shape on F.linear, packed oneDNN or the compiled panel kernel, whichever
        this machine runs fastest at one row and at `max_rows` (graphrt/kernels/cpu/matmul_choice.py), or
        the path `mode` forces for it, and convert the weights of each shape to its path's form.
        `previous`: choices to reuse by
        shape name (the graph cache's, or another stage's on the same device). Runs once; the
        result is `self.matmul_plan`."""
        if self.matmul_plan is not None:
            return self.matmul_plan
        owners_of = self.matmul_owners()
        modes = as_forced(mode)
        # Before the clock starts: finding out whether the panel kernel runs may mean building it.
        paths_of = {
            name: available_paths(self.device, self.dtype, tuple(getattr(*owners[0]).shape), modes.of(name))
            for name, owners in owners_of.items()
        }
        start = timer()
        rows = tuple(sorted({1, max_rows}))
        choices = []
        for name, owners in owners_of.items():
            weights = [getattr(o, a) for o, a in owners]
            choice, trial = choose_path(name, weights, rows, modes.of(name), paths_of[name], (previous or {}).get(name), timer)
            del weights
            if choice.path != "dense":
                for index, (owner, attr) in enumerate(owners):
                    # Each dense weight is freed as soon as its converted copy replaces it.
                    converted = trial[index] if index < len(trial) else convert(choice.path, getattr(owner, attr))
                    setattr(owner, attr, nn.Parameter(converted, requires_grad=False))
            del trial
            choices.append(choice)
        measured = any(c.source == "measured" and c.seconds for c in choices)
        self.matmul_plan = MatmulPlan(tuple(choices), rows, timer() - start if measured else 0.0)
        self.weights_changed()
        return self.matmul_plan

    def use_cpu_kernels(self, choice: CpuKernelChoice) -> None:
        """Run each op on the implementation chosen for it, compiled or torch reference
        (graphrt/kernels/cpu/kernel_choice.py)."""
        self.ops = choice.apply(self.ops)
        self.cpu_kernels = choice
        # Which functions are the compiled kernels, to tell what a layer runs from its own `ops`,
        # which tests and benchmarks replace (tests/test_informative_models.py).
        self.compiled_functions = compiled_ops() if "compiled" in choice.paths.values() else {}
        for layer in self.layers:
            layer.ops = self.ops
            layer.compiled_silu_and_mul = self.compiled_functions.get("silu_and_mul")
        self.weights_changed()

    def decode_layers_in_one_call(self) -> bool:
        """Whether a decode step's layers run as one call of graphrt::decode_layers: every layer runs
        the compiled kernel of every op it uses, and its matmuls on panels, ending gate/up in
        silu_and_mul."""
        return self._decode_layers_weights() is not None

    def weights_changed(self) -> None:
        """Call after replacing a layer's weights (benchmarks/decode_step_profile.py --dense does), so
        that the next step decides again whether its layers run in one call."""
        self._decode_layers_decision = None

    def _decode_layers_weights(self) -> tuple | None:
        """graphrt::decode_layers' weight arguments (weights, q/k/v biases, q norms, k norms) where it
        runs this stage's decode steps, else None. Decided once (checking 30 layers' parameters takes
        about 0.3 ms, 1% of a step) and again when a layer's `ops` is replaced (tests do) or after
        weights_changed()."""
        ops = [layer.ops for layer in self.layers]
        decision = self._decode_layers_decision
        if decision is None or any(now is not then for now, then in zip(ops, decision[0])):
            compiled = self.compiled_functions
            one_call_allowed = self.cpu_kernels is not None and self.cpu_kernels.one_call
            runs = bool(compiled) and one_call_allowed and all(
                all(getattr(layer.ops, op) is compiled[op] for op in DECODE_LAYER_OPS)
                and all(getattr(layer, name).dim() == 4 for name in DECODE_LAYER_MATMULS)
                and layer.ends_gate_up_in_silu_and_mul()
                for layer in self.layers
            )
            weights = (
                (
                    [getattr(layer, name) for layer in self.layers for name in DECODE_LAYER_WEIGHTS],
                    *([getattr(layer, name) for layer in self.layers] for name in ("qkv_bias", "q_norm", "k_norm")),
                )
                if runs
                else None
            )
            decision = self._decode_layers_decision = (ops, weights)
        return decision[1]

    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads (the embedding is a gather, so it is not counted)."""
        return sum(p.numel() * p.element_size() for name, p in self.named_parameters() if name != "embed_tokens")

    @torch.inference_mode()
    def forward(self, x: torch.Tensor, meta: StepMetadata, kv: StageKVCache) -> torch.Tensor:
        """x: token ids (tokens,) on stage 0, else hidden states (tokens, hidden_size).

        Returns hidden states for the next stage, or on the last stage the logits of each
        sequence's last token (batch, vocab_size).
        """
        hidden = F.embedding(x, self.embed_tokens) if self.is_first else x
        cos, sin = self.cos[meta.positions], self.sin[meta.positions]
        residual = None
        one_call = None if meta.is_prefill else self._decode_layers_weights()
        if one_call is not None:
            # The loop below in C++, bitwise the same: no interpreter time between the ops.
            weights, biases, q_norms, k_norms = one_call
            hidden, residual = torch.ops.graphrt.decode_layers(
                hidden, weights, biases, q_norms, k_norms, cos, sin, kv.k, kv.v, meta.slot_mapping,
                meta.block_tables, meta.seq_lens, self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.rms_norm_eps,
                self.layers[0].scale,
            )
        else:
            for i, layer in enumerate(self.layers):
                hidden, residual = layer(hidden, residual, meta, cos, sin, kv.k[i], kv.v[i])
        if not self.is_last:
            return hidden + residual
        hidden, _ = self.ops.rms_norm(hidden, self.norm, self.cfg.rms_norm_eps, residual)
        return linear(hidden[meta.logits_indices], self.lm_head)
