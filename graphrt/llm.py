"""The offline Python API: `LLM(model=..., pp=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from graphrt.engine.sequence import FinishReason
from graphrt.engine.startup import build_engine
from graphrt.errors import RequestError
from graphrt.frontend.generation_config import sampling_defaults
from graphrt.frontend.output_processor import OutputProcessor
from graphrt.frontend.tokenizer import TokenizerLoading
from graphrt.model.default_model import default_model_dir
from graphrt.sampling_params import SamplingParams, TokenLogprob


@dataclass
class RequestOutput:
    prompt: str | list[int]
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    # When params.logprobs / params.prompt_logprobs asked: one per output token; one per prompt
    # token, None for the first (see graphrt.runtime.logprobs).
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None  # with finish_reason "error": why (its structured output's grammar did not compile)


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
        model_dir = Path(model) if model is not None else default_model_dir()
        loading = TokenizerLoading(model_dir, load_tokenizer)
        self.engine = build_engine(
            model_dir, cache, show_progress, loading.eos_token_id, pp=pp, dtype=dtype, devices=devices, **engine_options
        )
        self.tokenizer = loading.result()  # loaded by now: the engine waited for its EOS id
        self.tokenizer_skipped = loading.skipped
        self._default_sampling: dict | None = None  # the model's generation_config.json sampling keys, read once

    @property
    def model_dir(self) -> Path:
        return self.engine.model_dir

    def chat_prompt(self, user_message: str) -> list[int]:
        """Token ids of a one-turn conversation, with the model's chat template applied."""
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
        self, prompts: str | list[int] | list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, or a list of token ids); outputs keep the prompts' order.
        `params`: one SamplingParams for every prompt, or a list of one per prompt (as vLLM's).

        Every prompt is validated before any runs: a bad one raises RequestError naming it.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if isinstance(params, list):
            if len(params) != len(prompts):
                raise RequestError(f"{len(params)} SamplingParams for {len(prompts)} prompts; give one, or one per prompt")
        else:
            params = [params or self.get_default_sampling_params()] * len(prompts)
        engine = self.engine
        seqs = []
        try:
            for index, (prompt, prompt_params) in enumerate(zip(prompts, params)):
                try:
                    seqs.append(engine.add_request(self._prompt_ids(prompt), self._for_engine(prompt_params)))
                except RequestError as exc:
                    raise RequestError(f"prompt {index}: {exc}") from None
        except RequestError:
            for seq in seqs:
                engine.abort(seq)
            raise
        processor = OutputProcessor(self.tokenizer)
        for seq in seqs:
            processor.add(seq.request_id, seq.params)
        by_id = {seq.request_id: seq for seq in seqs}
        texts: dict[int, str] = {}
        while engine.has_work():
            states, stopped = processor.process(engine.step())
            for request_id in stopped:  # a stop string in its text: no further step for it
                engine.finish(by_id[request_id], FinishReason.STOP)
            for state in states:
                texts[state.request_id] = state.text.text
        return [
            RequestOutput(
                prompt=prompt,
                prompt_token_ids=seq.prompt_ids,
                text=texts.get(seq.request_id, ""),
                token_ids=seq.output_ids,
                finish_reason=seq.finish_reason.value,
                logprobs=seq.logprobs if seq.params.logprobs is not None else None,
                prompt_logprobs=seq.prompt_logprobs if seq.params.prompt_logprobs is not None else None,
                error=self._error(seq),
            )
            for prompt, seq in zip(prompts, seqs)
        ]

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

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if not isinstance(prompt, str):
            return prompt
        if self.tokenizer_skipped:
            raise RequestError("this LLM was built without its tokenizer (load_tokenizer=False); pass prompts as lists of token ids")
        if self.tokenizer is None:
            raise RequestError(f"{self.model_dir} has no tokenizer; pass prompts as lists of token ids")
        return self.tokenizer.encode(prompt)
