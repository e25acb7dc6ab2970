"""The offline Python API: `LLM(model=..., pp=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from graphrt.engine.sequence import FinishReason
from graphrt.engine.startup import build_engine, model_for
from graphrt.errors import RequestError
from graphrt.frontend.generation_config import sampling_defaults
from graphrt.frontend.output_processor import OutputProcessor, RequestState
from graphrt.frontend.tokenizer import TokenizerLoading
from graphrt.logs import configure_library_logging
from graphrt.model.default_model import model_dir_for
from graphrt.sampling_params import SamplingParams, TokenLogprob


@dataclass
class CompletionOutput:
    """One output of a prompt (vLLM's name and fields): SamplingParams.n of them per prompt."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    # vLLM's: the stop string or the stop token id (stop_token_ids) that ended it; None for EOS or a limit.
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None  # when SamplingParams.logprobs asked: one per token
    cumulative_logprob: float | None = None  # the sum of those logprobs (None without them)
    error: str | None = None  # with finish_reason "error": why (its structured output's grammar did not compile)


@dataclass
class RequestOutput:
    """A prompt's outputs, as vLLM's RequestOutput holds them. `text`, `token_ids`,
    `finish_reason`, `logprobs` and `error` are the first output's, for the common n = 1."""

    request_id: str
    prompt: str | list[int]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    # When SamplingParams.prompt_logprobs asked: one per prompt token, None for the first (see
    # graphrt.runtime.logprobs).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finished: bool = True

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self.outputs[0].logprobs

    @property
    def error(self) -> str | None:
        return self.outputs[0].error


class LLM:
    """A model split into `pp` pipeline stages, ready to generate.

    `model` is a Hugging Face style folder; None means the default model (SmolLM2-135M-Instruct,
    converted once into graphrt's cache). `cache` is a folder written by `graphrt capture`: it
    supplies pp, dtype, kernels and buckets unless given, and is refused if it doesn't fit.
    `load_tokenizer=False` skips the tokenizer (seconds of importing transformers) for callers that
    pass token ids and turn tokens into text themselves: outputs then have no text, and text
    prompts and stop strings are refused (unless the tokenizer files leave the EOS id open, and it
    is loaded after all). Other keyword arguments are `EngineConfig` fields; None means the default.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        pp: int | None = None,
        dtype: str | torch.dtype | None = None,
        devices: list[str] | None = None,
        cache: str | Path | None = None,
        show_progress: bool = False,
        load_tokenizer: bool = True,
        **engine_options,
    ):
        configure_library_logging()
        model_dir = model_dir_for(model_for(model, cache))
        loading = TokenizerLoading(model_dir, load_tokenizer)
        try:
            self.engine = build_engine(
                model_dir, cache, show_progress, loading.eos_token_id, pp=pp, dtype=dtype, devices=devices, **engine_options
            )
        except BaseException:
            loading.settle()
            raise
        self.tokenizer = loading.result()  # loaded by now: the engine waited for its EOS id
        self.tokenizer_skipped = loading.skipped
        self._default_sampling: dict | None = None  # the model's generation_config.json sampling keys, read once

    @property
    def model_dir(self) -> Path:
        return self.engine.model_dir

    def chat_prompt(self, user_message: str) -> list[int]:
        """Token ids of a one-turn conversation, with the model's chat template applied."""
        if not isinstance(user_message, str):
            raise TypeError(f"chat_prompt takes the user's message as text, got {type(user_message).__name__}; for a conversation (a list of messages) use LLM.chat")
        if self.tokenizer is None:
            raise RequestError(f"{self.model_dir} has no tokenizer, so it has no chat template")
        return self.tokenizer.encode_chat([{"role": "user", "content": user_message}])

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` samples with when given no SamplingParams (vLLM's name): the model
        folder's generation_config.json defaults (temperature, top_p, top_k, min_p,
        repetition_penalty), else SamplingParams()'s."""
        if self._default_sampling is None:
            self._default_sampling = sampling_defaults(self.model_dir)
        return SamplingParams(**self._default_sampling)

    def generate(
        self, prompts: PromptsArg, sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs keep the prompts' order. A prompt is a text, token ids
        (a list, or a numpy array or tensor), or vLLM's dict with "prompt" or "prompt_token_ids";
        `prompts` one of those or a list of them. `sampling_params`: one SamplingParams for every
        prompt, or a list of one per prompt (as vLLM's); each prompt gets its `n` outputs, output i
        sampling with `seed + i`. `use_tqdm` shows a progress bar over the outputs.

        A prompt of none of those forms raises TypeError; every prompt is validated before any runs,
        and one the engine cannot take raises RequestError naming it. If the
        call is interrupted (Ctrl+C), its unfinished requests are aborted, not left to run.
        """
        prompts = prompt_list(prompts)
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(prompts):
                raise RequestError(f"{len(sampling_params)} SamplingParams for {len(prompts)} prompts; give one, or one per prompt")
            params = sampling_params
        else:
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        engine = self.engine
        seqs: list[list] = []  # each prompt's sequences, one per output
        try:
            for index, (prompt, prompt_params) in enumerate(zip(prompts, params)):
                try:
                    prompt_ids, engine_params = self._prompt_ids(prompt), self._for_engine(prompt_params)
                    seqs.append([engine.add_request(prompt_ids, choice) for choice in choices(engine_params)])
                except RequestError as exc:
                    raise type(exc)(f"prompt {index}: {exc}") from None
            states = self._run([seq for group in seqs for seq in group], use_tqdm)
        except BaseException:
            for group in seqs:
                for seq in group:
                    engine.abort(seq)
            raise
        return [
            RequestOutput(
                request_id=str(group[0].request_id),
                prompt=prompt,
                prompt_token_ids=group[0].prompt_ids,
                outputs=[self._output(index, seq, states[seq.request_id]) for index, seq in enumerate(group)],
                prompt_logprobs=group[0].prompt_logprobs if group[0].params.prompt_logprobs is not None else None,
            )
            for prompt, group in zip(prompts, seqs)
        ]

    def chat(
        self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False, tools: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: generate for one conversation (a list of {"role", "content"} messages,
        content a text or a list of text parts) or a list of them, with the model's chat template
        (and `tools`, for a template that renders them)."""
        if self.tokenizer is None:
            raise RequestError(f"{self.model_dir} has no tokenizer, so it has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.encode_chat([template_message(m) for m in conversation], tools) for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def get_tokenizer(self):
        """The Hugging Face tokenizer (vLLM's `get_tokenizer`), or None for a model without one."""
        return self.tokenizer.hf if self.tokenizer is not None else None

    def _run(self, seqs: list, use_tqdm: bool) -> dict[int, RequestState]:
        """Step the engine until `seqs` are done; the front's state of each, by request id."""
        engine, processor = self.engine, OutputProcessor(self.tokenizer)
        states = {seq.request_id: processor.add(seq.request_id, seq.params) for seq in seqs}
        by_id = {seq.request_id: seq for seq in seqs}
        with tqdm(total=len(seqs), desc="generate", unit="output", disable=not use_tqdm) as bar:
            while engine.has_work():
                changed, stopped = processor.process(engine.step())
                for request_id in stopped:  # a stop string in its text: no further step for it
                    engine.finish(by_id[request_id], FinishReason.STOP)
                bar.update(sum(1 for state in changed if state.finished))
        return states

    def _output(self, index: int, seq, state: RequestState) -> CompletionOutput:
        logprobs = seq.logprobs if seq.params.logprobs is not None else None
        return CompletionOutput(
            index=index, text=state.text.text, token_ids=seq.output_ids, finish_reason=seq.finish_reason.value,
            stop_reason=state.stop_reason, logprobs=logprobs,
            cumulative_logprob=sum(entry.logprob for entry in logprobs) if logprobs is not None else None,
            error=self._error(seq),
        )

    @staticmethod
    def _error(seq) -> str | None:
        """Why the engine ended `seq` unrun, in words; None if it did not. (A stage that fails
        raises out of `generate` instead.)"""
        if seq.finish_reason is FinishReason.ERROR and seq.grammar is not None and seq.grammar.failure is not None:
            return seq.grammar.failure.message
        return None

    def _for_engine(self, params: SamplingParams) -> SamplingParams:
        """`params` as the engine takes them: bad words as token ids. Raises RequestError."""
        needs_text = [name for name, value in (("stop strings", params.stop), ("bad_words", params.bad_words)) if value]
        if needs_text and self.tokenizer_skipped:
            raise RequestError(f"{needs_text[0]} need the tokenizer, which this LLM was built without (load_tokenizer=False)")
        if not params.bad_words or params.bad_words_token_ids is not None:
            return params
        if self.tokenizer is None:
            raise RequestError(f"{self.model_dir} has no tokenizer to spell bad_words with; give bad_words_token_ids")
        return replace(params, bad_words_token_ids=self.tokenizer.bad_words_token_ids(params.bad_words))

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if not isinstance(prompt, str):
            return prompt
        if self.tokenizer_skipped:
            raise RequestError("this LLM was built without its tokenizer (load_tokenizer=False); pass prompts as lists of token ids")
        if self.tokenizer is None:
            raise RequestError(f"{self.model_dir} has no tokenizer; pass prompts as lists of token ids")
        return self.tokenizer.encode(prompt)


Prompt = str | list[int]
PromptsArg = Prompt | dict | list | Iterable  # what generate takes: see prompt_list
PROMPT_FORMS = 'a text, a list of token ids, or a dict with "prompt" or "prompt_token_ids"'


def prompt_list(prompts: PromptsArg) -> list[Prompt]:
    """vLLM's prompt forms as a list of texts and token-id lists: one prompt (a text, token ids as a
    list, tuple, numpy array or tensor, or a dict with "prompt" or "prompt_token_ids") or a list
    (any iterable) of them. Raises TypeError naming the prompt that is none of those."""
    if hasattr(prompts, "tolist"):  # a numpy array or a tensor: one prompt's ids, or a batch of them
        prompts = prompts.tolist()
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts and _is_token(prompts[0])):
        prompts = [prompts]
    elif not isinstance(prompts, (list, tuple)):
        if not isinstance(prompts, Iterable):
            raise TypeError(f"prompts must be {PROMPT_FORMS}, or a list of them; got {type(prompts).__name__}")
        prompts = list(prompts)
    return [_one_prompt(index, prompt) for index, prompt in enumerate(prompts)]


def _one_prompt(index: int, prompt) -> Prompt:
    if isinstance(prompt, dict):
        unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
        if unknown or len(prompt) != 1:
            why = f"has {', '.join(map(repr, unknown))}, which graphrt does not take" if unknown else "needs exactly one of them"
            raise TypeError(f'prompt {index}: a dict prompt holds "prompt" (a text) or "prompt_token_ids"; this one {why}')
        prompt = next(iter(prompt.values()))
    if hasattr(prompt, "tolist"):
        prompt = prompt.tolist()
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (list, tuple)) and all(_is_token(token) for token in prompt):
        return [operator.index(token) for token in prompt]
    hint = " (token ids of one prompt go in a list)" if _is_token(prompt) else ""
    raise TypeError(f"prompt {index} must be {PROMPT_FORMS}; got {type(prompt).__name__}{hint}")


def _is_token(value) -> bool:
    """An integer that is not a bool (numpy integers included)."""
    try:
        operator.index(value)
    except TypeError:
        return False
    return not isinstance(value, bool)


def choices(params: SamplingParams) -> list[SamplingParams]:
    """A prompt's `n` outputs, each a request of its own: output i samples with seed + i."""
    if params.n == 1:
        return [params]
    return [replace(params, n=1, seed=None if params.seed is None else params.seed + i) for i in range(params.n)]


def template_message(message: dict) -> dict:
    """A chat message as the model's template takes it: content as plain text (a list of
    {"type": "text", "text"} parts joined), the other keys as given."""
    content = message.get("content")
    if isinstance(content, list):
        if any(not isinstance(part, dict) or part.get("type") != "text" for part in content):
            raise RequestError("a message's content parts must be text ({\"type\": \"text\", \"text\": ...}); graphrt serves text models")
        message = {**message, "content": "".join(part["text"] for part in content)}
    return message
