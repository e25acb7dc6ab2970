"""Safetensors shards, read lazily: each stage reads only its own tensors, memory-mapped."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from graphrt.errors import ModelLoadError


class WeightFiles:
    """Maps each tensor name to the shard that holds it, without reading any tensor data."""

    def __init__(self, model_dir: Path):
        self.model_dir = model_dir
        self.files = sorted(model_dir.glob("*.safetensors"))
        if not self.files:
            raise ModelLoadError(
                f"{model_dir} holds no *.safetensors files; graphrt reads Hugging Face safetensors "
                "weights (convert a GGUF file with `graphrt import-gguf FILE OUT_DIR`)"
            )
        self.location: dict[str, Path] = {}
        for path in self.files:
            for name in self._open(path).keys():
                self.location[name] = path

    @staticmethod
    def _open(path: Path):
        try:
            return safe_open(str(path), framework="pt", device="cpu")
        except Exception as exc:  # safetensors raises its own error types for every kind of damage
            raise ModelLoadError(
                f"{path} is not a readable safetensors file ({exc}); it may be truncated or corrupt, "
                "download or convert it again"
            ) from None

    def __contains__(self, name: str) -> bool:
        return name in self.location

    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.files)

    def load(
        self, names: list[str], device: torch.device, dtype: torch.dtype, rows: dict[str, range] | None = None
    ) -> dict[str, torch.Tensor]:
        """Read `names` (and nothing else) onto `device` as `dtype`; of a name in `rows`, only those
        rows of its first dimension (an expert rank's experts of a stacked tensor)."""
        rows = rows or {}
        missing = [n for n in names if n not in self.location]
        if missing:
            raise ModelLoadError(
                f"the weights in {self.model_dir} lack {len(missing)} tensors the config needs, "
                f"e.g. {missing[0]!r}; the model folder is incomplete or from another architecture"
            )
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.location[name], []).append(name)
        tensors = {}
        for path, file_names in by_file.items():
            handle = self._open(path)
            for name in file_names:
                try:
                    tensor = handle.get_slice(name)[rows[name].start : rows[name].stop] if name in rows else handle.get_tensor(name)
                except Exception as exc:
                    raise ModelLoadError(f"cannot read {name!r} from {path} ({exc}); the file may be truncated") from None
                tensors[name] = tensor.to(device=device, dtype=dtype)
        return tensors

