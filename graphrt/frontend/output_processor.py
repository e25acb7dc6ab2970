"""Token ids to what a client sees: detokenizing, stop strings, and the text that is safe to stream.

The engine emits one `SequenceOutput` per request per step (its new tokens, and how it ended if it
did); `LLM.generate` and both servers' fronts hand them to an `OutputProcessor`, which keeps each
request's own state (`RequestState`: its tokens, logprobs and text) and is the one place text is
made. A stop string cuts the text where it starts and ends the request here; `process` returns
the requests it ended so, for the caller to end in the engine within the same step, so no further
token of theirs is scheduled. While a request runs, the last characters that could still become
the start of a stop string, or a multi-byte character cut in half, are not yet safe to stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from graphrt.engine.sequence import FinishReason, SequenceOutput

if TYPE_CHECKING:
    from graphrt.frontend.tokenizer import Tokenizer
    from graphrt.sampling_params import SamplingParams, TokenLogprob

REPLACEMENT_CHAR = "\ufffd"  # what a decode ending inside a multi-byte character ends with


@dataclass
class RequestText:
    """One request's text so far (already cut at a stop string)."""

    stops: list[str]
    text: str = ""
    prefix_offset: int = 0  # incremental detokenization: tokens before this are settled text
    read_offset: int = 0
    finished: bool = False

    @property
    def num_streamable(self) -> int:
        """Characters of `text` that no later token can change: all of them once finished."""
        if self.finished:
            return len(self.text)
        # Text that could be the first characters of a stop string waits for the next token.
        holdback = max((len(s) for s in self.stops), default=1) - 1
        return len(self.text[: len(self.text) - holdback].rstrip(REPLACEMENT_CHAR))


@dataclass
class RequestState:
    """What the front knows of one request, from the engine's deltas: it never reads the engine's
    own sequence. `logprobs` and `prompt_logprobs` only for a request that asks."""

    request_id: int
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None  # a FinishReason's value
    stop_reason: str | int | None = None  # the stop string or stop_token_ids id that ended it (vLLM's); None for EOS or a limit
    text: RequestText = field(init=False)

    def __post_init__(self) -> None:
        self.text = RequestText(list(self.params.stop))
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class OutputProcessor:
    """The front's state of every request it follows (`add`), advanced by the engine's deltas
    (`process`); without a tokenizer (a model that takes token ids) the text stays empty."""

    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self._requests: dict[int, RequestState] = {}  # request id -> its state, while it runs

    def add(self, request_id: int, params: SamplingParams) -> RequestState:
        """Start following a request the engine admitted."""
        state = self._requests[request_id] = RequestState(request_id, params)
        return state

    def process(self, outputs: list[SequenceOutput]) -> tuple[list[RequestState], list[int]]:
        """Apply one step's deltas: each request's new tokens, logprobs and text (cut at a stop
        string). Returns the states that changed (a finished one for the last time) and the ids of
        the requests a stop string ended here, which the caller ends in the engine."""
        changed, stopped = [], []
        for output in outputs:
            state = self._requests.get(output.request_id)
            if state is None:
                continue  # forgotten (aborted), or ended here (a stop string) with tokens still on the way
            state.output_ids += output.new_token_ids
            if state.logprobs is not None and output.new_logprobs is not None:
                state.logprobs += output.new_logprobs
            if output.prompt_logprobs is not None:
                state.prompt_logprobs = output.prompt_logprobs
            if output.finish_reason is not None:
                state.finish_reason, state.stop_reason = output.finish_reason.value, output.stop_token
            if self.tokenizer is not None and (stop := self._extend(state)) is not None:
                state.finish_reason, state.stop_reason = FinishReason.STOP.value, stop
                stopped.append(state.request_id)
            state.text.finished = state.finished
            if state.finished:
                del self._requests[state.request_id]
            changed.append(state)
        return changed, stopped

    def forget(self, request_id: int) -> None:
        """Drop the state of a request nobody waits for any more (aborted)."""
        self._requests.pop(request_id, None)

    def _extend(self, state: RequestState) -> str | None:
        """Append the new tokens' text (decoding a few tokens, not the whole output: this runs for
        every token); the stop string that ended it, if one did, the text cut where it starts."""
        text, token_ids, params = state.text, state.output_ids, state.params
        if state.finish_reason == FinishReason.STOP.value and token_ids and not params.include_stop_str_in_output:
            # The engine ends a request "stop" only on a stop token (EOS or one of stop_token_ids; a
            # stop string is found here, after this): as vLLM, that token is not part of the text,
            # even where special tokens are kept, unless the stop is asked for in the text.
            token_ids = token_ids[:-1]
        old_len = len(text.text)
        delta, text.prefix_offset, text.read_offset = self.tokenizer.decode_next(
            token_ids, text.prefix_offset, text.read_offset, final=state.finished, skip_special_tokens=params.skip_special_tokens
        )
        text.text += delta
        if len(state.output_ids) <= params.min_tokens:
            return None  # as vLLM: stop strings count once more than min_tokens tokens are out
        # Only a stop string that ends in the new text can be new; the one that starts first wins.
        found = [(at, stop) for stop in text.stops if (at := text.text.find(stop, max(0, old_len - len(stop) + 1))) != -1]
        if not found:
            return None
        at, stop = min(found, key=lambda hit: hit[0])
        text.text = text.text[: at + len(stop) if params.include_stop_str_in_output else at]
        return stop
