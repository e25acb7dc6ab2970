"""Errors meant for people: each says what happened and what to do about it.

The CLI prints a `GraphrtError` as one line without a traceback; the server (later) turns a
`RequestError` into a 4xx. Anything else escaping is a bug in graphrt.
"""

from dataclasses import dataclass


class GraphrtError(Exception):
    """A problem the user can fix: a bad flag, a missing file, a stale cache."""


class ModelLoadError(GraphrtError):
    """The model folder is missing, incomplete, corrupt or of an unsupported architecture."""


class RequestError(GraphrtError):
    """One request can't be served (too long, can never fit the KV cache, bad parameters).

    Only that request fails; the engine keeps serving the others.
    """

    code: str | None = None  # the server's error code for it (OpenAI's `error.code`)


class ContextLengthError(RequestError):
    """A request longer than the model's context. Its message begins as OpenAI's and vLLM's do
    ("This model's maximum context length is N tokens"), and the server answers it with their code,
    `context_length_exceeded`: agent frameworks (LangChain, LiteLLM, pydantic-ai) recognise an
    overflow by one or the other, and only then trim the conversation or fall back to a longer model."""

    code = "context_length_exceeded"


class StageError(GraphrtError):
    """A pipeline stage failed while running micro-batches; the requests they carried are ended."""


@dataclass(frozen=True)
class RequestFailure:
    """Why the engine ended one request with an error (FinishReason.ERROR) before running it, in
    words for its client: plain data, so it crosses from the scheduler to the server."""

    message: str
    request_fault: bool  # what the request asked cannot be done (its grammar does not compile), not the server failing

