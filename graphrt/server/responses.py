"""The JSON the OpenAI API answers with: whole responses, stream chunks and usage, per endpoint.

A chat request that lets the model call tools (graphrt.server.tool_choice) has its output read
for calls: whole, or, streamed, as each delta arrives (graphrt.server.tool_parsers).

Logprobs, where a request asks for them, show each token as the text it decodes to alone (OpenAI's
`tokens`), next to its log-probability and its most likely alternatives. With `echo`, a completion's
text and logprobs begin with the prompt's (its first token has no logprob: nothing precedes it).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from graphrt.frontend.async_engine import ChoiceUpdate, GenerationJob
from graphrt.sampling_params import TokenLogprob
from graphrt.server.tool_choice import ToolCalling
from graphrt.server.tool_parsers import ToolCallStream, begun_tool_calls, new_call_id, parse_tool_calls

# A token and its logprob entry (None for a prompt's first token), as a choice reports them.
Scored = tuple[int, TokenLogprob | None]


@dataclass
class ChoiceState:
    """One choice as its tokens arrive, and how much of its text and logprobs a stream has sent."""

    text: str = ""
    num_streamable: int = 0  # characters of `text` that can no longer change (see OutputProcessor)
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended it
    first_at: float | None = None
    last_at: float | None = None
    num_sent: int = 0  # characters of `text` already streamed
    # echo: the prompt's text and tokens, sent ahead of the first generated text
    echo_text: str = ""
    echo_ids: list[int] | None = None
    scored: list[Scored] = field(default_factory=list)  # logprobs received and not yet sent
    prompt_logprobs: list[TokenLogprob | None] | None = None  # the prompt's, with the first token (vLLM's prompt_logprobs)
    text_offset: int = 0  # where the next scored token's text begins in the choice's text
    _num_scored: int = 0  # output tokens whose logprobs are in `scored` or sent
    _output_ids: list[int] = field(default_factory=list)  # the engine side's growing list: read its first num_tokens
    _num_ids_sent: int = 0

    def apply(self, update: ChoiceUpdate) -> None:
        self.text, self.num_tokens, self.finish_reason = update.text, update.num_tokens, update.finish_reason
        self.stop_reason = update.stop_reason
        self.num_streamable = update.num_streamable
        if self.first_at is None:
            self.first_at = update.at
            self.prompt_logprobs = update.prompt_logprobs
            if update.prompt_logprobs is not None and self.echo_ids is not None:
                self.scored += zip(self.echo_ids, update.prompt_logprobs)
        self.last_at = update.at
        if update.token_ids is not None:
            self._output_ids = update.token_ids
        if update.logprobs is not None:
            fresh = update.logprobs[self._num_scored : update.num_tokens]
            self.scored += ((entry.token_id, entry) for entry in fresh)
            self._num_scored = update.num_tokens

    @property
    def token_ids(self) -> list[int]:
        return self._output_ids[: self.num_tokens]

    def take_token_ids(self) -> list[int]:
        """The output ids a stream has not sent yet."""
        taken = self._output_ids[self._num_ids_sent : self.num_tokens]
        self._num_ids_sent = self.num_tokens
        return taken

    def take_scored(self) -> list[Scored]:
        taken, self.scored = self.scored, []
        return taken

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def take_delta(self) -> str:
        """The text a stream may send now: what can no longer change (all of it once finished),
        after the echoed prompt the first time."""
        echo, self.echo_text = self.echo_text, ""
        end = len(self.text) if self.finished else self.num_streamable
        if end <= self.num_sent:
            return echo
        delta, self.num_sent = self.text[self.num_sent : end], end
        return echo + delta


def usage(prompt_tokens: int, choices: list[ChoiceState]) -> dict:
    """Each prompt counts once (`prompt_tokens` is their sum); completion tokens are summed over the choices."""
    completion_tokens = sum(c.num_tokens for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


class TokenNames:
    """Each token id as the text it decodes to alone, remembered (a logprobs response names every
    token and its alternatives); `token_id:N` for a model without a tokenizer, as vLLM writes it."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._names: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        name = self._names.get(token_id)
        if name is None:
            name = self.tokenizer.decode_token(token_id) if self.tokenizer is not None else f"token_id:{token_id}"
            self._names[token_id] = name
        return name


class ResponseFormat:
    """What differs between /v1/completions and /v1/chat/completions is only the JSON's shape.

    `num_top` is the alternatives each token's logprobs list (None: the request asked for no
    logprobs), `names` how tokens are spelled there.
    """

    id_prefix = ""
    response_object = ""
    chunk_object = ""

    def __init__(
        self, model_id: str, num_top: int | None = None, names: TokenNames | None = None, token_ids: bool = False,
        num_prompt_top: int | None = None,
    ):
        """`token_ids`: vLLM's return_token_ids, the prompt's and each choice's token ids beside the text.
        `num_prompt_top`: vLLM's prompt_logprobs, the alternatives each prompt token lists (None: no prompt logprobs)."""
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model_id = model_id
        self.num_top, self.names = num_top, names
        self.token_ids = token_ids
        self.num_prompt_top = num_prompt_top
        self.prompt_ids: list[list[int]] = []  # each choice's prompt, once admitted (with token_ids)

    @property
    def with_logprobs(self) -> bool:
        return self.num_top is not None

    def _envelope(self, object_name: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model_id, "choices": choices}

    def response(self, prompt_tokens: int, choices: list[ChoiceState]) -> dict:
        body = self._envelope(self.response_object, [self.final_choice(i, c) for i, c in enumerate(choices)])
        body["usage"] = usage(prompt_tokens, choices)
        return body

    def chunk(self, choices: list[dict], include_usage: bool, usage_body: dict | None = None) -> dict:
        body = self._envelope(self.chunk_object, choices)
        if include_usage:
            body["usage"] = usage_body  # null on every chunk but the last, as OpenAI does
        return body

    def start(self, job: GenerationJob, choices: list[ChoiceState]) -> None:
        """Once the job is admitted (its prompts are token ids by then)."""
        if self.token_ids:
            self.prompt_ids = [job.prompt_ids[job.prompt_index(index)] for index in range(len(choices))]

    def opening_choice(self, index: int) -> dict | None:
        return None

    def final_choice(self, index: int, choice: ChoiceState) -> dict:
        raise NotImplementedError

    def delta_choice(self, index: int, choice: ChoiceState, text: str) -> dict:
        """A stream chunk's choice: `text` and the logprobs received since the last chunk."""
        raise NotImplementedError

    def delta_choices(self, index: int, choice: ChoiceState, text: str) -> list[dict]:
        """The chunks' choices to send after an update of `choice` that made `text` streamable."""
        return [self.delta_choice(index, choice, text)] if text or choice.finished or choice.scored else []

    def logprobs(self, choice: ChoiceState) -> dict | None:
        return self.logprobs_body(choice, choice.take_scored()) if self.with_logprobs else None

    def logprobs_body(self, choice: ChoiceState, scored: list[Scored]) -> dict:
        raise NotImplementedError

    def prompt_logprobs_body(self, choice: ChoiceState) -> list[dict | None]:
        """vLLM's prompt_logprobs: null for the first prompt token (nothing precedes it), then per
        token an object keyed by token id (as a string): the token itself first, with its logprob,
        rank and text, then its `num_prompt_top` most likely alternatives, ranked 1, 2, ..."""
        def entry(token_id: int, logprob: float, rank: int | None) -> tuple[str, dict]:
            return str(token_id), {"logprob": logprob, "rank": rank, "decoded_token": self.names(token_id)}

        body: list[dict | None] = [None]
        for scored in (choice.prompt_logprobs or [None])[1:]:
            token = dict([entry(scored.token_id, scored.logprob, scored.rank)])
            for rank, (alt, logprob) in enumerate(scored.top[: self.num_prompt_top], start=1):
                token.setdefault(*entry(alt, logprob, rank))
            body.append(token)
        return body


class CompletionFormat(ResponseFormat):
    id_prefix = "cmpl"
    response_object = chunk_object = "text_completion"

    def __init__(
        self, model_id: str, num_top: int | None = None, names: TokenNames | None = None, echo: bool = False, token_ids: bool = False,
        num_prompt_top: int | None = None,
    ):
        super().__init__(model_id, num_top, names, token_ids, num_prompt_top)
        self.echo = echo
        self._prompt_ids_sent: set[int] = set()  # choices whose stream sent their prompt's ids (with its first chunk)

    def start(self, job: GenerationJob, choices: list[ChoiceState]) -> None:
        """Once admitted: with echo, each choice's text (and logprobs) begins with its prompt."""
        super().start(job, choices)
        if not self.echo:
            return
        for index, choice in enumerate(choices):
            prompt = job.prompts[job.prompt_index(index)]
            prompt_ids = job.prompt_ids[job.prompt_index(index)]
            choice.echo_text = prompt if isinstance(prompt, str) else self._decode(prompt_ids)
            choice.echo_ids = prompt_ids if self.with_logprobs else None

    def _decode(self, token_ids: list[int]) -> str:
        tokenizer = self.names.tokenizer if self.names is not None else None
        return tokenizer.decode(token_ids) if tokenizer is not None else ""

    def final_choice(self, index: int, choice: ChoiceState) -> dict:
        text = choice.echo_text + choice.text
        body = {"index": index, "text": text, "logprobs": self.logprobs(choice), "finish_reason": choice.finish_reason,
                "stop_reason": choice.stop_reason}
        if self.token_ids:
            body.update(token_ids=choice.token_ids, prompt_token_ids=self.prompt_ids[index])
        if self.num_prompt_top is not None:
            body["prompt_logprobs"] = self.prompt_logprobs_body(choice)
        return body

    def delta_choice(self, index: int, choice: ChoiceState, text: str) -> dict:
        """With token_ids, each chunk's ids are the tokens since the last; the first also has the prompt's."""
        body = {"index": index, "text": text, "logprobs": self.logprobs(choice), "finish_reason": choice.finish_reason}
        if choice.finished:
            body["stop_reason"] = choice.stop_reason
        if self.token_ids:
            body["token_ids"] = choice.take_token_ids()
            if index not in self._prompt_ids_sent:
                body["prompt_token_ids"] = self.prompt_ids[index]
                self._prompt_ids_sent.add(index)
        return body

    def logprobs_body(self, choice: ChoiceState, scored: list[Scored]) -> dict:
        """The legacy shape: parallel lists; each top_logprobs dict holds the token itself too."""
        tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
        for token_id, entry in scored:
            name = self.names(token_id)
            tokens.append(name)
            text_offset.append(choice.text_offset)
            choice.text_offset += len(name)
            if entry is None:
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(entry.logprob)
            top = {self.names(alt): logprob for alt, logprob in entry.top[: self.num_top]}  # prompt_logprobs may ask more
            top.setdefault(name, entry.logprob)
            top_logprobs.append(top)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": text_offset}


class ChatFormat(ResponseFormat):
    id_prefix = "chatcmpl"
    response_object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(
        self, model_id: str, num_top: int | None = None, names: TokenNames | None = None, tool_calling: ToolCalling | None = None,
        token_ids: bool = False, num_prompt_top: int | None = None,
    ):
        super().__init__(model_id, num_top, names, token_ids, num_prompt_top)
        self.tool_calling = tool_calling
        self._streams: dict[int, ToolCallStream] = {}  # each streamed choice's tool calls
        self._prompt_ids_sent = False

    def response(self, prompt_tokens: int, choices: list[ChoiceState]) -> dict:
        body = super().response(prompt_tokens, choices)
        if self.token_ids:
            body["prompt_token_ids"] = self.prompt_ids[0]  # one conversation, whatever n
        if self.num_prompt_top is not None:
            body["prompt_logprobs"] = self.prompt_logprobs_body(choices[0])  # the same for every choice
        return body

    def chunk(self, choices: list[dict], include_usage: bool, usage_body: dict | None = None) -> dict:
        """With token_ids, the first chunk carries the prompt's."""
        body = super().chunk(choices, include_usage, usage_body)
        if self.token_ids and not self._prompt_ids_sent:
            body["prompt_token_ids"], self._prompt_ids_sent = self.prompt_ids[0], True
        return body

    def opening_choice(self, index: int) -> dict | None:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def final_choice(self, index: int, choice: ChoiceState) -> dict:
        message = {"role": "assistant", "content": choice.text}
        finish_reason = choice.finish_reason
        if self.tool_calling is not None:
            reader, max_calls = self.tool_calling.reader, self.tool_calling.max_calls
            message["content"], calls = parse_tool_calls(reader, choice.text, max_calls)
            if not calls and self.tool_calling.constrained:
                # Cut short (max_tokens, a stop string): graphrt's grammar wrote it, so it is no answer
                # to show as text; the calls begun go out as far as they got, as a stream sent them
                # (vLLM sends a named call's arguments so).
                calls = begun_tool_calls(reader, choice.text, max_calls)
                message["content"] = None if calls else ""
            if calls:
                message["tool_calls"] = [call.body(new_call_id()) for call in calls]
                finish_reason = self._finish_reason(finish_reason, made_calls=True)
        body = {"index": index, "message": message, "logprobs": self.logprobs(choice), "finish_reason": finish_reason,
                "stop_reason": choice.stop_reason}
        if self.token_ids:
            body["token_ids"] = choice.token_ids
        return body

    def _finish_reason(self, finish_reason: str | None, made_calls: bool) -> str | None:
        """As OpenAI says it: "tool_calls" where the model ended its output after calling, but "stop"
        for a named tool_choice."""
        return "tool_calls" if made_calls and finish_reason == "stop" and not self.tool_calling.named else finish_reason

    def delta_choices(self, index: int, choice: ChoiceState, text: str) -> list[dict]:
        """With tools, the text streamed so far is read for calls: content, each call's opening and
        its arguments in fragments go out in chunks of their own; text that may begin a call waits."""
        if self.tool_calling is None:
            return super().delta_choices(index, choice, text)
        calling = self.tool_calling
        stream = self._streams.setdefault(index, ToolCallStream(calling.reader, calling.max_calls, sends_content=not calling.constrained))
        deltas = stream.feed(choice.text[: choice.num_sent], choice.finished)
        if not deltas and (choice.finished or choice.scored):
            deltas = [{}]
        pieces = [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None} for delta in deltas]
        if pieces:
            pieces[0]["logprobs"] = self.logprobs(choice)
            if self.token_ids:  # the new ids on the first piece, none on the rest
                for position, piece in enumerate(pieces):
                    piece["token_ids"] = choice.take_token_ids() if position == 0 else []
            if choice.finished:
                pieces[-1]["finish_reason"] = self._finish_reason(choice.finish_reason, stream.made_calls)
                pieces[-1]["stop_reason"] = choice.stop_reason
        return pieces

    def delta_choice(self, index: int, choice: ChoiceState, text: str) -> dict:
        delta = {"content": text} if text else {}
        body = {"index": index, "delta": delta, "logprobs": self.logprobs(choice), "finish_reason": choice.finish_reason}
        if choice.finished:
            body["stop_reason"] = choice.stop_reason
        if self.token_ids:
            body["token_ids"] = choice.take_token_ids()
        return body

    def logprobs_body(self, choice: ChoiceState, scored: list[Scored]) -> dict:
        """The chat shape: one object per token, with its UTF-8 bytes and a list of alternatives."""
        def token(token_id: int, logprob: float) -> dict:
            name = self.names(token_id)
            return {"token": name, "logprob": logprob, "bytes": list(name.encode("utf-8"))}

        content = [
            {**token(token_id, entry.logprob), "top_logprobs": [token(alt, logprob) for alt, logprob in entry.top]}
            for token_id, entry in scored
        ]
        return {"content": content, "refusal": None}
