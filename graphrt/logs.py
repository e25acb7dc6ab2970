"""Where graphrt's log records go when it runs as a program (the CLI, the engine process, a stage
process): stderr, one line each, tagged with the process that wrote it. As a library (`LLM`) it
adds no handler; the application's logging configuration decides.

`GRAPHRT_LOGGING_LEVEL` (as vLLM's `VLLM_LOGGING_LEVEL`) sets the level: WARNING by default, INFO
adds what start-up measured (kernel choices, step costs, thread teams).
"""

from __future__ import annotations

import logging
import os
import sys

LEVEL_VARIABLE = "GRAPHRT_LOGGING_LEVEL"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def configure_logging(tag: str = "graphrt") -> None:
    """Send the `graphrt` loggers' records to stderr as `[tag] message`, once per process."""
    logger = logging.getLogger("graphrt")
    if any(getattr(handler, "graphrt_tag", None) for handler in logger.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[{tag}] %(message)s"))
    handler.graphrt_tag = tag
    logger.addHandler(handler)
    logger.setLevel(logging_level(os.environ.get(LEVEL_VARIABLE)))
    logger.propagate = False  # a root handler set by a library would print each record twice


def logging_level(value: str | None) -> int:
    """`GRAPHRT_LOGGING_LEVEL`'s value as a level; a value that is none of LEVELS says which are."""
    if not value:
        return logging.WARNING
    if value.upper() not in LEVELS:
        raise ValueError(f"{LEVEL_VARIABLE}={value!r} is not a logging level; use one of {', '.join(LEVELS)}")
    return getattr(logging, value.upper())
