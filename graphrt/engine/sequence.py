"""One request's state as it moves through the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

# Imported for real, not for type checking only: msgspec reads SequenceOutput's field types to
# decode it (graphrt.engine.messages). All are plain data; this module still loads no torch.
from graphrt.engine.drafter import Acceptance
from graphrt.errors import RequestFailure
from graphrt.sampling_params import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    import torch

    from graphrt.engine.grammar import GrammarState


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"
    ERROR = "error"  # a pipeline stage failed while this request was in flight, or its grammar failed to compile


@dataclass(eq=False)  # identity, not field-by-field: sequences are looked up in lists every tick
class Sequence:
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved against the context length at admission
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # of those, tokens taken from the prefix cache rather than computed
    block_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its full blocks so far
    num_registered: int = 0  # leading full blocks offered to the prefix cache
    prefill_len: int = -1  # tokens to prefill: the prompt, or after a preemption every known token
    finish_reason: FinishReason | None = None
    stop_token: int | None = None  # the stop_token_ids id that ended it, not EOS (vLLM's stop_reason)
    num_in_flight: int = 0  # micro-batches in the ring that carry this sequence
    # Tokens being sampled and not read back yet (async scheduling launches the next step before
    # then), and the id of the newest step sampling one; both are the scheduler's to change.
    num_output_placeholders: int = 0
    sampling_step: int = -1
    # Speculative decoding: the drafts of its verify step in flight ([] when none), how long it
    # goes without drafting after verify steps that accepted nothing, and how often its drafts
    # are kept (graphrt.engine.drafter).
    draft_ids: list[int] = field(default_factory=list)
    draft_pause: int = 0
    draft_backoff: int = 0
    draft_acceptance: Acceptance = field(default_factory=Acceptance)
    grammar: GrammarState | None = None  # with a structured output: where its output is in the grammar
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    last_token_time: float | None = None
    # Only for requests that ask (params.logprobs / params.prompt_logprobs): one entry per output
    # token, and one per prompt token, None for the first (nothing comes before it to score it).
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=lambda: [None])

    def __post_init__(self) -> None:
        if self.prefill_len < 0:
            self.prefill_len = len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.prefill_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def outputs_scheduled(self) -> int:
        """Tokens sampled or being sampled: one per decode step launched, one for the prompt."""
        return self.num_computed - self.prompt_len + 1

    @property
    def awaits_token(self) -> bool:
        """The next step's input is the newest token, which has not been read back yet."""
        return self.num_computed >= self.num_tokens

    def token_at(self, position: int) -> int | None:
        """The token at `position`, or None for the newest one while it is still on the device
        (the ring knows where in its token feed it lands)."""
        if position < self.prompt_len:
            return self.prompt_ids[position]
        if position < self.num_tokens:
            return self.output_ids[position - self.prompt_len]
        if self.num_output_placeholders == 0:
            raise RuntimeError(f"request {self.request_id}: token {position} is neither read back nor being sampled")
        return None


@dataclass
class SequenceOutput:
    """What one step added to one request: the engine's one delta per request per step
    (Scheduler.update_from_output), in process and, as itself, on the wire (messages.Outputs). The
    front builds its own state of the request from these (graphrt.frontend.output_processor)."""

    request_id: int
    new_token_ids: list[int]
    finish_reason: FinishReason | None  # EOS or the length; a stop string is the front's to find
    new_logprobs: list[TokenLogprob] | None = None  # one per new token, for a request that asks
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with its first output, for a request that asks
    failure: RequestFailure | None = None  # with FinishReason.ERROR where the engine ended it unrun: why
    stop_token: int | None = None  # the stop_token_ids id that ended it (vLLM's stop_reason); EOS is none
