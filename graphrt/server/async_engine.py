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
import ctypes
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from graphrt.errors import GraphrtError, RequestError, StageError
from graphrt.logprobs import TokenLogprob
from graphrt.output_processor import OutputProcessor
from graphrt.sampling import SamplingParams
from graphrt.sequence import FinishReason, Sequence

if TYPE_CHECKING:
    from graphrt.engine import Engine

logger = logging.getLogger("graphrt.server")


# -- what the engine thread sends to a job ---------------------------------------------------------


@dataclass(frozen=True)
class Admitted:
    prompt_tokens: int


@dataclass(frozen=True)
class Rejected:
    """The engine refused the request (prompt too long, can never fit the KV cache...): a 400."""

    message: str


@dataclass(frozen=True)
class Failed:
    """The request was cut short by the server: shutting down (503) or an engine fault (500)."""

    status: int
    message: str


@dataclass(frozen=True)
class ChoiceUpdate:
    index: int
    text: str  # the whole output so far, already cut at a stop string
    num_streamable: int  # characters of `text` no later token can change (OutputProcessor)
    num_tokens: int
    finish_reason: str | None
    at: float  # time.perf_counter() when the step that made it ended
    # For requests that ask: the sequence's own lists, which only grow (on the engine thread);
    # the first `num_tokens` logprobs are final. The prompt's are complete by the first token.
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass(frozen=True)
class Disconnected:
    """Put by the HTTP side itself when the client went away."""


@dataclass(eq=False)  # compared and hashed by identity
class GenerationJob:
    """One HTTP request: its prompts (texts or token ids), or chat messages, and one SamplingParams
    per choice. With several prompts the choices go prompt by prompt, `len(params) // len(prompts)`
    each, as OpenAI numbers them."""

    params: list[SamplingParams]
    prompts: list[str | list[int]] | None = None
    messages: list[dict] | None = None
    prompt_ids: list[list[int]] | None = None  # one per prompt, set by AsyncEngine.prepare before the job is submitted
    updates: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrived_at: float = field(default_factory=time.perf_counter)
    # engine thread only
    seqs: list[Sequence] = field(default_factory=list)
    started: bool = False  # has produced a token

    @property
    def num_prompts(self) -> int:
        return 1 if self.prompts is None else len(self.prompts)

    def prompt_index(self, choice: int) -> int:
        """Which prompt a choice continues."""
        return choice * self.num_prompts // len(self.params)


@dataclass(frozen=True)
class EngineSnapshot:
    """What /metrics shows of the engine, published by the engine thread after every step."""

    num_free_blocks: int
    num_blocks: int
    num_running: int  # requests that have produced a token and are not finished
    num_waiting: int  # requests admitted to the engine that have not produced a token yet
    num_eager_fallbacks: int
    num_preemptions: int = 0  # sequences that gave their KV blocks back to be recomputed later
    stage_busy_s: tuple[float, ...] = ()  # seconds each stage has worked (stage processes: as of their last reply)
    num_cached_blocks: int = 0  # of the free blocks, those the prefix cache keeps
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._commands: queue.Queue = queue.Queue()
        self._jobs: set[GenerationJob] = set()  # engine thread only
        self._owners: dict[int, tuple[GenerationJob, int]] = {}  # request_id -> (job, choice index)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.accepting = False
        self._admission = threading.Lock()  # no job can be queued behind the stop command
        self._prompts = PromptPreparer(engine)
        self._outputs = OutputProcessor(engine)  # engine thread only
        self._trim_heap = heap_trimmer()
        self.snapshot = self._take_snapshot()

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
        """Set the job's checked prompt token ids, working in the event loop's default executor
        (never on the engine thread, nor blocking the event loop). Raises RequestError: a 400."""
        job.prompt_ids = await asyncio.to_thread(self._prompts.prompt_ids, job)

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

    def stop(self) -> None:
        """Stop admitting; cancel every job in flight (each gets a 503); the thread then exits."""
        with self._admission:
            if self.accepting:
                self.accepting = False
                self._commands.put(("stop", None))

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    # -- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop_until_stopped()
        except BaseException as exc:  # noqa: BLE001 - a bug here must not leave clients waiting forever
            logger.error("the engine thread failed; failing every request", exc_info=exc)
            with self._admission:
                self.accepting = False
            failed = Failed(500, "internal error in the engine; see the server log")
            queued = [job for kind, job in self._take_commands(block=False) if kind == "add"]
            self._deliver([(job, failed) for job in list(self._jobs) + queued])

    def _loop_until_stopped(self) -> None:
        running, stepped = True, False
        while running:
            deliveries: list[tuple[GenerationJob, object]] = []
            idle = not self.engine.has_work()
            if idle and stepped:
                self._trim_heap()
                stepped = False
            for kind, job in self._take_commands(block=idle):
                if kind == "add":
                    self._add(job, deliveries)
                elif kind == "abort":
                    self._abort(job)
                else:
                    running = False
            if not running:
                for job in list(self._jobs):
                    self._abort(job)
                    deliveries.append((job, Failed(503, "the server is shutting down; retry on another server")))
            elif self.engine.has_work():
                self._step(deliveries)
                stepped = True
            self.snapshot = self._take_snapshot()
            self._deliver(deliveries)

    def _take_commands(self, block: bool) -> list[tuple[str, GenerationJob | None]]:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _add(self, job: GenerationJob, deliveries: list) -> None:
        try:
            for choice, params in enumerate(job.params):
                job.seqs.append(self.engine.add_request(job.prompt_ids[job.prompt_index(choice)], params))
        except Exception as exc:
            for seq in job.seqs:
                self.engine.abort(seq)
            if isinstance(exc, (RequestError, ValueError)):
                deliveries.append((job, Rejected(str(exc))))
            else:
                logger.exception("admitting a request failed")
                deliveries.append((job, Failed(500, "internal error while admitting the request; see the server log")))
            return
        self._jobs.add(job)
        for index, seq in enumerate(job.seqs):
            self._owners[seq.request_id] = (job, index)
        deliveries.append((job, Admitted(sum(map(len, job.prompt_ids)))))

    def _abort(self, job: GenerationJob) -> None:
        if job not in self._jobs:
            return  # already finished, or never admitted
        for seq in job.seqs:
            self.engine.abort(seq)
        self._forget(job)

    def _forget(self, job: GenerationJob) -> None:
        self._jobs.discard(job)
        for seq in job.seqs:
            self._owners.pop(seq.request_id, None)
            self._outputs.forget(seq)

    def _step(self, deliveries: list) -> None:
        try:
            seqs = self.engine.step()
        except Exception as exc:
            failure = self.engine.failure
            if failure is not None:
                # A stage process died or went silent (--procs): nothing in flight can finish; the server stops.
                logger.error("%s; failing %d requests in flight", failure, len(self._jobs))
                status, message = 503, str(failure)
            elif isinstance(exc, StageError):
                # A stage failed and the engine recovered: only the requests it was carrying end.
                hit = [job for job in self._jobs if any(s.finish_reason is FinishReason.ERROR for s in job.seqs)]
                logger.error("%s; failing %d requests", exc, len(hit))
                for job in hit:
                    self._abort(job)
                    deliveries.append((job, Failed(500, "a pipeline stage failed while running this request; retry it")))
                return
            else:
                # A bug in the engine: fail what is in flight rather than leave clients hanging.
                logger.error("engine step failed; failing %d requests in flight", len(self._jobs), exc_info=exc)
                status, message = 500, "internal error in the engine; see the server log"
            for job in list(self._jobs):
                self._abort(job)
                deliveries.append((job, Failed(status, message)))
            return
        now = time.perf_counter()
        for seq, text in self._outputs.process(seqs):
            job, index = self._owners[seq.request_id]
            job.started = True
            reason = seq.finish_reason.value if seq.finish_reason is not None else None
            params = seq.params
            deliveries.append((job, ChoiceUpdate(
                index, text.text, text.num_streamable, len(seq.output_ids), reason, now,
                seq.logprobs if params.logprobs is not None else None,
                seq.prompt_logprobs if params.prompt_logprobs is not None else None,
            )))
        for job in {job for job, _ in deliveries}:
            if all(seq.finished for seq in job.seqs):
                self._forget(job)

    def _take_snapshot(self) -> EngineSnapshot:
        engine = self.engine
        num_running = sum(1 for job in self._jobs if job.started)
        return EngineSnapshot(
            num_free_blocks=engine.allocator.num_free,
            num_blocks=engine.allocator.num_blocks,
            num_running=num_running,
            num_waiting=len(self._jobs) - num_running,
            num_eager_fallbacks=engine.num_eager_fallbacks,
            num_preemptions=engine.scheduler.num_preemptions,
            stage_busy_s=tuple(engine.ring.stage_busy_s),
            num_cached_blocks=engine.allocator.num_cached,
            prefix_queried_tokens=engine.allocator.num_queried_tokens,
            prefix_hit_tokens=engine.allocator.num_hit_tokens,
        )

    def _deliver(self, deliveries: list) -> None:
        if not deliveries:
            return
        try:
            self._loop.call_soon_threadsafe(_put_all, deliveries)
        except RuntimeError:
            pass  # the event loop is closed: nobody is waiting any more


class PromptPreparer:
    """A job's prompt as token ids that fit the context, or a RequestError saying why not.

    Runs on worker threads, so it reads only what never changes while serving: the tokenizer
    (its encoding settings are never modified, so concurrent calls only read it), the context
    length and the scheduler's length check, which depends on configuration alone.
    """

    def __init__(self, engine: Engine):
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.check_lengths = engine.scheduler.check
        self.model_name = engine.model_dir.name

    def prompt_ids(self, job: GenerationJob) -> list[list[int]]:
        """Each prompt's token ids; a RequestError names the prompt when there are several."""
        if job.messages is not None:
            prompt_ids = [self._encode(self._render_chat(job.messages), templated=True)]
        else:
            prompt_ids = []
            for index, prompt in enumerate(job.prompts):
                try:
                    prompt_ids.append(self._prompt_ids(prompt))
                except RequestError as exc:
                    raise RequestError(f"prompt[{index}]: {exc}" if len(job.prompts) > 1 else str(exc)) from None
        for choice, params in enumerate(job.params):
            index = job.prompt_index(choice)
            try:
                self.check_lengths(len(prompt_ids[index]), params.max_tokens)
            except RequestError as exc:
                raise RequestError(f"prompt[{index}]: {exc}" if len(prompt_ids) > 1 else str(exc)) from None
        return prompt_ids

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        if self.tokenizer is None:
            raise RequestError(f"{self.model_name} has no tokenizer; pass prompts as lists of token ids")
        return self._encode(prompt, templated=False)

    def _render_chat(self, messages: list[dict]) -> str:
        if self.tokenizer is None:
            raise RequestError(f"{self.model_name} has no tokenizer, so it has no chat template; use /v1/completions with token ids")
        try:
            # Rendering is a string join, cheap next to tokenizing; bounding the rendered text
            # rather than the messages stays right for a template that leaves a message out.
            return self.tokenizer.apply_chat_template(messages)
        except GraphrtError as exc:
            raise RequestError(str(exc)) from None
        except Exception as exc:  # the model's Jinja template refused the conversation
            raise RequestError(f"the chat template refused these messages: {exc}") from None

    def _encode(self, text: str, templated: bool) -> list[int]:
        # Refuse first what its length in characters alone proves too long: tokenizing a
        # megabyte takes about half a second of CPU that such a request has no claim to.
        at_least = self.tokenizer.min_num_tokens(len(text))
        if at_least >= self.max_model_len:
            raise RequestError(
                f"the prompt is {len(text)} characters, so at least {at_least} tokens, but the context holds "
                f"{self.max_model_len} tokens (prompt plus at least one new token); shorten the prompt"
            )
        return self.tokenizer.encode_templated(text) if templated else self.tokenizer.encode(text)


def heap_trimmer():
    """glibc's malloc_trim(0), which returns the heap's free pages to the system; a no-op elsewhere."""
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return lambda: None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


def _put_all(deliveries: list[tuple[GenerationJob, object]]) -> None:
    for job, update in deliveries:
        job.updates.put_nowait(update)
