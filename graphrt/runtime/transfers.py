"""Small host values onto a device without making the host wait."""

from __future__ import annotations

import torch


def host_to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small per-row tensor on `device` without blocking the host: `torch.tensor(..., device=cuda)`
    copies synchronously, which would make the host wait for the whole pipeline."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
