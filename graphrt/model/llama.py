"""A Llama-family decoder cut into pipeline stages.

One `Stage` owns a contiguous range of layers; stage 0 also owns the embedding, the last stage the
final norm and the LM head. Llama 2/3, SmolLM2 and Mistral are plain Llama; Qwen2 adds a bias to
q/k/v, Qwen3 an RMSNorm on each head of q and k. q/k/v and gate/up are fused into one matmul each.
Mixtral, Qwen2-MoE and Qwen3-MoE replace the MLP of their sparse layers with a mixture of experts
(graphrt/model/moe.py); the rest of a layer is the same. DeepSeek-V3 (and Kimi K2) has such experts
and replaces the attention with multi-head latent attention (graphrt/model/mla.py), whose cache
holds one latent row per token instead of keys and values per head.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from graphrt.kernels import KernelSet
from graphrt.kernels.rotary import rotary_cos_sin
from graphrt.model.batch import StepMetadata
from graphrt.model.config import ModelConfig
from graphrt.model.kv_cache import StageKVCache
from graphrt.model.mla import LatentAttention
from graphrt.model.moe import WHOLE, ExpertShard, SparseMoE
from graphrt.model.weight_reads import WeightReads
from graphrt.model.weights import WeightFiles
from graphrt.profiling.nvtx import Ranges


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: KernelSet, layer: int, shard: ExpertShard = WHOLE):
        super().__init__()
        self.cfg = cfg
        self.ops = ops
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        empty = lambda *shape: nn.Parameter(torch.empty(*shape, device="meta"), requires_grad=False)  # noqa: E731
        self.input_norm = empty(cfg.hidden_size)
        # A latent attention layer's q/k/v weights are its own (graphrt/model/mla.py); o_proj is shared.
        self.mla = LatentAttention(cfg) if cfg.mla is not None else None
        dense_attention = self.mla is None
        self.qkv_proj = empty(self.q_size + 2 * self.kv_size, cfg.hidden_size) if dense_attention else None
        self.qkv_bias = empty(self.q_size + 2 * self.kv_size) if cfg.qkv_bias else None
        self.q_norm = empty(cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = empty(cfg.head_dim) if cfg.qk_norm else None
        self.o_proj = empty(cfg.hidden_size, self.q_size if dense_attention else self.mla.output_size)
        self.post_attention_norm = empty(cfg.hidden_size)
        # A sparse layer's MLP is its mixture of experts; a dense layer's, the gated MLP.
        sparse = cfg.moe is not None and cfg.moe.is_sparse(layer)
        self.moe = SparseMoE(cfg, shard) if sparse else None
        self.gate_up_proj = None if sparse else empty(2 * cfg.intermediate_size, cfg.hidden_size)
        self.down_proj = None if sparse else empty(cfg.hidden_size, cfg.intermediate_size)

    @staticmethod
    def hf_names(cfg: ModelConfig, layer: int, shard: ExpertShard = WHOLE) -> dict[str, list[str]]:
        """Our parameter -> the Hugging Face tensors concatenated (in order) to make it (of the
        routed experts, the shard's)."""
        p = f"model.layers.{layer}."
        names = {
            "input_norm": [p + "input_layernorm.weight"],
            "o_proj": [p + "self_attn.o_proj.weight"],
            "post_attention_norm": [p + "post_attention_layernorm.weight"],
        }
        if cfg.mla is not None:
            names.update({f"mla.{ours}": theirs for ours, theirs in LatentAttention.hf_names(cfg, p + "self_attn.").items()})
        else:
            names["qkv_proj"] = [p + f"self_attn.{x}_proj.weight" for x in "qkv"]
        if cfg.moe is not None and cfg.moe.is_sparse(layer):
            names.update({f"moe.{ours}": theirs for ours, theirs in SparseMoE.hf_names(cfg, layer, shard).items()})
        else:
            names["gate_up_proj"] = [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
            names["down_proj"] = [p + "mlp.down_proj.weight"]
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
        # A kernel set's decode_layers may run this same body for all layers of a decode step in one
        # call: a change here is a change there (test_decode_layers_cpu.py compares the two).
        cfg, ops = self.cfg, self.ops
        eps = cfg.rms_norm_eps
        hidden, residual = ops.rms_norm(hidden, self.input_norm, eps, residual)
        if self.mla is not None:
            return self._mlp(ops.linear(self.mla(hidden, meta, cos, sin, k_cache, ops), self.o_proj), residual, meta, k_cache)
        qkv = ops.linear(hidden, self.qkv_proj, self.qkv_bias)
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
        return self._mlp(ops.linear(attn.reshape(-1, self.q_size), self.o_proj), residual, meta, k_cache)

    def _mlp(
        self, hidden: torch.Tensor, residual: torch.Tensor, meta: StepMetadata, k_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The second half of the layer, from the attention's output projected by o_proj."""
        ops = self.ops
        hidden, residual = ops.rms_norm(hidden, self.post_attention_norm, self.cfg.rms_norm_eps, residual)
        if self.moe is not None:
            real_tokens = meta.slot_mapping >= k_cache.shape[1]  # padding rows write to block 0, the scratch block
            hidden = self.moe(hidden, ops, real_tokens, decode=not meta.is_prefill)
        else:
            hidden = ops.linear(ops.gate_up_silu(hidden, self.gate_up_proj), self.down_proj)
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
        shard: ExpertShard = WHOLE,
        head: bool = True,
    ):
        """`head`: on the last stage, whether it holds the final norm and LM head and returns logits
        (an expert rank that does not sample returns the hidden states instead); `shard`: which of a
        sparse layer's routed experts it holds."""
        super().__init__()
        self.cfg = cfg
        self.shard = shard  # which of a sparse layer's routed experts this rank holds (--ep)
        self.ops = ops
        self.index = index
        self.is_first = index == 0
        self.is_last = index == num_stages - 1
        self.has_head = self.is_last and head
        self.layer_ids = layers
        self.device = device
        self.dtype = dtype
        self._decode_step: Callable | None = None  # what ops.decode_layers made for this stage: see use_kernels
        # A mixture of experts' tokens routed to each expert by this stage's sparse layers (Stage.load),
        # a buffer of the stage: a graph writes only into tensors the stage owns (capture/rehearsal.py)
        self.register_buffer("expert_tokens", None, persistent=False)
        self._expert_tokens_seen: torch.Tensor | None = None
        # The experts its sparse layers' decode steps read (SparseMoE.expert_reads), likewise a buffer.
        self.register_buffer("expert_reads", None, persistent=False)
        self._expert_reads_seen: torch.Tensor | None = None
        # A synthetic stage (graphrt.tools.synthetic) also sleeps this long per forward, as a GPU
        # kernel would free the host; on CUDA only eager forwards sleep, a replayed graph does not.
        self.synthetic_delay_s = 0.0
        meta = lambda *shape: nn.Parameter(torch.empty(*shape, device="meta"), requires_grad=False)  # noqa: E731
        self.embed_tokens = meta(cfg.vocab_size, cfg.hidden_size) if self.is_first else None
        self.layers = nn.ModuleList(DecoderLayer(cfg, ops, layer, shard) for layer in layers)
        self.norm = meta(cfg.hidden_size) if self.has_head else None
        self.lm_head = meta(cfg.vocab_size, cfg.hidden_size) if self.has_head else None
        cos, sin = rotary_cos_sin(cfg.rope, cfg.head_dim, max_position)
        self.register_buffer("cos", cos.to(device), persistent=False)
        self.register_buffer("sin", sin.to(device), persistent=False)

    def hf_names(self) -> dict[str, list[str]]:
        names: dict[str, list[str]] = {}
        if self.is_first:
            names["embed_tokens"] = ["model.embed_tokens.weight"]
        for i, layer_id in enumerate(self.layer_ids):
            for ours, theirs in DecoderLayer.hf_names(self.cfg, layer_id, self.shard).items():
                names[f"layers.{i}.{ours}"] = theirs
        if self.has_head:
            names["norm"] = ["model.norm.weight"]
            # A tied LM head is stored once, as the embedding; the last stage keeps its own copy.
            names["lm_head"] = ["model.embed_tokens.weight" if self.cfg.tie_word_embeddings else "lm_head.weight"]
        return names

    def load(self, files: WeightFiles) -> None:
        names = self.hf_names()
        if self.has_head and not self.cfg.tie_word_embeddings and "lm_head.weight" not in files:
            names["lm_head"] = ["model.embed_tokens.weight"]  # checkpoints that tie without saying so
        rows = {}  # of a checkpoint's stacked experts, the rows this rank holds (all on one rank)
        for i, layer in enumerate(self.layers):
            if layer.moe is not None:  # a checkpoint that stores the experts already stacked
                for ours, stacked in SparseMoE.stacked_hf_names(self.layer_ids[i]).items():
                    if stacked in files:
                        names[f"layers.{i}.moe.{ours}"] = [stacked]
                        if ours in ("experts_gate_up", "experts_down"):
                            rows[stacked] = layer.moe.experts
        wide = {  # checkpoint names read in float32 at least (a bfloat16 model's DeepSeek router)
            n for i, layer in enumerate(self.layers) if layer.moe is not None
            for ours in layer.moe.float32_at_least() for n in names[f"layers.{i}.moe.{ours}"]
        }
        wanted = {n for group in names.values() for n in group} - wide
        tensors = files.load(sorted(wanted), self.device, self.dtype, rows)
        tensors.update(files.load(sorted(wide), self.device, torch.promote_types(self.dtype, torch.float32)))
        state = {
            ours: tensors[theirs[0]] if len(theirs) == 1 else torch.cat([tensors[n] for n in theirs])
            for ours, theirs in names.items()
        }
        # Stacked experts arrive concatenated along their first dimension: give them their shape.
        shapes = {name: p.shape for name, p in self.named_parameters()}
        state = {name: t if t.dim() == len(shapes[name]) else t.view(shapes[name]) for name, t in state.items()}
        self.load_state_dict(state, strict=True, assign=True)
        for layer in self.layers:
            if layer.mla is not None:
                layer.mla.loaded()
        sparse = [layer.moe for layer in self.layers if layer.moe is not None]
        if sparse:
            self.expert_tokens = torch.zeros(self.cfg.moe.num_experts, dtype=torch.int64, device=self.device)
            # what the host reads: on a GPU a pinned copy the stage's stream refreshes without waiting
            on_gpu = self.device.type == "cuda"
            self._expert_tokens_seen = torch.zeros_like(self.expert_tokens, device="cpu").pin_memory() if on_gpu else self.expert_tokens
            self.expert_reads = torch.zeros(1, dtype=torch.int64, device=self.device)
            self._expert_reads_seen = torch.zeros_like(self.expert_reads, device="cpu").pin_memory() if on_gpu else self.expert_reads
            for moe in sparse:
                moe.expert_tokens, moe.expert_reads = self.expert_tokens, self.expert_reads
        # Weights stay dense until the stage's kernels are chosen (graphrt.runtime.stage_builder),
        # which may keep them in forms of their own and needs the largest decode bucket.

    def combine_experts_with(self, combine: Callable[[torch.Tensor], None], ranges: Ranges) -> None:
        """Under expert parallelism: what sums the expert ranks' shares of each sparse layer, in
        place, and the NVTX ranges its parts are marked with."""
        for layer in self.layers:
            if layer.moe is not None:
                layer.moe.combine, layer.moe.ranges = combine, ranges
        self.use_kernels(self.ops)  # a one-call decode step (the set's decode_layers) has no all-reduce: decided afresh

    def matmul_owners(self) -> dict[str, list[tuple[nn.Module, str]]]:
        """Weight shape name -> where each weight of that shape lives (one per layer; the LM head
        on the last stage), for choosing kernels that keep a weight in a form of their own (which
        the set's `linear` then reads). The embedding is not a matmul, it is a gather."""
        owners = {
            name: [(layer, name) for layer in self.layers if getattr(layer, name) is not None]
            for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # a sparse layer has no dense gate/up, down
        }
        # Latent attention's first projections (kv_b_proj is read per head, by bmm: it stays dense).
        for name in ("qkv_a_proj", "q_b_proj"):
            latent = [layer.mla for layer in self.layers if layer.mla is not None]
            owners[name] = [(mla, name) for mla in latent if getattr(mla, name) is not None]
        # A shared expert is a dense gated MLP; the router and the shared expert's gate (a few
        # columns) stay dense. The routed experts are the set's fused_moe's to read, stacked; a kernel
        # set may keep them in a form of its own, chosen apart from these.
        for name in ("shared_gate_up_proj", "shared_down_proj"):
            sparse = [layer.moe for layer in self.layers if layer.moe is not None]
            owners[name] = [(moe, name) for moe in sparse if getattr(moe, name) is not None]
        owners = {name: places for name, places in owners.items() if places}
        if self.has_head:
            owners["lm_head"] = [(self, "lm_head")]
        return owners

    def use_kernels(self, ops: KernelSet) -> None:
        """Run every layer on `ops`. Call again after replacing weights (benchmarks do), so that the
        set's `decode_layers` decides afresh whether it runs this stage's decode steps in one call."""
        self.ops = ops
        for layer in self.layers:
            layer.ops = ops
        self._decode_step = ops.decode_layers(self) if ops.decode_layers is not None else None

    def decode_layers_in_one_call(self) -> bool:
        """Whether a decode step's layers run as one call of the kernel set's decode_layers (every
        layer still on the stage's set: a test may give one layer a set of its own)."""
        return self._decode_step is not None and all(layer.ops is self.ops for layer in self.layers)

    def weight_bytes(self) -> int:
        """Bytes of weights a decode step of a dense model reads: all of them but the embedding (a
        gather, so it is not counted). A mixture of experts reads fewer: see weight_reads."""
        return sum(p.numel() * p.element_size() for name, p in self.named_parameters() if name != "embed_tokens")

    def weight_reads(self) -> WeightReads:
        """weight_bytes, with the routed experts' bytes apart: a decode step reads only the experts
        its rows chose (graphrt/model/weight_reads.py)."""
        sparse = [layer.moe for layer in self.layers if layer.moe is not None]
        # expert by expert, whether stacked or kept one weight per expert (a CPU stage's packed experts)
        experts = [expert for moe in sparse for stacked in (moe.experts_gate_up, moe.experts_down) for expert in stacked]
        expert_bytes = sum(expert.numel() * expert.element_size() for expert in experts)
        if not expert_bytes:
            return WeightReads(self.weight_bytes())
        moe = self.cfg.moe
        bytes_per_expert = expert_bytes // (len(experts) // 2)  # each expert a gate/up and a down weight
        return WeightReads(self.weight_bytes() - expert_bytes, expert_bytes, moe.num_experts, moe.num_experts_per_tok, bytes_per_expert)

    def publish_expert_tokens(self) -> None:
        """After a micro-batch, on the stage's stream: refresh the copy `seen_expert_tokens` reads
        (on a GPU without waiting for it; on a CPU the counts are read where they are)."""
        if self._expert_tokens_seen is not None and self._expert_tokens_seen is not self.expert_tokens:
            self._expert_tokens_seen.copy_(self.expert_tokens, non_blocking=True)
            self._expert_reads_seen.copy_(self.expert_reads, non_blocking=True)

    def seen_expert_tokens(self) -> list[int]:
        """Tokens routed to each expert by this stage's sparse layers since the counts were last
        zeroed (padding rows not counted), as of the last publish: [] for a dense stage."""
        return [] if self._expert_tokens_seen is None else self._expert_tokens_seen.tolist()

    def seen_expert_reads(self) -> int:
        """The experts this stage's sparse layers' decode steps have read (each layer's distinct
        experts a step chose, summed), as of the last publish: 0 for a dense stage."""
        return 0 if self._expert_reads_seen is None else int(self._expert_reads_seen.item())

    def zero_expert_tokens(self) -> None:
        """The tokens per expert and the experts read start again from 0."""
        if self.expert_tokens is not None:
            self.expert_tokens.zero_()
            self.expert_reads.zero_()
            self.publish_expert_tokens()

    @torch.inference_mode()
    def forward(self, x: torch.Tensor, meta: StepMetadata, kv: StageKVCache) -> torch.Tensor:
        """x: token ids (tokens,) on stage 0, else hidden states (tokens, hidden_size).

        Returns hidden states for the next stage, or on the last stage (with its head) the logits
        of each sequence's last token (batch, vocab_size).
        """
        if self.synthetic_delay_s:
            time.sleep(self.synthetic_delay_s)
        hidden = F.embedding(x, self.embed_tokens) if self.is_first else x
        cos, sin = self.cos[meta.positions], self.sin[meta.positions]
        residual = None
        if not meta.is_prefill and self.decode_layers_in_one_call():
            hidden, residual = self._decode_step(hidden, meta, cos, sin, kv)  # the loop below, in one call
        else:
            for i, layer in enumerate(self.layers):
                hidden, residual = layer(hidden, residual, meta, cos, sin, kv.k[i], kv.v[i])
        if not self.has_head:
            return hidden + residual
        hidden, _ = self.ops.rms_norm(hidden, self.norm, self.cfg.rms_norm_eps, residual)
        return self.ops.linear(hidden[meta.logits_indices], self.lm_head)
