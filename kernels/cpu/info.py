"""What this CPU is and which bfloat16 instructions it has.

torch asks the CPU itself (cpuid) through private helpers; where those are missing, the flags the
Linux kernel lists in /proc/cpuinfo say the same.
"""

from __future__ import annotations

import platform
from pathlib import Path

import torch

CPUINFO = Path("/proc/cpuinfo")
CPU0_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")


def _cpuinfo_field(name: str) -> str | None:
    """The first `name : value` line of /proc/cpuinfo, or None (not Linux, or no such field)."""
    try:
        for line in CPUINFO.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == name:
                return value.strip()
    except OSError:
        pass
    return None


def cpu_model_name() -> str:
    """e.g. "AMD EPYC 9R14" or "Intel(R) Xeon(R) Platinum 8488C" (a VM may show less)."""
    return _cpuinfo_field("model name") or platform.processor() or platform.machine() or "unknown CPU"


def cpu_bf16_support() -> str | None:
    """"AMX" (bf16 tiles: Sapphire Rapids and later), "AVX512-BF16" (bf16 dot products: Cooper
    Lake, Zen 4 and later), or None: this CPU has no bfloat16 matmul instructions, so oneDNN
    would emulate them and bfloat16 would be slower than float32 here."""
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    avx512_bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    if amx is not None and avx512_bf16 is not None:
        has_amx, has_avx512_bf16 = amx(), avx512_bf16()
    else:
        flags = set((_cpuinfo_field("flags") or "").split())
        has_amx, has_avx512_bf16 = {"amx_bf16", "amx_tile"} <= flags, "avx512_bf16" in flags
    if has_amx:
        return "AMX"
    if has_avx512_bf16:
        return "AVX512-BF16"
    return None


def cpu_l3_bytes(default: int = 32 << 20, cache_dir: Path = CPU0_CACHES) -> int:
    """The size of the last-level cache cpu0 sees (sysfs' `cache_dir`), or `default` where sysfs doesn't say."""
    for index in sorted(cache_dir.glob("index*")):
        try:
            if (index / "level").read_text().strip() == "3":
                size = (index / "size").read_text().strip()  # e.g. "32768K"
                units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
                return int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
        except (OSError, ValueError):
            break
    return default
