"""What the front and the engine process say to each other: typed msgspec structs over msgpack
(never pickle), on two ZMQ PUSH/PULL pairs (graphrt.engine.process, graphrt.frontend.engine_client).

`AddJob`, `AbortJob`, `StopChoice`, `ResetPrefixCache`, `Shutdown` go to the engine; `Ready`,
`JobAdmitted`, `JobRejected`, `JobFailed`, `Outputs`, `PrefixCacheReset`, `Fatal` come back.
"""

from __future__ import annotations

from typing import Union

import msgspec

from graphrt.engine.core import EngineSnapshot
from graphrt.engine.sequence import SequenceOutput
from graphrt.sampling_params import SamplingParams


class AddJob(msgspec.Struct, tag=True):
    job: int
    prompt_ids: list[list[int]]
    params: list[SamplingParams]  # one per choice; choice i continues prompt graphrt.engine.core.prompt_of(i, ...)


class AbortJob(msgspec.Struct, tag=True):
    job: int


class StopChoice(msgspec.Struct, tag=True):
    """The front found a stop string in the choice's text."""

    job: int
    choice: int


class Shutdown(msgspec.Struct, tag=True):
    pass


class ResetPrefixCache(msgspec.Struct, tag=True):
    """Forget every cached prefix, if the engine is idle (Engine.reset_prefix_cache)."""


class PrefixCacheReset(msgspec.Struct, tag=True):
    done: bool  # False: requests were running or waiting, and nothing was forgotten


class EngineFacts(msgspec.Struct):
    """What the front needs of the engine: to check prompts, answer /v1/models and print the banner."""

    model_dir: str
    max_model_len: int
    capacity_tokens: int  # what the whole KV cache holds for one sequence
    banner: list[str]


class Ready(msgspec.Struct, tag=True):
    facts: EngineFacts


class JobAdmitted(msgspec.Struct, tag=True):
    job: int
    prompt_tokens: int


class JobRejected(msgspec.Struct, tag=True):
    job: int
    message: str
    code: str | None = None


class JobFailed(msgspec.Struct, tag=True):
    job: int
    status: int
    message: str


class Outputs(msgspec.Struct, tag=True):
    """One step's deltas, each addressed as (job, choice); its request id is the engine's."""

    outputs: list[tuple[int, int, SequenceOutput]]
    snapshot: EngineSnapshot


class Fatal(msgspec.Struct, tag=True):
    """The engine cannot go on (a stage process died, a bug); the process exits after sending it."""

    message: str


ToEngine = Union[AddJob, AbortJob, StopChoice, ResetPrefixCache, Shutdown]
ToFront = Union[Ready, JobAdmitted, JobRejected, JobFailed, Outputs, PrefixCacheReset, Fatal]
