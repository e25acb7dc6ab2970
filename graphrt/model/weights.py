"""Safetensors shards, read lazily: each stage reads only its own tensors, memory-mapped."""

from __future__ import annotations

import json
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

    def _missing(self, missing: list[str]) -> str:
        """What to say of tensors no shard holds: the shards model.safetensors.index.json names for
        them that are not in the folder (a download cut short), else that the folder lacks them."""
        tensors = f"{len(missing)} tensor{'s' if len(missing) != 1 else ''}"
        index = self.model_dir / "model.safetensors.index.json"
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError):
            weight_map = {}
        absent = sorted({weight_map[n] for n in missing if isinstance(weight_map.get(n), str) and not (self.model_dir / weight_map[n]).exists()})
        if absent:
            shards = f"{len(absent)} shard{'s' if len(absent) != 1 else ''}"
            return (f"{self.model_dir} lacks {shards} that model.safetensors.index.json names ({', '.join(absent[:3])}"
                    f"{', ...' if len(absent) > 3 else ''}), holding {tensors} the config needs; the download is incomplete: "
                    f"fetch the missing file{'s' if len(absent) != 1 else ''}")
        return (f"the weights in {self.model_dir} lack {tensors} the config needs, e.g. {missing[0]!r}; the model folder is "
                "incomplete or from another architecture")

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
            raise ModelLoadError(self._missing(missing))
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

