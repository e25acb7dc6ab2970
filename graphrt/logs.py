"""Where log records go when graphrt runs as a program (the CLI, the engine process, a stage
process): stderr, one line each, tagged with the process that wrote it. As a library (`LLM`) it
adds no handler unless GRAPHRT_LOGGING_LEVEL asks for graphrt's records; otherwise the
application's logging configuration decides.

`GRAPHRT_LOGGING_LEVEL` (as vLLM's `VLLM_LOGGING_LEVEL`) sets graphrt's level: WARNING by default,
INFO adds what start-up measured (step costs, thread teams, the KV cache on GPUs).
"""

from __future__ import annotations

import logging
import os
import sys

LEVEL_VARIABLE = "GRAPHRT_LOGGING_LEVEL"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a record comes (as logging's last resort does), so a
    caller that swaps it (a test's capture) never leaves the handler writing to a closed stream."""

    def __init__(self, tag: str):
        super().__init__()
        self.setFormatter(logging.Formatter(f"[{tag}] %(message)s"))

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass  # always sys.stderr


def configure_logging(tag: str = "graphrt") -> None:
    """Records to stderr as `[tag] message` where nothing else configured logging in this process
    (a root handler of its own, once), and the `graphrt` loggers at GRAPHRT_LOGGING_LEVEL."""
    level = logging_level(os.environ.get(LEVEL_VARIABLE))
    root = logging.getLogger()
    if not root.handlers:
        root.addHandler(StderrHandler(tag))
    logging.getLogger("graphrt").setLevel(level)


def configure_library_logging() -> None:
    """For `LLM`: nothing, unless GRAPHRT_LOGGING_LEVEL is set; then the `graphrt` loggers at that
    level and, where the application configured no logging, a stderr handler of graphrt's own on
    them alone (not on the root logger, which stays the application's to configure)."""
    if not os.environ.get(LEVEL_VARIABLE):
        return
    graphrt = logging.getLogger("graphrt")
    graphrt.setLevel(logging_level(os.environ[LEVEL_VARIABLE]))
    if not logging.getLogger().handlers and not any(isinstance(h, StderrHandler) for h in graphrt.handlers):
        graphrt.addHandler(StderrHandler("graphrt"))
        graphrt.propagate = False  # nor printed twice once the application configures the root


def logging_level(value: str | None) -> int:
    """`GRAPHRT_LOGGING_LEVEL`'s value as a level; a value that is none of LEVELS says which are."""
    if not value:
        return logging.WARNING
    if value.upper() not in LEVELS:
        raise ValueError(f"{LEVEL_VARIABLE}={value!r} is not a logging level; use one of {', '.join(LEVELS)}")
    return getattr(logging, value.upper())
