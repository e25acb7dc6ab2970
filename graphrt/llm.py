"""The offline Python API: `LLM(model=..., pp=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from graphrt.capture.manifest import read_manifest
from graphrt.config import EngineConfig
from graphrt.default_model import default_model_dir
from graphrt.engine import Engine
from graphrt.errors import RequestError
from graphrt.logprobs import TokenLogprob
from graphrt.output_processor import OutputProcessor
from graphrt.sampling import SamplingParams


# Options a graph cache supplies when the caller leaves them unset; set differently, they make it stale.
CACHE_DEFAULTS = ("pp", "dtype", "kernels", "buckets", "block_size", "max_model_len")


@dataclass
class RequestOutput:
    prompt: str | list[int]
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    # When params.logprobs / params.prompt_logprobs asked: one per output token; one per prompt
    # token, None for the first (see graphrt.logprobs).
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


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
        options = {k: v for k, v in dict(pp=pp, dtype=dtype, devices=devices, **engine_options).items() if v is not None}
        if cache is not None:
            cache = Path(cache)
            # Compiled Triton kernels live in the cache too; triton reads this when it first compiles.
            os.environ.setdefault("TRITON_CACHE_DIR", str(cache / "triton"))
            manifest = read_manifest(cache)
            for field in CACHE_DEFAULTS:
                options.setdefault(field, manifest[field])
        model_dir = Path(model) if model is not None else default_model_dir()
        self.engine = Engine(
            model_dir, EngineConfig(**options), cache_dir=cache, show_progress=show_progress, load_tokenizer=load_tokenizer
        )

    @property
    def model_dir(self) -> Path:
        return self.engine.model_dir

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def chat_prompt(self, user_message: str) -> list[int]:
        """Token ids of a one-turn conversation, with the model's chat template applied."""
        if self.engine.tokenizer is None:
            raise RequestError(f"{self.model_dir} has no tokenizer, so it has no chat template")
        return self.engine.tokenizer.encode_chat([{"role": "user", "content": user_message}])

    def generate(
        self, prompts: str | list[int] | list[str | list[int]], params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, or a list of token ids); outputs keep the prompts' order.

        Every prompt is validated before any runs: a bad one raises RequestError naming it.
        """
        params = params or SamplingParams()
        if params.stop and self.engine.tokenizer_skipped:
            raise RequestError("stop strings need the tokenizer, which this LLM was built without (load_tokenizer=False)")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        engine = self.engine
        seqs = []
        try:
            for index, prompt in enumerate(prompts):
                try:
                    seqs.append(engine.add_request(prompt, params))
                except RequestError as exc:
                    raise RequestError(f"prompt {index}: {exc}") from None
        except RequestError:
            for seq in seqs:
                engine.abort(seq)
            raise
        processor = OutputProcessor(engine)
        texts: dict[int, str] = {}
        while engine.has_work():
            for seq, text in processor.process(engine.step()):
                texts[seq.request_id] = text.text
        return [
            RequestOutput(
                prompt=prompt,
                prompt_token_ids=seq.prompt_ids,
                text=texts.get(seq.request_id, ""),
                token_ids=seq.output_ids,
                finish_reason=seq.finish_reason.value,
                logprobs=seq.logprobs if params.logprobs is not None else None,
                prompt_logprobs=seq.prompt_logprobs if params.prompt_logprobs is not None else None,
            )
            for prompt, seq in zip(prompts, seqs)
        ]
