"""graphrt's log records as a program (or an LLM, when GRAPHRT_LOGGING_LEVEL asks) prints them: one
line each on stderr, tagged with the process, at the level GRAPHRT_LOGGING_LEVEL names; a level
that is not one says which are."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

LOG_TWO = """
import logging
from graphrt.logs import configure_logging
configure_logging("graphrt engine")
configure_logging("graphrt engine")  # a second call adds no second handler
logging.basicConfig(format="root: %(message)s")  # nor does a later basicConfig
logging.getLogger("graphrt.engine.engine").warning("a warning")
logging.getLogger("graphrt.kernels.cpu.openmp").info("a measurement")
"""
# An application that configured logging first keeps its format: graphrt adds no handler.
CONFIGURED_FIRST = """
import logging
from graphrt.logs import configure_logging
logging.basicConfig(format="app: %(message)s")
configure_logging()
logging.getLogger("graphrt.engine.engine").warning("a warning")
"""


@pytest.mark.parametrize("level, lines", [
    (None, ["[graphrt engine] a warning"]),
    ("info", ["[graphrt engine] a warning", "[graphrt engine] a measurement"]),
    ("ERROR", []),
])
def test_records_go_to_stderr_tagged_at_the_level_asked(level, lines):
    env = {k: v for k, v in os.environ.items() if k != "GRAPHRT_LOGGING_LEVEL"}
    if level is not None:
        env["GRAPHRT_LOGGING_LEVEL"] = level
    result = subprocess.run([sys.executable, "-c", LOG_TWO], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == lines


def test_the_cli_names_a_level_that_is_not_one():
    env = {**os.environ, "GRAPHRT_LOGGING_LEVEL": "loud"}
    result = subprocess.run([sys.executable, "-m", "graphrt", "capture", "--inspect", "/nonexistent"], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip() == "error: GRAPHRT_LOGGING_LEVEL='loud' is not a logging level; use one of DEBUG, INFO, WARNING, ERROR"


def test_an_application_that_configured_logging_first_keeps_its_format():
    result = subprocess.run([sys.executable, "-c", CONFIGURED_FIRST], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == ["app: a warning"]


# The Python API as a library: graphrt's records reach stderr only when GRAPHRT_LOGGING_LEVEL asks.
LLM_START = """
import sys
from graphrt import LLM
LLM(sys.argv[1], dtype="float32", load_tokenizer=False, kernels="torch", use_graphs=False,
    speculative_config={"method": "ngram", "num_speculative_tokens": 2})
"""


@pytest.mark.parametrize("level", [None, "INFO"])
def test_the_python_api_logs_at_the_level_asked(level, tiny_model_factory):
    env = {k: v for k, v in os.environ.items() if k != "GRAPHRT_LOGGING_LEVEL"}
    if level is not None:
        env["GRAPHRT_LOGGING_LEVEL"] = level
    result = subprocess.run([sys.executable, "-c", LLM_START, str(tiny_model_factory())], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    measured = [line for line in result.stderr.splitlines() if line.startswith("[graphrt] speculative decoding: decode step ms by bucket")]
    assert len(measured) == (1 if level else 0), result.stderr


def test_the_python_api_leaves_the_root_logger_to_the_application(tiny_model_factory):
    """With GRAPHRT_LOGGING_LEVEL set, LLM() prints graphrt's records, and an application that
    configures logging afterwards still can."""
    script = LLM_START + """
import logging
logging.basicConfig(format="app: %(message)s")
logging.getLogger("app").warning("configured")
"""
    env = {**os.environ, "GRAPHRT_LOGGING_LEVEL": "INFO"}
    result = subprocess.run([sys.executable, "-c", script, str(tiny_model_factory())], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "app: configured" in result.stderr.splitlines() and "[graphrt] speculative decoding" in result.stderr
