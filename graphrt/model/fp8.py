"""Block-FP8 checkpoints (DeepSeek-V3, Kimi K2), dequantized once into a bfloat16 folder graphrt reads.

Those models are released only in FP8: each linear layer's weight is float8_e4m3fn beside
`{name}_scale_inv`, one float32 factor per block of `weight_block_size` (128 x 128) weights, and the
weight is the FP8 value times its block's factor. The rest (embeddings, norms, the router, the LM
head) is stored in bfloat16 or float32 already. graphrt reads float weights, so `graphrt
dequantize-fp8 SRC OUT` writes every FP8 weight as bfloat16 (twice its bytes), shard by shard, keeps
every other tensor as stored, and drops `quantization_config` from the config.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch

from graphrt.errors import ModelLoadError

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_SUFFIX = "_scale_inv"
INDEX_NAME = "model.safetensors.index.json"


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """(rows, cols) FP8 weight times its (ceil(rows / block rows), ceil(cols / block cols)) factors,
    as bfloat16; the last blocks of a dimension the block size does not divide are partial."""
    rows, cols = weight.shape
    expected = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"its factors are {tuple(scale_inv.shape)}, not {expected} for {rows} x {cols} weights in {block[0]} x {block[1]} blocks")
    factors = scale_inv.float().repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :cols]
    return (weight.float() * factors).to(torch.bfloat16)


def block_size_of(config: dict, src: Path) -> tuple[int, int]:
    """The FP8 blocks' shape from `quantization_config`; ModelLoadError if it is not block FP8."""
    quantization = config.get("quantization_config")
    if not isinstance(quantization, dict) or quantization.get("quant_method") != "fp8":
        raise ModelLoadError(
            f"{src}/config.json has no FP8 quantization_config (quant_method fp8); there is nothing to dequantize"
        )
    block = quantization.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ModelLoadError(
            f"{src}/config.json's quantization_config has weight_block_size {block!r}, not two positive integers; "
            "only block FP8 (DeepSeek-V3's, Kimi K2's) is dequantized"
        )
    return block[0], block[1]


def dequantize_fp8(src: Path, out_dir: Path, echo: Callable[[str], None] = print) -> Path:
    """Write `src`, a block-FP8 model folder, to `out_dir` in bfloat16. Written to a temporary
    sibling folder and renamed into place, so an interrupted run never leaves a folder that looks
    complete."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, out_dir = Path(src), Path(out_dir)
    if not (src / "config.json").is_file():
        raise ModelLoadError(f"{src} holds no config.json; give the model folder of an FP8 checkpoint")
    config = json.loads((src / "config.json").read_text())
    block = block_size_of(config, src)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ModelLoadError(f"{out_dir} exists and is not an empty folder; choose a new folder or remove it")
    shards = sorted(src.glob("*.safetensors"))
    if not shards:
        raise ModelLoadError(f"{src} holds no *.safetensors files")
    location = {name: shard for shard in shards for name in safe_open(str(shard), "pt").keys()}
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    tmp.chmod(0o755)
    try:
        weight_map, total_bytes = {}, 0
        for number, shard in enumerate(shards, start=1):
            tensors = {}
            with safe_open(str(shard), "pt") as handle:
                for name in handle.keys():
                    if name.endswith(SCALE_SUFFIX):
                        continue  # folded into its weight
                    tensor = handle.get_tensor(name)
                    if tensor.dtype in FP8_DTYPES:
                        scale_name = name + SCALE_SUFFIX
                        if scale_name not in location:
                            raise ModelLoadError(f"{src}: the FP8 tensor {name!r} has no {scale_name!r} beside it in any shard")
                        if tensor.dim() != 2:
                            raise ModelLoadError(f"{src}: the FP8 tensor {name!r} is {tensor.dim()}-D; block FP8 weights are matrices")
                        with safe_open(str(location[scale_name]), "pt") as scales:
                            try:
                                tensor = dequantize_block_fp8(tensor, scales.get_tensor(scale_name), block)
                            except ValueError as exc:
                                raise ModelLoadError(f"{src}: {name!r} cannot be dequantized: {exc}") from None
                    tensors[name] = tensor.contiguous()
            save_file(tensors, str(tmp / shard.name), metadata={"format": "pt"})
            weight_map.update({name: shard.name for name in tensors})
            total_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
            echo(f"[graphrt] shard {number}/{len(shards)}: {shard.name}, {len(tensors)} tensors")
        config.pop("quantization_config")
        config["torch_dtype"] = config["dtype"] = "bfloat16"
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        for other in src.iterdir():  # tokenizer, chat template, generation config
            if other.is_file() and other.suffix != ".safetensors" and other.name not in ("config.json", INDEX_NAME):
                shutil.copy2(other, tmp / other.name)
        if out_dir.exists():
            out_dir.rmdir()
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
