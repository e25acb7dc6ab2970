"""What graphrt needs from a Hugging Face `config.json`, validated once at the edge.

`ModelConfig.from_dir` raises `ModelLoadError` with a message that says what was wrong and what
would be right.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from graphrt.errors import ModelLoadError
from graphrt.kernels.rotary import RopeConfig

# architectures value -> what differs from plain Llama ("moe": the family whose sparse MLP it has)
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {},
    "Qwen2ForCausalLM": {"qkv_bias": True},
    "Qwen3ForCausalLM": {"qk_norm": True},
    "MixtralForCausalLM": {"moe": "mixtral"},
    "Qwen2MoeForCausalLM": {"moe": "qwen2_moe"},  # q/k/v bias per its `qkv_bias` field (True by default)
    "Qwen3MoeForCausalLM": {"moe": "qwen3_moe", "qk_norm": True},
    "DeepseekV3ForCausalLM": {"moe": "deepseek_v3", "mla": True},  # DeepSeek-V3/R1, Kimi K2
}


@dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts model's sparse MLP (router, experts, optional shared expert) and which
    layers have one instead of the dense MLP."""

    num_experts: int
    num_experts_per_tok: int  # top-k
    moe_intermediate_size: int  # of each expert
    norm_topk_prob: bool  # divide the chosen experts' weights by their sum (Mixtral: always)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: an expert every token runs, gated by sigmoid; 0 = none
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # DeepSeek-V3: sigmoid scores with e_score_correction_bias steering the choice among the experts
    # of the `topk_group` best of `n_group` groups (kernels/moe.py route_grouped_topk); "softmax" is
    # Mixtral's and Qwen's plain top-k.
    scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0  # DeepSeek-V3: an ungated shared MLP of n_shared_experts * moe_intermediate_size
    first_k_dense_replace: int = 0  # DeepSeek-V3: layers below this one are dense

    @property
    def shared_expert_size(self) -> int:
        """The intermediate size of the expert every token runs (0: none)."""
        return self.shared_expert_intermediate_size or self.n_shared_experts * self.moe_intermediate_size

    @property
    def shared_expert_gated(self) -> bool:
        """Whether the shared expert's output is scaled by sigmoid(shared_expert_gate(x)) (Qwen2-MoE)."""
        return self.shared_expert_intermediate_size > 0

    def is_sparse(self, layer: int) -> bool:
        """Whether `layer` has the sparse MLP: transformers' rule for Qwen2-MoE and Qwen3-MoE (Mixtral,
        with a step of 1 and no MLP-only layers, is sparse everywhere), and DeepSeek-V3's dense-first
        layers."""
        return (
            layer >= self.first_k_dense_replace
            and layer not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )


@dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): keys and values are decompressed per head
    from one `kv_lora_rank` latent per token (which, with the shared `qk_rope_head_dim` rotary key, is
    all the KV cache holds: graphrt/model/mla.py)."""

    kv_lora_rank: int
    q_lora_rank: int | None  # None: queries straight from the hidden state (q_proj), else through a low-rank q_a / q_b pair
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # the checkpoint's rotary dimensions come in (even, odd) pairs, not two halves
    softmax_scale: float  # qk_head_dim ** -0.5, times yarn's mscale squared where the rope is scaled

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """Values the cache holds per token per layer: the latent, then the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    moe: MoeConfig | None = None
    mla: MlaConfig | None = None  # then head_dim is the rotary key's, and num_kv_heads unused
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: str | None = None

    @staticmethod
    def from_dir(model_dir: Path) -> ModelConfig:
        path = model_dir / "config.json"
        if not path.is_file():
            raise ModelLoadError(
                f"{model_dir} has no config.json; point --model at a Hugging Face style folder "
                "(config.json, *.safetensors, tokenizer.json) or convert a GGUF file with `graphrt import-gguf`"
            )
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{path} is not valid JSON ({exc}); re-download or re-convert the model") from None
        return ModelConfig.from_hf(raw)

    @staticmethod
    def from_hf(raw: dict) -> ModelConfig:
        architectures = raw.get("architectures") or []
        arch = architectures[0] if architectures else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"architectures {architectures!r} is not supported; graphrt serves "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        extras = SUPPORTED_ARCHITECTURES[arch]
        _refuse_unimplemented(arch, raw)
        try:
            num_heads = int(raw["num_attention_heads"])
            hidden_size = int(raw["hidden_size"])
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            moe = moe_from_hf(extras["moe"], raw) if "moe" in extras else None
            rope = rope_from_hf(raw)
            mla = mla_from_hf(raw, rope) if extras.get("mla") else None
            return ModelConfig(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden_size,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
                head_dim=mla.qk_rope_head_dim if mla else int(raw.get("head_dim") or hidden_size // num_heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                max_position=_context_limit(raw),
                rope=rope,
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                qkv_bias=_qkv_bias(arch, raw),
                qk_norm=bool(extras.get("qk_norm", False)),
                moe=moe,
                mla=mla,
                eos_token_ids=eos_ids,
                bos_token_id=raw.get("bos_token_id"),
                torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
            )
        except KeyError as exc:
            raise ModelLoadError(f"config.json lacks the field {exc.args[0]!r}; the model folder is incomplete") from None


def _qkv_bias(arch: str, raw: dict) -> bool:
    if arch == "Qwen2MoeForCausalLM":
        return bool(raw.get("qkv_bias", True))  # its own field; transformers' default is on
    return bool(SUPPORTED_ARCHITECTURES[arch].get("qkv_bias", False) or raw.get("attention_bias", False))


def _refuse_unimplemented(arch: str, raw: dict) -> None:
    """A config that asks for something graphrt does not compute is refused here, naming the field,
    rather than served with other semantics."""
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"hidden_act {act!r} is not supported; graphrt's MLPs compute silu(gate) * up (\"silu\")")
    quantization = raw.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
        fp8 = ", or write a bfloat16 copy of this FP8 one with `graphrt dequantize-fp8 SRC OUT_DIR`" if method == "fp8" else ""
        raise ModelLoadError(
            f"quantization_config ({method}) is not supported; graphrt reads unquantized float weights, "
            f"so use the model's bfloat16 or float16 release{fp8}"
        )
    if arch in ("Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM") and raw.get("attention_bias"):
        raise ModelLoadError(
            f"attention_bias true is not supported for {arch} (it adds a bias to o_proj, which graphrt lacks)"
        )


def mla_from_hf(raw: dict, rope: RopeConfig) -> MlaConfig:
    """DeepSeek-V3's attention, under DeepseekV3Config's names and defaults."""
    mla = MlaConfig(
        kv_lora_rank=int(raw.get("kv_lora_rank", 512)),
        q_lora_rank=None if raw.get("q_lora_rank", 1536) is None else int(raw.get("q_lora_rank", 1536)),
        qk_nope_head_dim=int(raw.get("qk_nope_head_dim", 128)),
        qk_rope_head_dim=int(raw.get("qk_rope_head_dim", 64)),
        v_head_dim=int(raw.get("v_head_dim") or 128),
        rope_interleave=bool(raw.get("rope_interleave", True)),
        softmax_scale=0.0,
    )
    if mla.qk_rope_head_dim % 2 or mla.qk_rope_head_dim <= 0:
        raise ModelLoadError(f"qk_rope_head_dim {mla.qk_rope_head_dim} is not valid; the rotary key has an even number of dimensions")
    return dataclasses.replace(mla, softmax_scale=mla.qk_head_dim**-0.5 * rope.yarn_softmax_mscale())


def moe_from_hf(family: str, raw: dict) -> MoeConfig:
    """The sparse MLP of a `family` (mixtral, qwen2_moe, qwen3_moe, deepseek_v3) config.json, with the
    names and defaults of transformers' configuration classes. Fields only training reads
    (router_aux_loss_coef, output_router_logits, Mixtral's router_jitter_noise) are ignored."""
    if family == "deepseek_v3":
        return _deepseek_moe_from_hf(raw)
    # Mixtral calls it num_local_experts, Qwen2-MoE num_experts; transformers writes Qwen3-MoE's under
    # the first name (an attribute_map), while Qwen's own configs use the second.
    num_experts_field = "num_local_experts" if "num_local_experts" in raw else "num_experts"
    num_experts = int(raw[num_experts_field])
    if family == "mixtral":
        moe = MoeConfig(
            num_experts=num_experts,
            num_experts_per_tok=int(raw["num_experts_per_tok"]),
            moe_intermediate_size=int(raw["intermediate_size"]),
            norm_topk_prob=True,
        )
    else:
        step = int(raw.get("decoder_sparse_step", 1))
        if step < 1:
            raise ModelLoadError(f"decoder_sparse_step {step} is not valid; it is the layer period of the sparse MLP, 1 or more")
        moe = MoeConfig(
            num_experts=num_experts,
            num_experts_per_tok=int(raw["num_experts_per_tok"]),
            moe_intermediate_size=int(raw["moe_intermediate_size"]),
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            shared_expert_intermediate_size=int(raw["shared_expert_intermediate_size"]) if family == "qwen2_moe" else 0,
            decoder_sparse_step=step,
            mlp_only_layers=tuple(int(layer) for layer in raw.get("mlp_only_layers") or ()),
        )
    _check_top_k(moe, num_experts_field)
    return moe


def _check_top_k(moe: MoeConfig, num_experts_field: str) -> None:
    if moe.num_experts > 0 and not 1 <= moe.num_experts_per_tok <= moe.num_experts:
        raise ModelLoadError(
            f"num_experts_per_tok {moe.num_experts_per_tok} is not valid with {num_experts_field} "
            f"{moe.num_experts}; each token chooses 1 to {moe.num_experts} experts"
        )


def _deepseek_moe_from_hf(raw: dict) -> MoeConfig:
    """DeepSeek-V3's (and Kimi K2's) sparse MLP, under DeepseekV3Config's names and defaults.

    transformers implements only DeepSeek-V3's routing (sigmoid scores, "noaux_tc" grouped top-k) and
    a sparse MLP in every layer from first_k_dense_replace on; the original configs also write
    scoring_func, topk_method and moe_layer_freq, so other values of those are refused rather than
    served with V3's semantics."""
    for field, expected in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
        if raw.get(field, expected) != expected:
            raise ModelLoadError(
                f"{field} {raw[field]!r} is not supported; graphrt computes DeepSeek-V3's routing and layout "
                f"({field} {expected!r})"
            )
    # transformers writes n_routed_experts (num_local_experts is its attribute_map alias)
    num_experts_field = "n_routed_experts" if "n_routed_experts" in raw else "num_local_experts"
    moe = MoeConfig(
        num_experts=int(raw.get(num_experts_field, 256)),
        num_experts_per_tok=int(raw.get("num_experts_per_tok") or 8),
        moe_intermediate_size=int(raw.get("moe_intermediate_size", 2048)),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        scoring="sigmoid",
        n_group=int(raw.get("n_group") or 1),
        topk_group=int(raw.get("topk_group") or 1),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 2.5)),
        n_shared_experts=int(raw.get("n_shared_experts") or 0),
        first_k_dense_replace=int(raw.get("first_k_dense_replace") or 0),
    )
    _check_top_k(moe, num_experts_field)
    if moe.n_group < 1 or moe.num_experts % moe.n_group or moe.num_experts // moe.n_group < 2:
        raise ModelLoadError(
            f"n_group {moe.n_group} is not valid with {num_experts_field} {moe.num_experts}; the experts "
            "split into n_group equal groups of at least 2 (a group is scored by its two best experts)"
        )
    if not 1 <= moe.topk_group <= moe.n_group:
        raise ModelLoadError(f"topk_group {moe.topk_group} is not valid with n_group {moe.n_group}; it is 1 to {moe.n_group}")
    eligible = moe.topk_group * (moe.num_experts // moe.n_group)
    if moe.num_experts_per_tok > eligible:
        raise ModelLoadError(
            f"num_experts_per_tok {moe.num_experts_per_tok} is more than the {eligible} experts of topk_group "
            f"{moe.topk_group} groups; each token chooses among those"
        )
    return moe


def _context_limit(raw: dict) -> int:
    """max_position_embeddings, capped at the sliding window where the model uses one: graphrt
    attends to the whole context, which matches such a model only within its window."""
    limit = int(raw.get("max_position_embeddings", 4096))
    window = raw.get("sliding_window")
    uses_window = raw.get("use_sliding_window", True)  # Qwen2 configs carry a window they don't use
    if window and uses_window:
        limit = min(limit, int(window))
    return limit


def rope_from_hf(raw: dict) -> RopeConfig:
    """The rotary embedding a Hugging Face config.json asks for."""
    # transformers >= 5 writes `rope_parameters`; older configs `rope_theta` + `rope_scaling`.
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in ("default", "linear", "llama3", "yarn"):
        raise ModelLoadError(
            f"rope_type {rope_type!r} is not supported; graphrt supports default, linear, llama3 and yarn"
        )
    # transformers' rule: a scaled rope's pre-training context defaults to max_position_embeddings,
    # and yarn's factor, when not given, is the ratio of the two
    original = int(params.get("original_max_position_embeddings") or raw.get("max_position_embeddings", 4096))
    factor = params.get("factor")
    if factor is None:
        factor = raw.get("max_position_embeddings", original) / original if rope_type == "yarn" else 1.0
    optional = lambda name: None if params.get(name) is None else float(params[name])  # noqa: E731
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(factor),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=original,
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        truncate=bool(params.get("truncate", True)),
        mscale=optional("mscale"),
        mscale_all_dim=optional("mscale_all_dim"),
        attention_factor=optional("attention_factor"),
    )
