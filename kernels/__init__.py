"""Kernels for the decode hot path, each beside its plain torch reference.

The torch references define the semantics and run on the CPU; Triton versions with the same
signatures run on CUDA. A stage calls them through the `KernelSet` chosen by `--kernels`: the torch
references (torch_ops.py), the Triton kernels (triton_ops.py), and on a CPU what the CPU wing
chooses (cpu/). Importing this package loads no torch, so the CLI and the CPU placement can.
"""

from __future__ import annotations

if __name__ == "kernels":
    # This folder is graphrt.kernels. Python reaches it as a top-level `kernels` only when the
    # checkout is on sys.path (`python -m ...` in the repository root), where it would hide Hugging
    # Face's `kernels` package, which transformers imports. Give that import the installed package.
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _checkout = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    _path = [entry for entry in sys.path if os.path.realpath(entry or os.curdir) != _checkout]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _path)
    # None, or this folder again under a spelling realpath does not undo: there is no other `kernels`.
    if _spec is None or os.path.realpath(_spec.origin or "") == os.path.realpath(__file__):
        raise ModuleNotFoundError("No module named 'kernels'", name="kernels")
    sys.modules["kernels"] = _installed = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_installed)
else:
    from graphrt.kernels.kernel_set import KernelSet

KERNEL_CHOICES = ("auto", "torch", "triton")


def kernel_set(name: str, device_type: str) -> KernelSet:
    """`auto` is triton on CUDA and torch elsewhere. `triton` off a GPU runs only through Triton's
    interpreter (TRITON_INTERPRET=1: the tests' way to run the Triton kernels without one); otherwise
    it is refused, since a CPU stage would run the CPU wing's kernels and none of Triton's."""
    if name not in KERNEL_CHOICES:
        raise ValueError(f"kernels {name!r} is not one of {', '.join(KERNEL_CHOICES)}")
    if name == "auto":
        name = "triton" if device_type == "cuda" else "torch"
    if name == "torch":
        from graphrt.kernels.torch_ops import TORCH

        return TORCH
    if device_type != "cuda" and not triton_interpreter_on():
        raise ValueError(
            f"--kernels triton runs graphrt's Triton kernels on CUDA GPUs, and this stage is on the {device_type}; "
            "leave --kernels auto there (a CPU stage times its own kernels and runs the fastest, docs/cpu.md), "
            "or set TRITON_INTERPRET=1 to run the Triton kernels through Triton's interpreter (slowly, as the tests do)"
        )
    from graphrt.kernels import triton_ops  # imports triton, which a CPU-only install may lack

    return triton_ops.TRITON


def triton_interpreter_on() -> bool:
    """Whether TRITON_INTERPRET asks for Triton's interpreter (read as triton reads a flag)."""
    import os

    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")


__all__ = ["KERNEL_CHOICES", "KernelSet", "kernel_set"]
