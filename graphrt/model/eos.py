"""The id a model stops at: its tokenizer's EOS token, found from the folder's files where they settle
it (no transformers import, which takes seconds of a start-up), else from transformers' tokenizer.
For the engine, which never sees text and needs only the id to stop at."""

from __future__ import annotations

import json
from pathlib import Path


def tokenizer_eos_token_id(model_dir: Path) -> int | None:
    """The id `graphrt.frontend.tokenizer.Tokenizer.from_dir(model_dir).eos_token_id` has: from the
    files (eos_token_id_from_files) where they settle it, else loading transformers' tokenizer;
    None for a folder without a tokenizer."""
    from_files = eos_token_id_from_files(model_dir)
    if from_files is not None:
        return from_files
    if not (model_dir / "tokenizer.json").is_file() and not (model_dir / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir).eos_token_id
    except (OSError, ValueError):
        return None  # the front, which loads the tokenizer for text, says what is wrong with it


def eos_token_id_from_files(model_dir: Path) -> int | None:
    """The id `Tokenizer.from_dir(model_dir).eos_token_id` has, read from tokenizer_config.json and
    tokenizer.json without importing transformers (which takes seconds of a start-up): for an
    engine that never sees text and needs only the id to stop at. As transformers' fast tokenizer
    does, the id comes from tokenizer.json (its added tokens, then its vocabulary). None where the
    files leave it open (no tokenizer.json, no eos_token, one that special_tokens_map.json
    contradicts, or one in neither list); the caller then loads the tokenizer."""
    config = _read_json(model_dir / "tokenizer_config.json")
    eos = _token_content(config.get("eos_token")) if isinstance(config, dict) else None
    if eos is None:
        return None
    special_tokens = _read_json(model_dir / "special_tokens_map.json")
    if isinstance(special_tokens, dict) and "eos_token" in special_tokens and _token_content(special_tokens["eos_token"]) != eos:
        return None
    tokenizer = _read_json(model_dir / "tokenizer.json")
    if not isinstance(tokenizer, dict):
        return None
    added = [t.get("id") for t in tokenizer.get("added_tokens") or [] if isinstance(t, dict) and t.get("content") == eos]
    if added:
        return added[0] if len(added) == 1 and isinstance(added[0], int) else None
    model = tokenizer.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    token_id = vocab.get(eos) if isinstance(vocab, dict) else None
    return token_id if isinstance(token_id, int) else None


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _token_content(token) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or {"content": ...}."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None
