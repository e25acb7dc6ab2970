"""What graphrt needs from a Hugging Face `config.json`, validated once at the edge.

`ModelConfig.from_dir` raises `ModelLoadError` with a message that says what was wrong and what
would be right.
"""

from __future__ import annotations

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
}

# architectures value -> what graphrt lacks to serve it. Its MoE config is read (moe_from_hf) and its
# sparse block built (SparseMoE), but the model as a whole is refused until the rest exists.
NOT_YET_SUPPORTED = {
    "DeepseekV3ForCausalLM": (
        "its attention is MLA (multi-head latent attention, with a latent paged KV cache), which graphrt "
        "does not build yet; its mixture of experts (sigmoid routing with expert groups) is built"
    ),
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
        if arch in NOT_YET_SUPPORTED:
            raise ModelLoadError(f"{arch} is not supported yet: {NOT_YET_SUPPORTED[arch]}")
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
            return ModelConfig(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden_size,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
                head_dim=int(raw.get("head_dim") or hidden_size // num_heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                max_position=_context_limit(raw),
                rope=rope_from_hf(raw),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                qkv_bias=_qkv_bias(arch, raw),
                qk_norm=bool(extras.get("qk_norm", False)),
                moe=moe,
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
        raise ModelLoadError(
            f"quantization_config ({method}) is not supported; graphrt reads unquantized float weights, "
            "so use the model's bfloat16 or float16 release"
        )
    if arch == "Qwen3MoeForCausalLM" and raw.get("attention_bias"):
        raise ModelLoadError(
            "attention_bias true is not supported for Qwen3MoeForCausalLM (it adds a bias to o_proj, which graphrt lacks)"
        )


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
    if rope_type not in ("default", "linear", "llama3"):
        raise ModelLoadError(
            f"rope_type {rope_type!r} is not supported; graphrt supports default, linear and llama3"
        )
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(params.get("original_max_position_embeddings", 8192)),
    )
