"""The graph cache's manifest: what was captured, for which model and machine, and how well.

CUDA graphs hold raw device addresses and cannot be written to disk. What the cache keeps is the
plan (stages, buckets, which (stage, bucket) pairs must stay eager), the measurements, the CPU
matmul path each stage measured fastest per weight shape and the CPU kernel of each op (so a
restart runs the same code, and gives the same bfloat16 output), the compiled Triton kernels, and an
identity of model + machine that a later start checks field by field before it re-records the
graphs from the plan.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import secrets
import struct
from pathlib import Path

import torch

from graphrt.errors import GraphrtError
from graphrt.kernels.cpu.matmul_choice import MatmulPlan

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"

# Fields that must match between the cache and the run that uses it, in the order reported.
IDENTITY_FIELDS = (
    "model_fingerprint",
    "architecture",
    "dtype",
    "pp",
    "stages",
    "device_names",
    "kernels",
    "backend",
    "block_size",
    "max_model_len",
    "buckets",
    "torch",
    "triton",
    "cuda",
    "driver",
)


class StaleCacheError(GraphrtError):
    """The graph cache does not fit this model or machine, or cannot be read."""


def model_fingerprint(model_dir: Path) -> str:
    """sha256 over config.json and each safetensors file's name, size and header.

    The header lists every tensor's name, dtype, shape and offsets, so any change to the weights'
    layout shows; hashing headers instead of gigabytes keeps this instant.
    """
    digest = hashlib.sha256()
    digest.update((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        size = path.stat().st_size
        with path.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = f.read(min(header_len, size))
        digest.update(f"{path.name}:{size}:".encode())
        digest.update(header)
    return digest.hexdigest()


def software_versions() -> dict:
    from graphrt.capture.cuda_info import driver_version

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"torch": torch.__version__, "triton": triton_version, "cuda": torch.version.cuda, "driver": driver_version()}


def device_name(device: torch.device) -> str:
    """The GPU's name, or "cpu (<model name>)": a cache records matmul paths measured on one CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        from graphrt.kernels.cpu.info import cpu_model_name

        return f"cpu ({cpu_model_name()})"
    return device.type


def cached_matmul_plans(manifest: dict) -> list[MatmulPlan] | None:
    """The matmul paths a cache recorded per stage (kernels/cpu/stage_kernels.choose_matmuls), or None for a cache
    written before they were recorded (the stages then measure again)."""
    if "matmuls" not in manifest:
        return None
    try:
        return [MatmulPlan.from_json(plan) for plan in manifest["matmuls"]]
    except (TypeError, ValueError) as exc:
        raise StaleCacheError(f"the graph cache's matmul plans cannot be read ({exc}); rebuild it with `graphrt capture`") from None


def cached_cpu_kernels(manifest: dict) -> tuple[dict[str, str] | None, str | None]:
    """The CPU kernels a cache recorded: each op's path (kernels/cpu/kernel_choice.py) and the greedy
    argmax's, or None for what it did not record (a CUDA cache, or one written before they were:
    they are timed again)."""
    raw = manifest.get("cpu_kernels")
    if raw is None:
        return None, None
    paths = ("torch", "compiled")
    ops = raw.get("ops") if isinstance(raw, dict) else None
    argmax = raw.get("greedy_argmax") if isinstance(raw, dict) else None
    if not isinstance(ops, dict) or any(path not in paths for path in ops.values()) or argmax not in (None, *paths):
        raise StaleCacheError(f"the graph cache's CPU kernel choices are malformed ({raw!r}); rebuild it with `graphrt capture`")
    return ops, argmax


def write_manifest(out_dir: Path, manifest: dict) -> Path:
    """Write atomically: a temp file in the same folder, then rename, so readers never see half."""
    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        # Made as open(2) makes files, 0666 less the umask, as the cache's other files (mkstemp's are 0600).
        tmp = str(out_dir / f".manifest.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    except OSError as exc:
        raise GraphrtError(f"cannot write the graph cache to {out_dir} ({exc.strerror}); choose a writable --out folder") from None
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(manifest, f, indent=2)
            f.write("\n")
        os.replace(tmp, out_dir / MANIFEST_NAME)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out_dir / MANIFEST_NAME


def read_manifest(cache_dir: Path) -> dict:
    cache_dir = Path(cache_dir)
    if cache_dir.is_file():
        why = f"is the cache's {MANIFEST_NAME}" if cache_dir.name == MANIFEST_NAME else "is a file"
        raise StaleCacheError(f"{cache_dir} {why}; pass the graph cache's folder ({cache_dir.parent})")
    if not cache_dir.exists():
        raise StaleCacheError(f"the graph cache {cache_dir} does not exist; make it with `graphrt capture --out {cache_dir}`")
    path = cache_dir / MANIFEST_NAME
    refresh = f"run `graphrt capture --out {cache_dir}` to rebuild it"
    if not path.is_file():
        raise StaleCacheError(f"{cache_dir} holds no {MANIFEST_NAME}; {refresh}")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise StaleCacheError(f"{path} is not valid JSON (truncated or corrupt); {refresh}") from None
    if not isinstance(manifest, dict) or manifest.get("schema_version") != SCHEMA_VERSION:
        found = manifest.get("schema_version") if isinstance(manifest, dict) else None
        raise StaleCacheError(
            f"{path} has schema version {found!r}, this graphrt reads version {SCHEMA_VERSION}; {refresh}"
        )
    missing = [f for f in IDENTITY_FIELDS if f not in manifest]
    if missing or not isinstance(manifest.get("graphs"), list):
        raise StaleCacheError(f"{path} lacks {', '.join(missing) or 'graphs'}; {refresh}")
    problem = malformed(manifest)
    if problem is not None:
        raise StaleCacheError(f"{path} is damaged: {problem}; {refresh}")
    return manifest


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_str(value) -> bool:
    return isinstance(value, str)


def _is_text_or_null(value) -> bool:
    return value is None or isinstance(value, str)


# What each field read back must be (a manifest edited by hand, or damaged, is named, not run).
FIELD_CHECKS = {
    "model_fingerprint": (_is_str, "a string"),
    "architecture": (_is_str, "a string"),
    "dtype": (_is_str, "a string"),
    "pp": (lambda v: _is_int(v) and v >= 1, "a positive integer"),
    "stages": (lambda v: isinstance(v, list) and all(
        isinstance(s, dict) and isinstance(s.get("device"), str) and isinstance(s.get("layers"), list)
        and len(s["layers"]) == 2 and all(map(_is_int, s["layers"])) for s in v
    ), 'a list of {"layers": [first, end], "device": name}'),
    "device_names": (lambda v: isinstance(v, list) and all(map(_is_str, v)), "a list of strings"),
    "kernels": (_is_str, "a string"),
    "backend": (_is_str, "a string"),
    "block_size": (lambda v: _is_int(v) and v >= 1, "a positive integer"),
    "max_model_len": (lambda v: _is_int(v) and v >= 1, "a positive integer"),
    "buckets": (lambda v: isinstance(v, list) and v and all(_is_int(b) and b >= 1 for b in v) and v == sorted(set(v)),
                "a non-empty, increasing list of positive integers"),
    "torch": (_is_str, "a string"),
    "triton": (_is_text_or_null, "a string or null"),
    "cuda": (_is_text_or_null, "a string or null"),
    "driver": (_is_text_or_null, "a string or null"),
}
GRAPH_CHECKS = {
    "stage": (_is_int, "an integer"),
    "bucket": (_is_int, "an integer"),
    "mode": (lambda v: v in ("graph", "eager"), '"graph" or "eager"'),
    "capture_ms": (lambda v: _is_number(v), "a number"),
    "max_abs_error": (lambda v: v is None or _is_number(v), "a number or null"),
    "max_abs_error_allowed": (lambda v: v is None or _is_number(v), "a number or null"),  # absent from older caches
}


def malformed(manifest: dict) -> str | None:
    """What is wrong with a manifest's fields, their types and how they fit together; None if nothing."""
    for field, (fits, what) in FIELD_CHECKS.items():
        if not fits(manifest[field]):
            return f"{field} is {manifest[field]!r}, not {what}"
    if len(manifest["stages"]) != manifest["pp"]:
        return f"it lists {len(manifest['stages'])} stages for pp {manifest['pp']}"
    for index, graph in enumerate(manifest["graphs"]):
        if not isinstance(graph, dict):
            return f"graphs[{index}] is {graph!r}, not an object"
        for field, (fits, what) in GRAPH_CHECKS.items():
            if not fits(graph.get(field)):
                return f"graphs[{index}].{field} is {graph.get(field)!r}, not {what}"
        if not 0 <= graph["stage"] < manifest["pp"] or graph["bucket"] not in manifest["buckets"]:
            return f"graphs[{index}] is stage {graph['stage']}, bucket {graph['bucket']}, which pp {manifest['pp']} and buckets {manifest['buckets']} do not have"
    return None


def stale_fields(saved: dict, current: dict) -> list[str]:
    """One line per identity field that differs: name, what the cache has, what this run has."""
    lines = []
    for field in IDENTITY_FIELDS:
        if saved.get(field) != current.get(field):
            lines.append(f"{field}: cache has {saved.get(field)!r}, this run has {current.get(field)!r}")
    return lines


def new_manifest(identity: dict, extra: dict, graphs: list[dict]) -> dict:
    return {
        "schema_version": SCHEMA_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **identity,
        **extra,
        "graphs": graphs,
    }
