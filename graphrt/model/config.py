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

# architectures value -> what differs from plain Llama
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {},
    "Qwen2ForCausalLM": {"qkv_bias": True},
    "Qwen3ForCausalLM": {"qk_norm": True},
}

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
        try:
            num_heads = int(raw["num_attention_heads"])
            hidden_size = int(raw["hidden_size"])
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            extras = SUPPORTED_ARCHITECTURES[arch]
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
                qkv_bias=bool(extras.get("qkv_bias", False) or raw.get("attention_bias", False)),
                qk_norm=bool(extras.get("qk_norm", False)),
                eos_token_ids=eos_ids,
                bos_token_id=raw.get("bos_token_id"),
                torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
            )
        except KeyError as exc:
            raise ModelLoadError(f"config.json lacks the field {exc.args[0]!r}; the model folder is incomplete") from None


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
