"""One thread owns the engine; the event loop talks to it through queues.

The engine is not thread-safe, so exactly one thread, the engine thread, ever calls it. HTTP
handlers put jobs and aborts on a thread-safe command queue; between two engine steps the thread
takes every waiting command (so an abort lands within one step), runs the next step, and hands
each job's new tokens to its asyncio queue with one `loop.call_soon_threadsafe` per step. When
the engine has no work the thread sleeps on the command queue.

A job reaches the engine thread as checked token ids: tokenizing, chat templating and the length
checks cost time in proportion to the prompt, so `prepare` does them on a worker thread first.
On the engine thread they would stall every running stream for as long as a prompt that is
about to be refused takes to tokenize.

When a busy engine runs out of work, the thread gives the C heap's free pages back to the system
(glibc's `malloc_trim`) before it sleeps: requests and their tensors leave the heap fragmented,
and without this a server that has seen a load keeps that memory while idle.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from graphrt.engine.core import Admitted, EngineCore, EngineSnapshot, Failed, Rejected, heap_trimmer, prompt_of  # noqa: F401 (re-exported)
from graphrt.engine.sequence import FinishReason
from graphrt.errors import ContextLengthError, GraphrtError, RequestError
from graphrt.frontend.output_processor import OutputProcessor, RequestState
from graphrt.sampling_params import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from graphrt.engine.engine import Engine
    from graphrt.frontend.tokenizer import Tokenizer

logger = logging.getLogger("graphrt.server")


# -- what the engine sends to a job (besides Admitted, Rejected and Failed: graphrt.engine.core) ----


@dataclass(frozen=True)
class ChoiceUpdate:
    index: int
    text: str  # the whole output so far, already cut at a stop string
    num_streamable: int  # characters of `text` no later token can change (OutputProcessor)
    num_tokens: int
    finish_reason: str | None
    at: float  # time.perf_counter() when the step that made it ended
    # For requests that ask: the front's lists of the choice (RequestState), which only grow (on the
    # engine thread); the first `num_tokens` logprobs are final. The prompt's come with the first token.
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    token_ids: list[int] | None = None  # the front's list of the choice's output ids, as logprobs: the first num_tokens are final
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended it (None for EOS or a limit)


@dataclass(frozen=True)
class Disconnected:
    """Put by the HTTP side itself when the client went away."""


@dataclass(eq=False)  # compared and hashed by identity
class GenerationJob:
    """One HTTP request: its prompts (texts or token ids), or chat messages (and the tools the chat
    template shows the model), and one SamplingParams per choice. With several prompts the choices go
    prompt by prompt, `len(params) // len(prompts)` each, as OpenAI numbers them."""

    params: list[SamplingParams]
    prompts: list[str | list[int]] | None = None
    messages: list[dict] | None = None
    tools: list[dict] | None = None  # JSON schemas of functions, as transformers' chat templates take them
    template_kwargs: dict = field(default_factory=dict)  # the rest of what the chat template renders with (Tokenizer.apply_chat_template)
    prompt_ids: list[list[int]] | None = None  # one per prompt, set by AsyncEngine.prepare before the job is submitted
    updates: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrived_at: float = field(default_factory=time.perf_counter)

    @property
    def num_prompts(self) -> int:
        return 1 if self.prompts is None else len(self.prompts)

    def prompt_index(self, choice: int) -> int:
        """Which prompt a choice continues."""
        return prompt_of(choice, self.num_prompts, len(self.params))


class AsyncEngine:
    """The engine on a thread of this process (see the module docstring)."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer | None):
        self.engine = engine
        self.tokenizer = tokenizer  # None: prompts are token ids (a model without a tokenizer)
        self._commands: queue.Queue = queue.Queue()
        self._core = EngineCore(engine)  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.accepting = False
        self._admission = threading.Lock()  # no job can be queued behind the stop command
        self._prompts = PromptPreparer(tokenizer, engine.max_model_len, engine.scheduler.check, engine.model_dir.name)
        self._outputs = OutputProcessor(tokenizer)  # engine thread only
        self._request_ids: dict[GenerationJob, list[int]] = {}  # engine thread only: each job's requests, while it runs
        self._trim_heap = heap_trimmer()
        self.snapshot = self._core.snapshot()

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_dir(self) -> Path:
        return self.engine.model_dir

    @property
    def failure(self):
        """What stopped the pipeline (--procs: a dead stage process), or None."""
        return self.engine.failure

    # -- the event loop's side ------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.accepting = True
        self._thread = threading.Thread(target=self._run, name="graphrt-engine", daemon=True)
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self.accepting and self._thread is not None and self._thread.is_alive()

    async def prepare(self, job: GenerationJob) -> None:
        """Set the job's checked prompt token ids (and its params as the engine takes them), working
        in the event loop's default executor (never on the engine thread, nor blocking the event
        loop). Raises RequestError: a 400."""
        job.prompt_ids, job.params = await asyncio.to_thread(self._prompts.prepare, job)

    def submit(self, job: GenerationJob) -> bool:
        """Queue a prepared job; False once stopping or if the engine thread is gone (the job was not queued)."""
        if job.prompt_ids is None:
            raise ValueError("prepare the job before submitting it: the engine thread takes only token ids")
        with self._admission:
            if self.healthy:
                self._commands.put(("add", job))
            return self.healthy

    def abort(self, job: GenerationJob) -> None:
        self._commands.put(("abort", job))

    async def reset_prefix_cache(self) -> bool:
        """Engine.reset_prefix_cache, on the engine thread; False there when the engine is stopping."""
        answer = asyncio.get_running_loop().create_future()
        with self._admission:
            if not self.healthy:
                return False
            self._commands.put(("reset", answer))
        return await answer

    def stop(self) -> None:
        """Stop admitting; cancel every job in flight (each gets a 503); the thread then exits."""
        with self._admission:
            if self.accepting:
                self.accepting = False
                self._commands.put(("stop", None))

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def close(self) -> None:
        """After `join`: each stage finishes the micro-batch it holds, then its thread ends."""
        self.engine.close()

    # -- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop_until_stopped()
        except BaseException as exc:  # noqa: BLE001 - a bug here must not leave clients waiting forever
            logger.error("the engine thread failed; failing every request", exc_info=exc)
            with self._admission:
                self.accepting = False
            failed = Failed(500, "internal error in the engine; see the server log")
            commands = self._take_commands(block=False)
            for kind, answer in commands:
                if kind == "reset":
                    self._loop.call_soon_threadsafe(answer.set_result, False)
            queued = [job for kind, job in commands if kind == "add"]
            self._deliver([(job, failed) for job in list(self._core.jobs) + queued])

    def _loop_until_stopped(self) -> None:
        running, stepped = True, False
        core = self._core
        while running:
            deliveries: list[tuple[GenerationJob, object]] = []
            idle = not self.engine.has_work()
            if idle and stepped:
                self._trim_heap()
                stepped = False
            for kind, job in self._take_commands(block=idle):
                if kind == "add":
                    answer = core.add(job, job.prompt_ids, job.params)
                    if isinstance(answer, Admitted):
                        for seq in core.jobs[job]:
                            self._outputs.add(seq.request_id, seq.params)
                        self._request_ids[job] = [seq.request_id for seq in core.jobs[job]]
                    deliveries.append((job, answer))
                elif kind == "abort":
                    core.abort(job)
                    self._forget_texts(job)
                elif kind == "reset":  # `job` is the caller's future
                    self._loop.call_soon_threadsafe(job.set_result, self.engine.reset_prefix_cache())
                else:
                    running = False
            if not running:
                deliveries += core.stop()
            elif self.engine.has_work():
                self._step(deliveries)
                stepped = True
            self.snapshot = core.snapshot()
            self._deliver(deliveries)

    def _take_commands(self, block: bool) -> list[tuple[str, GenerationJob | None]]:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _step(self, deliveries: list) -> None:
        updated, failed = self._core.step()
        deliveries += failed
        for job, _ in failed:  # a failure ended them in the engine: nobody waits for their text
            self._forget_texts(job)
        now = time.perf_counter()
        states, stopped = self._outputs.process([output for _, _, output in updated])
        for request_id in stopped:  # a stop string in its text: end it in the engine within this step
            self._core.finish(*self._core.owners[request_id], FinishReason.STOP)
        changed = {state.request_id: state for state in states}
        for job, choice, output in updated:
            if output.request_id in changed:
                deliveries.append((job, choice_update(choice, changed[output.request_id], now)))
        ended = {job for job, _, _ in updated}
        self._core.forget_finished(ended)
        for job in ended - self._core.jobs.keys():  # every choice finished: their states are gone
            self._request_ids.pop(job, None)

    def _forget_texts(self, job: GenerationJob) -> None:
        for request_id in self._request_ids.pop(job, []):
            self._outputs.forget(request_id)

    def _deliver(self, deliveries: list) -> None:
        if not deliveries:
            return
        try:
            self._loop.call_soon_threadsafe(_put_all, deliveries)
        except RuntimeError:
            pass  # the event loop is closed: nobody is waiting any more


def choice_update(choice: int, state: RequestState, now: float) -> ChoiceUpdate:
    """What a job hears of one choice after a step: its text so far and, if asked, its logprobs."""
    text = state.text
    return ChoiceUpdate(
        choice, text.text, text.num_streamable, len(state.output_ids), state.finish_reason, now,
        state.logprobs, state.prompt_logprobs, state.output_ids, state.stop_reason,
    )


class PromptPreparer:
    """A job's prompt as token ids that fit the context, or a RequestError saying why not.

    Runs on worker threads, so it reads only what never changes while serving: the tokenizer
    (its encoding settings are never modified, so concurrent calls only read it), the context
    length and the scheduler's length check, which depends on configuration alone.
    """

    def __init__(self, tokenizer, max_model_len: int, check_lengths, model_name: str):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.check_lengths = check_lengths  # Scheduler.check, or the same check made from its numbers
        self.model_name = model_name

    def prepare(self, job: GenerationJob) -> tuple[list[list[int]], list[SamplingParams]]:
        """The job's checked prompt token ids, and its params with their bad words tokenized."""
        spelled: dict[tuple[str, ...], list[list[int]]] = {}  # the choices of a job share their words
        return self.prompt_ids(job), [self._for_engine(params, spelled) for params in job.params]

    def _for_engine(self, params: SamplingParams, spelled: dict) -> SamplingParams:
        if not params.bad_words or params.bad_words_token_ids is not None:
            return params
        if self.tokenizer is None:
            raise RequestError(f"{self.model_name} has no tokenizer to spell bad_words with")
        words = tuple(params.bad_words)
        if words not in spelled:
            spelled[words] = self.tokenizer.bad_words_token_ids(params.bad_words)
        return replace(params, bad_words_token_ids=spelled[words])

    def prompt_ids(self, job: GenerationJob) -> list[list[int]]:
        """Each prompt's token ids; a RequestError names the prompt when there are several."""
        if job.messages is not None:
            prompt_ids = [self._encode(self._render_chat(job.messages, job.tools, job.template_kwargs), templated=True)]
        else:
            prompt_ids = []
            for index, prompt in enumerate(job.prompts):
                try:
                    prompt_ids.append(self._prompt_ids(prompt))
                except RequestError as exc:
                    raise type(exc)(f"prompt[{index}]: {exc}" if len(job.prompts) > 1 else str(exc)) from None
        for choice, params in enumerate(job.params):
            index = job.prompt_index(choice)
            try:
                self.check_lengths(len(prompt_ids[index]), params.max_tokens)
            except RequestError as exc:
                raise type(exc)(f"prompt[{index}]: {exc}" if len(prompt_ids) > 1 else str(exc)) from None
        return prompt_ids

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        if self.tokenizer is None:
            raise RequestError(f"{self.model_name} has no tokenizer; pass prompts as lists of token ids")
        return self._encode(prompt, templated=False)

    def _render_chat(self, messages: list[dict], tools: list[dict] | None, template_kwargs: dict) -> str:
        if self.tokenizer is None:
            raise RequestError(f"{self.model_name} has no tokenizer, so it has no chat template; use /v1/completions with token ids")
        try:
            # Rendering is a string join, cheap next to tokenizing; bounding the rendered text
            # rather than the messages stays right for a template that leaves a message out.
            return self.tokenizer.apply_chat_template(messages, tools, **template_kwargs)
        except GraphrtError as exc:
            raise RequestError(str(exc)) from None
        except Exception as exc:  # the model's Jinja template refused the conversation
            raise RequestError(f"the chat template refused these messages: {exc}") from None

    def _encode(self, text: str, templated: bool) -> list[int]:
        # Refuse first what its length in characters alone proves too long: tokenizing a
        # megabyte takes about half a second of CPU that such a request has no claim to.
        at_least = self.tokenizer.min_num_tokens(len(text))
        if at_least >= self.max_model_len:
            raise ContextLengthError(
                f"This model's maximum context length is {self.max_model_len} tokens, and the prompt is {len(text)} "
                f"characters, so at least {at_least} tokens (the prompt and at least one new token must fit); shorten the prompt"
            )
        return self.tokenizer.encode_templated(text) if templated else self.tokenizer.encode(text)


def _put_all(deliveries: list[tuple[GenerationJob, object]]) -> None:
    for job, update in deliveries:
        job.updates.put_nowait(update)
