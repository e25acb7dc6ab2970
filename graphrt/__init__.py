"""graphrt: pipeline-parallel LLM serving on CUDA graphs."""

from graphrt.errors import GraphrtError, ModelLoadError, RequestError

__all__ = ["LLM", "GraphrtError", "ModelLoadError", "RequestError", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"

# LLM and SamplingParams load on first use, so `import graphrt` (and the CLI with it) costs no
# torch import.
_LAZY = {"LLM": "graphrt.llm", "RequestOutput": "graphrt.llm", "SamplingParams": "graphrt.sampling_params"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'graphrt' has no attribute {name!r}")
