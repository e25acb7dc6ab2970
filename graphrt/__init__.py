"""graphrt: pipeline-parallel LLM serving on CUDA graphs."""

from graphrt.errors import GraphrtError, ModelLoadError, RequestError
from graphrt.llm import LLM, RequestOutput
from graphrt.sampling import SamplingParams

__all__ = ["LLM", "GraphrtError", "ModelLoadError", "RequestError", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
