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
# vLLM's list less max_new_tokens (max_tokens keeps the API's default). transformers' own defaults
# count as unset, as vLLM reads them (GenerationConfig.to_diff_dict): "top_k": 50 is no default.
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
TRANSFORMERS_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}
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
        if value is None or (value == TRANSFORMERS_DEFAULTS.get(key) and not isinstance(value, bool)):
            continue
        if key == "top_k" and isinstance(value, float) and value.is_integer():
            value = int(value)
        try:
            if isinstance(value, bool):
                raise ValueError("a number is needed, not true or false")
            SamplingParams(**{key: value})  # the checks a request's value passes
        except (ValueError, TypeError) as exc:
            logger.warning("%s: %s=%r is left out: %s", path, key, value, exc)
            continue
        defaults[key] = value
    return defaults


def check_choice(choice: str) -> None:
    """Refuse a --generation-config folder that holds no generation_config.json, before any start."""
    if choice not in GENERATION_CONFIG_CHOICES and not (Path(choice) / GENERATION_CONFIG).is_file():
        raise ValueError(f"--generation-config {choice}: no {GENERATION_CONFIG} there; give auto, vllm or a folder that holds one")


def resolve(choice: str, model_dir: Path) -> dict[str, float | int]:
    """`--generation-config`: auto (the model folder's), vllm (none: the API's defaults) or a folder."""
    check_choice(choice)
    if choice == "vllm":
        return {}
    return sampling_defaults(model_dir if choice == "auto" else Path(choice))


def describe(defaults: dict[str, float | int], choice: str = "auto") -> str:
    """The banner's line; `choice` is --generation-config's."""
    source = f"the model's {GENERATION_CONFIG}" if choice == "auto" else str(Path(choice) / GENERATION_CONFIG)
    values = ", ".join(f"{key}={value}" for key, value in defaults.items())
    return f"sampling defaults from {source}: {values} (a request's own values win; --generation-config vllm turns them off)"
