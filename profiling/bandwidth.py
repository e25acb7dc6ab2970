"""What a memory-bound decode step is read against: the device's copy rate, measured here, beside
the datasheet's peak.

A datasheet's HBM figure (the H200's 4.8 TB/s) is a peak that kernels do not reach; a plain
device-to-device copy measures what this device moves in practice. A decode step's share of each
says how far there is to go, and a copy well below the datasheet says the device, not graphrt, is
short (a clock cap, another process, a different part).
"""

from __future__ import annotations

import statistics
import time

import torch

COPY_BYTES = {"cuda": 1 << 30, "cpu": 1 << 26}  # 1 GiB on a GPU (past every cache), 64 MiB on a CPU


def device_copy_gb_s(device: torch.device, repeats: int = 10) -> float:
    """A device-to-device copy's rate, bytes read plus bytes written per second, in GB/s (median
    of `repeats`, after a warm-up): CUDA events on a GPU, the host clock on a CPU."""
    size = COPY_BYTES.get(device.type, COPY_BYTES["cpu"])
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    seconds = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            target.copy_(source)
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            target.copy_(source)
            seconds.append(time.perf_counter() - began)
    return 2 * size / statistics.median(seconds) / 1e9

