"""Synthetic stages: real stages that also take a known time, for measuring the ring itself.

Each stage's forward sleeps `stage_ms` (a sleep releases the GIL, as a GPU kernel would free the
host) and the host spends `host_ms` on every micro-batch it reads back (standing in for
detokenizing, stop checks and streaming). With these known, the pipeline formula in
docs/profiling.md predicts each stage's busy share, and the timeline measures it.

`make_tiny_model` writes a small random model of a supported family, dense or mixture of experts
(no download), which tests, benchmarks and `graphrt profile --synthetic` run these stages on.
"""

from __future__ import annotations

from pathlib import Path

import torch

from graphrt.engine.engine import Engine


def make_synthetic(engine: Engine, stage_ms: float, host_ms: float = 0.0) -> Engine:
    """`engine` with every local stage sleeping `stage_ms` per forward and the host `host_ms` per
    micro-batch read back (a stage process's stages are not slowed)."""
    for stage in engine.pipeline.stages:
        stage.synthetic_delay_s = stage_ms / 1000
    engine.synthetic_host_s = host_ms / 1000
    return engine


def predicted_busy_fraction(pp: int, depth: int, stage_s: float, host_s: float, async_scheduling: bool) -> float:
    """Steady-state busy share of each stage, with micro-batches of T per stage and h of host time each.

    Without async scheduling a slot comes back after it crossed all stages and the host handled it
    (pp * T + h), while the stage has L = pp + depth micro-batches of T to run in that time:
    busy = L * T / max(L * T, pp * T + h). With it, the host handles a micro-batch while the slot's
    next one runs, so only its rate counts: one micro-batch per h against one per T on each stage,
    busy = T / max(T, h), at any depth. Both assume rows for every slot.
    """
    if async_scheduling:
        return stage_s / max(stage_s, host_s)
    ring = pp + depth
    return ring * stage_s / max(ring * stage_s, pp * stage_s + host_s)


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
    # Mixtures of experts: 8 experts is more than a decode bucket of 1 or 3 rows chooses at top-2, so
    # fused_moe's gathered form runs there and its every-expert form at 8 rows and in prefill. Mixtral
    # gets Llama's rope_theta: with its own (1e6) and these sizes, greedy output fell into loops.
    "mixtral": (
        "mixtral",
        dict(
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, intermediate_size=80,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    "qwen2-moe": (
        "qwen2_moe",
        dict(
            num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, norm_topk_prob=False,
        ),
    ),
    "qwen3-moe": (
        "qwen3_moe",
        dict(
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32, norm_topk_prob=True,
        ),
    ),
    # Layers 0 and 2 dense (layer 0 named in mlp_only_layers, layer 2 off the step of 2), 1 and 3 sparse;
    # 6 experts at top-3, unnormalised.
    "qwen3-moe-dense-first": (
        "qwen3_moe",
        dict(
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=6, num_experts_per_tok=3,
            moe_intermediate_size=40, norm_topk_prob=False, mlp_only_layers=[0], decoder_sparse_step=2,
        ),
    ),
    # DeepSeek-V3 / Kimi K2: latent attention and grouped sigmoid routing. The first has V3's layout
    # (a low-rank query, rotary pairs interleaved, yarn with its softmax mscale, 16 experts in 4
    # groups, a dense first layer, a shared expert); the second DeepSeek-V2-Lite's query (straight
    # from the hidden state), one expert group as Kimi K2 has, plain rope in halves, every layer sparse.
    "deepseek-v3": (
        "deepseek_v3",
        dict(
            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
            moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True,
            routed_scaling_factor=2.5, rope_interleave=True,
            rope_parameters=dict(
                rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
                beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0,
            ),
        ),
    ),
    "deepseek-kimi-layout": (
        "deepseek_v3",
        dict(
            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=24, qk_nope_head_dim=8,
            qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
            moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=0, norm_topk_prob=False,
            routed_scaling_factor=1.0, rope_interleave=False, rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
}


# Spread of the random weights (transformers draws every matrix with std 0.02). At 0.02, attention
# scores are about 0.1, so every head attends almost uniformly: removing RoPE moved the logits by
# under 3e-3 and never a greedy token, and greedy output repeated one token. Larger q/k make
# attention peaked (scores with a std of about 6); larger v/o and MLP weights make what attention
# reads outweigh the current token's embedding in the residual stream, so output depends on context;
# the embedding / LM head set a logit span of about 6. Only weights: biases stay small.
TINY_INIT_STD = {
    "embed_tokens": 0.15, "lm_head": 0.15, "q_proj": 0.3, "k_proj": 0.3, "v_proj": 0.16, "o_proj": 0.16, "mlp": 0.12,
    # latent attention's: the query's low-rank pair, the latent and rotary key, the latent's way out
    "q_a_proj": 0.3, "q_b_proj": 0.3, "kv_a_proj": 0.3, "kv_b_proj": 0.3,
}
# Qwen3 normalises each head of q and k, so there the norm weights set the scale of the scores.
TINY_QK_NORM_GAIN = 3.0


def make_tiny_model(
    path: Path, variant: str, seed: int = 0, num_layers: int | None = None, overrides: dict | None = None,
    weight_scale: float = 1.0,
) -> Path:
    """Write a randomly initialised transformers model of `variant` to `path` (safetensors, no tokenizer);
    `overrides`: config values to change (e.g. intermediate_size); `weight_scale` multiplies the
    spreads of TINY_INIT_STD (below 1, greedy output falls into loops sooner)."""
    import transformers

    family, extra = TINY_VARIANTS[variant]
    config_cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "mixtral": transformers.MixtralConfig,
        "qwen2_moe": transformers.Qwen2MoeConfig,
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "deepseek_v3": transformers.DeepseekV3Config,
    }[family]
    options = {**TINY_COMMON, **extra, **(overrides or {})}
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
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.mul_(TINY_QK_NORM_GAIN)
            # Stacked experts (transformers holds them as (experts, out, in) tensors) are matrices too.
            is_matrix = name.endswith(("weight", "experts.gate_up_proj", "experts.down_proj"))
            for part, std in TINY_INIT_STD.items():
                if part in name and is_matrix:
                    param.mul_(weight_scale * std / config.initializer_range)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek's router steering: zeros would test nothing
                buffer.copy_(torch.randn_like(buffer) * 0.1)
    from transformers.utils import logging as hf_logging

    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # its "Writing model shards" bar would sit among a command's own lines
    try:
        model.save_pretrained(path, safe_serialization=True)
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()
    return path


# A tiny model's vocabulary as text: <unk>, <s>, </s> (ids 0-2: LlamaConfig's EOS is 2), then one
# token per printable ASCII character but "~" (ids 3-96), so TINY_COMMON's 97 ids all spell something.
TINY_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
TINY_CHARACTERS = tuple(chr(code) for code in range(32, 126))


def write_char_tokenizer(path: Path) -> Path:
    """Give a tiny model's folder a real Hugging Face tokenizer of one token per character (see
    TINY_CHARACTERS): what needs text of a tiny model (grammars, stop strings) reads it."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(TINY_SPECIAL_TOKENS + TINY_CHARACTERS)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.decoder = decoders.Fuse()  # characters join as they are, with no space between tokens
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>").save_pretrained(path)
    return path
