"""What an environment variable forces among the CPU kernel paths that start-up would otherwise time
(GRAPHRT_MATMUL for the matmul form of each weight shape, GRAPHRT_CPU_KERNELS for each op), so any
combination the timing can produce can be reproduced."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping


@dataclass(frozen=True)
class ForcedModes:
    """What an environment variable (GRAPHRT_MATMUL, GRAPHRT_CPU_KERNELS) forces, name by name: the
    mode of each name in `by_name` (a weight shape, an op), `default` for the others. "auto" leaves
    a name to be measured."""

    default: str = "auto"
    by_name: Mapping[str, str] = field(default_factory=dict)

    def of(self, name: str) -> str:
        return self.by_name.get(name, self.default)

    def describe(self, names: tuple[str, ...]) -> str:
        """What is forced among `names`, e.g. "o_proj=panel, qkv_proj=packed"; "" if nothing is."""
        return ", ".join(f"{name}={self.of(name)}" for name in names if self.of(name) != "auto")


def as_forced(mode: ForcedModes | str) -> ForcedModes:
    """A bare mode forces it for every name."""
    return mode if isinstance(mode, ForcedModes) else ForcedModes(mode)


def mode_from_env(
    name: str, modes: tuple[str, ...], environ: Mapping[str, str], names: Mapping[str, tuple[str, ...]] | None = None
) -> ForcedModes:
    """What an environment variable forces: a comma-separated list of a mode for every name and of
    NAME=MODE for one, case-insensitive, e.g. GRAPHRT_MATMUL=packed, GRAPHRT_MATMUL=o_proj=panel
    (the other shapes measured) or GRAPHRT_MATMUL=o_proj=panel,packed. `modes` are the modes a bare
    entry may take; `names` the names an entry may give, each with its own modes (default: `modes`).
    Unset or empty is "auto" for all. Raises ValueError naming the variable and what it accepts."""
    text = environ.get(name, "").strip().lower()
    names = names or {}
    default, by_name = "auto", {}
    for entry in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = entry.rpartition("=")
        key, value = key.strip(), value.strip()
        if not key:
            if value not in modes:
                raise ValueError(f"{name} must be one of {', '.join(modes)}, or NAME=MODE entries, got {environ[name]!r}")
            default = value
            continue
        if key not in names:
            raise ValueError(f"{name} names {key!r}, which is not one of {', '.join(names)}; got {environ[name]!r}")
        if value not in names[key]:
            raise ValueError(f"{name}: {key} must be one of {', '.join(names[key])}, got {value!r}")
        by_name[key] = value
    return ForcedModes(default, by_name)
