"""Imports point one way, down the layers of the design:

    server -> frontend (and the LLM face) -> engine -> distributed -> runtime -> capture -> config -> model -> kernels, profiling

so a module may import its own layer's and the layers below, never one above, and no two modules
import each other, even for a type hint. Within that, the scheduler and the ring both depend on the
plain data between them (`graphrt.runtime.step`), never on each other, and the scheduler works
without torch.

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
    "graphrt.engine.sequence": {"graphrt.runtime.ring", "graphrt.engine.scheduler", "graphrt.runtime.step", "graphrt.engine.engine"},
    "graphrt.runtime.step": {"graphrt.runtime.ring", "graphrt.engine.scheduler", "graphrt.engine.engine"},
    "graphrt.engine.scheduler": {"graphrt.runtime.ring", "graphrt.engine.engine", "graphrt.distributed.remote", "torch"},
    "graphrt.engine.speculation": {"graphrt.engine.scheduler", "graphrt.runtime.ring", "graphrt.engine.engine", "torch"},
    "graphrt.runtime.ring": {"graphrt.engine.scheduler", "graphrt.engine.sequence", "graphrt.engine.engine", "graphrt.distributed.remote"},
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
    loaded = loaded_alone("graphrt.engine.scheduler")
    assert loaded == {
        "graphrt.engine.scheduler", "graphrt.engine.sequence", "graphrt.runtime.step", "graphrt.engine.block_allocator",
        "graphrt.engine.stats", "graphrt.engine.speculation", "graphrt.engine.drafter",  # speculative decoding
        "graphrt.errors", "graphrt.sampling_params",  # plain data: the wire decodes a SequenceOutput's logprobs
        "graphrt.engine", "graphrt.runtime", "graphrt.model",  # the packages: docstrings only
    }


def test_one_place_frees_kv_blocks_and_one_place_grows_an_output():
    """What a newcomer's grep finds: the scheduler frees blocks and appends tokens, nobody else
    (but the draft model's own cache, and the front's own state of each request, built from the
    engine's deltas)."""
    frees, appends = [], []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            where = f"{path.relative_to(PACKAGE_DIR)}:{number}"
            if "allocator.free(" in line:
                frees.append(where)
            if "output_ids.append(" in line or "output_ids +=" in line or "output_ids.extend(" in line:
                appends.append(where)
    # The draft model's cache is its own, with its own allocator (graphrt.engine.draft_model).
    assert sorted(where.split(":")[0] for where in frees) == ["engine/draft_model.py", "engine/scheduler.py"], frees
    # Besides the scheduler, only the front's state of each request grows, from the engine's deltas
    # (graphrt/frontend/output_processor.py).
    assert sorted(where.split(":")[0] for where in appends) == ["engine/scheduler.py", "frontend/output_processor.py"], appends


# Each layer, lowest first: a module imports its own layer and those below. The package
# `graphrt` itself (its __init__) and the CLI sit on top.
LAYERS = [
    ("graphrt.errors", "graphrt.logs", "graphrt.signals"),
    ("graphrt.kernels", "graphrt.profiling", "graphrt.sampling_params", "graphrt.speculative"),
    ("graphrt.model",),
    ("graphrt.config",),
    ("graphrt.capture",),
    ("graphrt.runtime",),
    ("graphrt.distributed",),
    ("graphrt.engine",),
    ("graphrt.frontend", "graphrt.llm"),
    ("graphrt.server",),
    ("graphrt.tools", "graphrt.cli", "graphrt.__main__", "graphrt"),
]
SOURCE_ROOTS = {  # the package-dir of pyproject.toml
    "graphrt": PACKAGE_DIR,
    "graphrt.kernels": PACKAGE_DIR.parent / "kernels",
    "graphrt.capture": PACKAGE_DIR.parent / "capture",
    "graphrt.profiling": PACKAGE_DIR.parent / "profiling",
}


def all_modules() -> dict[str, Path]:
    """Every module of graphrt, by dotted name, with its file."""
    modules = {}
    for package, folder in SOURCE_ROOTS.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([package, *parts])
            if package == "graphrt" and any(name.startswith(other + ".") or name == other for other in SOURCE_ROOTS if other != "graphrt"):
                continue
            modules[name] = path
    return modules


MODULES = all_modules()


def imports_of(module: str) -> set[str]:
    """The graphrt modules `module` names in any import: at the top, in a function, or under
    TYPE_CHECKING. `from package import name` counts as the submodule where `name` is one."""
    tree = ast.parse(MODULES[module].read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in MODULES else node.module)
    return {name for name in found if name in MODULES and name != module}


def layer_of(module: str) -> int:
    best = None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (index, len(prefix))
    assert best is not None, f"{module} is in no layer of LAYERS: place it"
    return best[0]


def test_every_module_is_in_a_layer():
    assert len(MODULES) > 60
    for module in MODULES:
        layer_of(module)


def test_no_module_imports_a_layer_above_its_own():
    upward = [
        f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})"
        for module in sorted(MODULES)
        for target in sorted(imports_of(module))
        if layer_of(target) > layer_of(module)
    ]
    assert not upward, "imports pointing up the layers:\n" + "\n".join(upward)


def test_no_import_cycle_even_for_type_hints():
    graph = {module: imports_of(module) for module in MODULES}
    cycles, state = [], {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_checkout_on_sys_path_does_not_hide_an_installed_kernels_package():
    """`python -m ...` in the repository root puts the checkout first on sys.path, where the folder
    kernels/ (graphrt.kernels) is also a top-level `kernels`. transformers imports Hugging Face's
    `kernels` package when it is installed (transformers 5.x depends on it), so that name must still
    reach the installed package, or every transformers model class fails to import."""
    checkout = PACKAGE_DIR.parent
    probe = (
        "import importlib.metadata, json, transformers\n"
        "transformers.LlamaConfig  # imports transformers' hub kernels integration\n"
        "try:\n"
        "    import kernels\n"
        "    found = kernels.__file__\n"
        "except ModuleNotFoundError:\n"
        "    found = None\n"
        "try:\n"
        "    installed = importlib.metadata.version('kernels')\n"
        "except importlib.metadata.PackageNotFoundError:\n"
        "    installed = None\n"
        "print(json.dumps([found, installed]))\n"
    )
    run = subprocess.run([sys.executable, "-c", probe], cwd=checkout, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    found, installed = json.loads(run.stdout.strip().splitlines()[-1])
    if installed is None:
        assert found is None, f"`import kernels` found {found}, graphrt's folder under another name"
    else:
        assert found is not None and Path(found).parent.resolve() != (checkout / "kernels").resolve(), found
