"""The model's own sampling defaults, from its generation_config.json, as vLLM applies them by
default (`--generation-config auto`): a request that leaves one of these out samples with the
model's value rather than the API's (Qwen3's folders say temperature 0.6, top_p 0.95, top_k 20)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from graphrt.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

GENERATION_CONFIG = "generation_config.json"
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")  # vLLM's, but max_new_tokens
GENERATION_CONFIG_CHOICES = ("auto", "vllm")  # or a folder that holds a generation_config.json


def sampling_defaults(folder: Path) -> dict[str, float | int]:
    """The sampling keys `folder`'s generation_config.json sets; {} without one. A value a request
    could not give (out of range, not a number) is left out with a warning naming it."""
    path = Path(folder) / GENERATION_CONFIG
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        logger.warning("%s is not readable JSON (%s); sampling keeps the API's defaults", path, exc)
        return {}
    defaults = {}
    for key in SAMPLING_KEYS:
        value = raw.get(key) if isinstance(raw, dict) else None
        if value is None:
            continue
        try:
            SamplingParams(**{key: value})  # the checks a request's value passes
        except (ValueError, TypeError) as exc:
            logger.warning("%s: %s=%r is left out: %s", path, key, value, exc)
            continue
        defaults[key] = value
    return defaults


def resolve(choice: str, model_dir: Path) -> dict[str, float | int]:
    """`--generation-config`: auto (the model folder's), vllm (none: the API's defaults) or a folder."""
    if choice == "vllm":
        return {}
    folder = model_dir if choice == "auto" else Path(choice)
    if choice != "auto" and not (folder / GENERATION_CONFIG).is_file():
        raise ValueError(f"--generation-config {choice}: no {GENERATION_CONFIG} there; give auto, vllm or a folder that holds one")
    return sampling_defaults(folder)


def describe(defaults: dict[str, float | int]) -> str:
    values = ", ".join(f"{key}={value}" for key, value in defaults.items())
    return f"sampling defaults from the model's {GENERATION_CONFIG}: {values} (a request's own values win; --generation-config vllm turns them off)"
