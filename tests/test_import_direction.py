"""Imports point one way: the scheduler and the ring both depend on the plain data between them
(`graphrt.step`, `graphrt.sequence`), never on each other, and the scheduler works without torch.

Each module is imported alone in a fresh interpreter, with the `graphrt` package's own
`__init__` (which loads the whole engine) left out, so what it drags in is what it imports.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import graphrt

PACKAGE_DIR = Path(graphrt.__file__).parent

IMPORT_ALONE = """
import importlib, importlib.util, json, sys, types
spec = importlib.util.find_spec("graphrt")
package = types.ModuleType("graphrt")
package.__path__, package.__spec__ = list(spec.submodule_search_locations), spec
sys.modules["graphrt"] = package  # without graphrt/__init__.py, which imports the engine
importlib.import_module(sys.argv[1])
print(json.dumps(sorted(m for m in sys.modules if m.startswith("graphrt.") or m == "torch")))
"""

# module -> the modules it must not load, at run time or for type hints
MUST_NOT_IMPORT = {
    "graphrt.sequence": {"graphrt.ring", "graphrt.scheduler", "graphrt.step", "graphrt.engine"},
    "graphrt.step": {"graphrt.ring", "graphrt.scheduler", "graphrt.engine"},
    "graphrt.scheduler": {"graphrt.ring", "graphrt.engine", "graphrt.remote", "torch"},
    "graphrt.ring": {"graphrt.scheduler", "graphrt.sequence", "graphrt.engine", "graphrt.remote"},
}


def loaded_alone(module: str) -> set[str]:
    result = subprocess.run([sys.executable, "-c", IMPORT_ALONE, module], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"importing {module} alone failed:\n{result.stderr}"
    return set(json.loads(result.stdout))


def named_imports(module: str) -> set[str]:
    """Every module the file names in an import statement, including those under TYPE_CHECKING."""
    tree = ast.parse((PACKAGE_DIR / (module.removeprefix("graphrt.").replace(".", "/") + ".py")).read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("module", sorted(MUST_NOT_IMPORT))
def test_a_module_imported_alone_loads_nothing_upstream_of_it(module):
    loaded = loaded_alone(module)
    assert module in loaded
    wrong = sorted(loaded & MUST_NOT_IMPORT[module])
    assert not wrong, f"importing {module} alone loads {wrong}"


@pytest.mark.parametrize("module", sorted(MUST_NOT_IMPORT))
def test_not_even_a_type_hint_points_upstream(module):
    wrong = sorted(named_imports(module) & MUST_NOT_IMPORT[module])
    assert not wrong, f"{module} imports {wrong} (a cycle, even a type-only one, says an idea belongs in a third module)"


def test_the_scheduler_emits_plain_data():
    loaded = loaded_alone("graphrt.scheduler")
    assert loaded == {"graphrt.scheduler", "graphrt.sequence", "graphrt.step", "graphrt.block_allocator", "graphrt.errors"}


def test_one_place_frees_kv_blocks_and_one_place_grows_an_output():
    """What a newcomer's grep finds: the scheduler frees blocks and appends tokens, nobody else
    (but the front's mirror of what the engine process appended)."""
    frees, appends = [], []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            where = f"{path.relative_to(PACKAGE_DIR)}:{number}"
            if "allocator.free(" in line:
                frees.append(where)
            if "output_ids.append(" in line or "output_ids +=" in line or "output_ids.extend(" in line:
                appends.append(where)
    assert len(frees) == 1 and frees[0].startswith("scheduler.py:"), frees
    # Besides the scheduler, only the server's front copies into its mirror of each sequence the
    # tokens the engine process appended (graphrt/server/engine_process.py).
    assert sorted(where.split(":")[0] for where in appends) == ["scheduler.py", "server/engine_process.py"], appends
