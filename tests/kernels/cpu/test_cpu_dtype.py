"""bfloat16 on CPUs with bfloat16 matmul instructions: what `--dtype auto` gives, and that attention
and norms accumulate in float32 when their inputs are bfloat16."""

from __future__ import annotations

import pytest
import torch
import transformers

import graphrt.config
import graphrt.kernels.cpu.info
from graphrt import LLM
from graphrt.config import EngineConfig
from graphrt.kernels.cpu.info import cpu_bf16_support
from graphrt.kernels.paged_attention import paged_decode_attention, paged_prefill_attention
from graphrt.kernels.rmsnorm import rms_norm
from graphrt.model.config import ModelConfig
from helpers import prompt_logits

CPU = torch.device("cpu")


def model_config(torch_dtype: str | None = None) -> ModelConfig:
    return ModelConfig.from_hf({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "torch_dtype": torch_dtype,
    })


@pytest.mark.parametrize("support, expected", [("AMX", torch.bfloat16), ("AVX512-BF16", torch.bfloat16), (None, torch.float32)])
def test_auto_gives_bfloat16_on_a_cpu_with_bfloat16_instructions(monkeypatch, support, expected):
    monkeypatch.setattr(graphrt.config, "cpu_bf16_support", lambda: support)
    assert EngineConfig().resolve_dtype(model_config(), CPU) == expected
    # An explicit dtype is kept whatever the CPU has, and CUDA still follows the model.
    assert EngineConfig(dtype="float32").resolve_dtype(model_config(), CPU) == torch.float32
    assert EngineConfig().resolve_dtype(model_config("float16"), torch.device("cuda")) == torch.float16


def test_without_torch_helpers_the_kernel_flags_say_what_the_cpu_has(monkeypatch, tmp_path):
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported", raising=False)
    cpuinfo = tmp_path / "cpuinfo"
    monkeypatch.setattr(graphrt.kernels.cpu.info, "CPUINFO", cpuinfo)
    cpuinfo.write_text("model name\t: Some CPU\nflags\t\t: fpu avx2 avx512f avx512_bf16\n")
    assert cpu_bf16_support() == "AVX512-BF16"
    cpuinfo.write_text("model name\t: Some CPU\nflags\t\t: fpu avx512_bf16 amx_bf16 amx_tile\n")
    assert cpu_bf16_support() == "AMX"
    cpuinfo.write_text("model name\t: Some CPU\nflags\t\t: fpu avx2 fma\n")
    assert cpu_bf16_support() is None
    assert graphrt.kernels.cpu.info.cpu_model_name() == "Some CPU"


def ulps_off(out: torch.Tensor, ref: torch.Tensor) -> float:
    """How far a bfloat16 result is from a float64 one, in units of bfloat16's last place at ref."""
    ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(1e-30))) - 7)
    return ((out.double() - ref).abs() / ulp).max().item()


def test_decode_attention_on_bfloat16_is_as_exact_as_its_bfloat16_output():
    """Over 4096 tokens a softmax-weighted sum kept in bfloat16 is ~160 last places off; accumulated
    in float32 only the final rounding to bfloat16 is left (half a place)."""
    generator = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, head_dim, block_size, ctx = 2, 8, 2, 64, 16, 4096
    num_blocks = batch * ctx // block_size + 1
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator).bfloat16()
    v_cache = (torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator) + 3).bfloat16()
    q = (torch.randn(batch, heads, head_dim, generator=generator) * 0.3).bfloat16()
    block_tables = torch.arange(1, num_blocks).view(batch, -1)
    seq_lens = torch.tensor([ctx, ctx - 5])
    scale = head_dim**-0.5
    out = paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)
    ref = paged_decode_attention(q.double(), k_cache.double(), v_cache.double(), block_tables, seq_lens, scale)
    assert out.dtype == torch.bfloat16
    assert ulps_off(out, ref) <= 1.0


def test_prefill_attention_on_bfloat16_is_as_exact_as_its_bfloat16_output():
    generator = torch.Generator().manual_seed(1)
    heads, kv_heads, head_dim, block_size, ctx, query_len = 8, 2, 64, 16, 1024, 64
    num_blocks = ctx // block_size + 1
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator).bfloat16()
    v_cache = (torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator) + 3).bfloat16()
    q = (torch.randn(query_len, heads, head_dim, generator=generator) * 0.3).bfloat16()
    block_tables = torch.arange(1, num_blocks).view(1, -1)
    args = (block_tables, [query_len], [ctx], head_dim**-0.5)
    out = paged_prefill_attention(q, k_cache, v_cache, *args)
    ref = paged_prefill_attention(q.double(), k_cache.double(), v_cache.double(), *args)
    assert ulps_off(out, ref) <= 1.0


def test_rms_norm_on_bfloat16_takes_its_statistics_in_float32():
    """Two roundings to bfloat16 (the normed row, then times the weight, as transformers does), each
    half a place: within two places of float64 however large the row's values."""
    generator = torch.Generator().manual_seed(2)
    x = (torch.randn(4, 4096, generator=generator) * 300 + 100).bfloat16()
    residual = torch.randn(4, 4096, generator=generator).bfloat16()
    weight = (torch.rand(4096, generator=generator) + 0.5).bfloat16()
    out, summed = rms_norm(x, weight, 1e-5, residual)
    ref, _ = rms_norm(summed.double(), weight.double(), 1e-5)
    assert out.dtype == torch.bfloat16
    assert ulps_off(out, ref) <= 2.0


@pytest.mark.parametrize("variant", ["llama-gqa-tied", "qwen2-qkv-bias", "qwen3-qk-norm"])
@pytest.mark.parametrize("matmul", ["dense", "packed"])
def test_a_bfloat16_engine_computes_what_transformers_does_in_bfloat16(tiny_model_factory, monkeypatch, variant, matmul):
    """bfloat16 is bfloat16 as transformers runs it (each is 0.16 to 0.97 off float64 on these
    models); within one last place at the logits' size (3), whichever matmul path runs. On the
    torch references, each of which rounds where transformers' ops do (the compiled prefill
    attention sums in its own order: the next test)."""
    monkeypatch.setenv("GRAPHRT_MATMUL", matmul)
    monkeypatch.setenv("GRAPHRT_CPU_KERNELS", "torch")
    model_dir = tiny_model_factory(variant)
    prompt = list(range(3, 40))
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0, -1].float()
    engine = LLM(model=model_dir, dtype="bfloat16", kv_cache_tokens=256).engine
    assert engine.dtype == torch.bfloat16
    torch.testing.assert_close(prompt_logits(engine, prompt), expected, atol=0.016, rtol=0)


@pytest.mark.usefixtures("built_cpu_kernels")
@pytest.mark.parametrize("variant", ["llama-gqa-tied", "qwen2-qkv-bias", "qwen3-qk-norm"])
def test_a_bfloat16_engine_on_the_compiled_kernels_is_as_close_to_float64_as_transformers(tiny_model_factory, monkeypatch, variant):
    """The compiled prefill attention sums scores and values in float32 in another order than
    torch's flash attention, so its bfloat16 outputs differ from transformers' in a few last places
    (0.05 at the logits here); the engine must stay as close to float64 as transformers is."""
    monkeypatch.setenv("GRAPHRT_CPU_KERNELS", "compiled")
    model_dir = tiny_model_factory(variant)
    prompt = list(range(3, 40))
    with torch.no_grad():
        exact = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)(torch.tensor([prompt])).logits[0, -1]
        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)(torch.tensor([prompt])).logits[0, -1]
    ours = prompt_logits(LLM(model=model_dir, dtype="bfloat16", kv_cache_tokens=256).engine, prompt).double()
    hf_error, our_error = (hf.double() - exact).abs().max().item(), (ours - exact).abs().max().item()
    assert our_error <= 1.25 * hf_error + 0.016, f"{our_error:.3f} off float64 where transformers' bfloat16 is {hf_error:.3f}"
    torch.testing.assert_close(ours, hf.double(), atol=0.1, rtol=0)
