"""Block-FP8 checkpoints (graphrt/model/fp8.py): `graphrt dequantize-fp8` writes a bfloat16 folder
that graphrt and transformers read alike. The FP8 folder here is a tiny random DeepSeek-V3 quantized
as DeepSeek's release is: every projection's weight in float8_e4m3fn beside one float32 factor per
block, the router, norms and embeddings as they were."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from graphrt import LLM, SamplingParams
from graphrt.cli import main
from graphrt.errors import ModelLoadError
from graphrt.model.fp8 import dequantize_block_fp8
from graphrt.tools.synthetic import write_char_tokenizer
from helpers import hf_model

BLOCK = 16  # DeepSeek's blocks are 128 x 128; the tiny model's projections are 24 to 64 wide
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def quantize(weight: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """As DeepSeek quantizes: each block scaled so its largest magnitude is FP8's largest."""
    rows, cols = weight.shape
    blocks_r, blocks_c = -(-rows // block), -(-cols // block)
    scale_inv = torch.empty(blocks_r, blocks_c)
    quantized = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(blocks_r):
        for j in range(blocks_c):
            part = weight[i * block : (i + 1) * block, j * block : (j + 1) * block].float()
            scale_inv[i, j] = part.abs().max().clamp(min=1e-12) / FP8_MAX
            quantized[i * block : (i + 1) * block, j * block : (j + 1) * block] = (part / scale_inv[i, j]).to(torch.float8_e4m3fn)
    return quantized, scale_inv


def dequantized_by_loop(quantized: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    out = torch.empty(quantized.shape, dtype=torch.bfloat16)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            rows, cols = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
            out[rows, cols] = (quantized[rows, cols].float() * scale_inv[i, j]).to(torch.bfloat16)
    return out


def test_each_block_is_scaled_by_its_own_factor_partial_blocks_too():
    weight = torch.randn(40, 24, generator=torch.Generator().manual_seed(0))  # 40 and 24: partial last blocks
    quantized, scale_inv = quantize(weight)
    assert scale_inv.shape == (3, 2)
    ours = dequantize_block_fp8(quantized, scale_inv, (BLOCK, BLOCK))
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, dequantized_by_loop(quantized, scale_inv))
    assert (ours.float() - weight).abs().max() <= 0.07 * weight.abs().max()  # FP8's 3 mantissa bits


@pytest.fixture(scope="module")
def fp8_model(tiny_model_factory, tmp_path_factory):
    """A tiny DeepSeek-V3 in two FP8 shards with their index, and its tensors before quantizing."""
    source = tiny_model_factory("deepseek-v3")
    folder = write_char_tokenizer(tmp_path_factory.mktemp("fp8") / "model")
    original = load_file(source / "model.safetensors")
    tensors = {}
    for name, tensor in original.items():
        if tensor.dim() == 2 and name.endswith("proj.weight"):  # every linear layer's but the router's (mlp.gate)
            tensors[name], tensors[name + "_scale_inv"] = quantize(tensor)
        else:
            tensors[name] = tensor
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2], "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
    for shard, held in halves.items():  # a weight and its factors may land in different shards
        save_file({name: tensors[name] for name in held}, folder / shard)
    weight_map = {name: shard for shard, held in halves.items() for name in held}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}
    (folder / "config.json").write_text(json.dumps(config))
    return folder, tensors


def test_an_fp8_folder_is_refused_naming_the_command_that_converts_it(fp8_model):
    folder, _ = fp8_model
    with pytest.raises(ModelLoadError, match=r"quantization_config \(fp8\) is not supported.*`graphrt dequantize-fp8 SRC OUT_DIR`"):
        LLM(model=folder)


def test_dequantize_fp8_writes_a_bfloat16_folder_that_runs_as_transformers_runs_it(fp8_model, tmp_path):
    folder, quantized = fp8_model
    out = tmp_path / "bf16"
    result = CliRunner().invoke(main, ["dequantize-fp8", str(folder), str(out)])
    assert result.exit_code == 0 and f"run it with --model {out}" in result.output, result.output
    assert "[graphrt] shard 2/2: model-00002-of-00002.safetensors" in result.output
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    written = {}
    for shard in sorted(out.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as handle:
            written.update({name: handle.get_tensor(name) for name in handle.keys()})
    assert set(written) == set(index) == {name for name in quantized if not name.endswith("_scale_inv")}
    for name, tensor in written.items():
        if (name + "_scale_inv") in quantized:
            assert torch.equal(tensor, dequantized_by_loop(quantized[name], quantized[name + "_scale_inv"])), name
        else:
            assert torch.equal(tensor, quantized[name]), name  # kept as stored
    assert (out / "tokenizer.json").is_file()

    prompt = [5, 17, 33, 9, 41]
    llm = LLM(model=out, dtype="float32")
    ours = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].token_ids
    reference = hf_model(out, torch.float32).generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt) :].tolist()
    assert ours == reference


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.pop("quantization_config"), "has no FP8 quantization_config"),
    (lambda c: c["quantization_config"].update(weight_block_size=[128]), "weight_block_size [128], not two positive integers"),
])
def test_what_is_not_block_fp8_is_refused_and_nothing_is_written(fp8_model, tmp_path, edit, message):
    folder, _ = fp8_model
    copy = shutil.copytree(folder, tmp_path / "src")
    config = json.loads((copy / "config.json").read_text())
    edit(config)
    (copy / "config.json").write_text(json.dumps(config))
    result = CliRunner().invoke(main, ["dequantize-fp8", str(copy), str(tmp_path / "out")])
    assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output, result.output
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["src"]
