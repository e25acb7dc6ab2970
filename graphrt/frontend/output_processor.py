"""Token ids to what a client sees: detokenizing, stop strings, and the text that is safe to stream.

The engine emits token ids; `LLM.generate` and the server both hand every step's updated
sequences to an `OutputProcessor`, the one place text is made. A stop string cuts the text where
it starts and ends the sequence in the engine (within the same step, so no further token of it is
scheduled). While a request runs, the last characters that could still become the start of a stop
string, or a multi-byte character cut in half, are not yet safe to stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from graphrt.engine.sequence import FinishReason, Sequence

if TYPE_CHECKING:
    from graphrt.engine.engine import Engine
    from graphrt.frontend.tokenizer import Tokenizer

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


class OutputProcessor:
    def __init__(self, engine: Engine, tokenizer: Tokenizer | None):
        self.engine = engine
        self.tokenizer = tokenizer
        self._texts: dict[int, RequestText] = {}  # request id -> text, while the request runs

    def process(self, seqs: list[Sequence]) -> list[tuple[Sequence, RequestText]]:
        """Extend the text of every sequence that got a token in this step (ending it at a stop
        string); a finished one's text is handed out for the last time."""
        out = []
        for seq in seqs:
            text = self._texts.get(seq.request_id)
            if text is None:
                text = self._texts[seq.request_id] = RequestText(list(seq.params.stop))
            if self.tokenizer is not None:
                self._extend(seq, text)
            text.finished = seq.finished
            if seq.finished:
                del self._texts[seq.request_id]
            out.append((seq, text))
        return out

    def forget(self, seq: Sequence) -> None:
        """Drop the text of a request nobody waits for any more (aborted)."""
        self._texts.pop(seq.request_id, None)

    def _extend(self, seq: Sequence, text: RequestText) -> None:
        """Append the new token's text (decoding a few tokens, not the whole output: this runs for
        every token) and end the sequence at a stop string."""
        old_len = len(text.text)
        delta, text.prefix_offset, text.read_offset = self.tokenizer.decode_next(
            seq.output_ids, text.prefix_offset, text.read_offset, final=seq.finished
        )
        text.text += delta
        for stop in text.stops:
            # Only a stop string that ends in the new text can be new.
            cut = text.text.find(stop, max(0, old_len - len(stop) + 1))
            if cut != -1:
                text.text = text.text[:cut]
                self.engine.finish(seq, FinishReason.STOP)
