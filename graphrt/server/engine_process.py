"""The engine in a process of its own, as `graphrt serve` runs it by default.

    front process: HTTP server, tokenizing, detokenizing  <-- ZMQ -->  engine process: scheduler, ring, stages

In one process the asyncio server, the detokenizer and the engine loop share one interpreter and
its GIL, so a burst of HTTP work delays the next micro-batch launch (vLLM's API server and
EngineCore, SGLang's tokenizer manager, scheduler and detokenizer are split the same way). Here
the engine process runs an `EngineCore` in a loop: it takes the commands waiting, steps the
engine, and sends the new token ids of every sequence that got one, one message per step. The
front (`EngineClient`) keeps a mirror of each sequence, turns token ids into text with the
`OutputProcessor` and ends a choice at a stop string by telling the engine.

Messages are typed msgspec structs over msgpack (never pickle): `AddJob`, `AbortJob`,
`StopChoice`, `Shutdown` one way; `Ready`, `JobAdmitted`, `JobRejected`, `JobFailed`, `Outputs`,
`Fatal` the other, on two ZMQ PUSH/PULL pairs over IPC sockets in a private folder.

If the engine process dies, every request in flight gets a 503 and the server stops with a
non-zero exit; if the front dies, the engine process notices its parent gone and exits. Where
the front and the engine run is planned once, in the front (graphrt.cpu_placement): pinned, the
engine process is started on every core, told its own, and pins itself; the front pins itself to
its core after the start.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Union

import msgspec
import zmq
import zmq.asyncio

from graphrt.cpu_placement import CpuPlacement, pin_process, plan_cpu_placement, usable_cores
from graphrt.default_model import default_model_dir
from graphrt.errors import GraphrtError
from graphrt.logprobs import TokenLogprob
from graphrt.output_processor import OutputProcessor
from graphrt.sampling import SamplingParams
from graphrt.scheduler import check_lengths
from graphrt.sequence import FinishReason, Sequence
from graphrt.server.async_engine import GenerationJob, PromptPreparer, choice_update, heap_trimmer
from graphrt.server.engine_core import Admitted, EngineCore, EngineSnapshot, Failed, Rejected
from graphrt.tokenizer import Tokenizer

logger = logging.getLogger("graphrt.server")

STARTUP_TIMEOUT_S = 900.0  # loading and capturing a large model can take minutes
PARENT_CHECK_S = 1.0  # how often an idle engine process checks that the front is still there
WATCH_INTERVAL_S = 0.1  # how often the front checks that the engine process is still there


# -- the wire ------------------------------------------------------------------------------------


class AddJob(msgspec.Struct, tag=True):
    job: int
    prompt_ids: list[list[int]]
    params: list[SamplingParams]  # one per choice; choice i continues prompt engine_core.prompt_of(i, ...)


class AbortJob(msgspec.Struct, tag=True):
    job: int


class StopChoice(msgspec.Struct, tag=True):
    """The front found a stop string in the choice's text."""

    job: int
    choice: int


class Shutdown(msgspec.Struct, tag=True):
    pass


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


class JobFailed(msgspec.Struct, tag=True):
    job: int
    status: int
    message: str


class ChoiceOutput(msgspec.Struct):
    """A choice's new tokens from one step (its logprobs too, if it asked)."""

    job: int
    choice: int
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with its first token


class Outputs(msgspec.Struct, tag=True):
    outputs: list[ChoiceOutput]
    snapshot: EngineSnapshot


class Fatal(msgspec.Struct, tag=True):
    """The engine cannot go on (a stage process died, a bug); the process exits after sending it."""

    message: str


ToEngine = Union[AddJob, AbortJob, StopChoice, Shutdown]
ToFront = Union[Ready, JobAdmitted, JobRejected, JobFailed, Outputs, Fatal]


# -- the engine process ----------------------------------------------------------------------------


class EngineLoop:
    """The engine process's main loop (see the module docstring)."""

    def __init__(self, engine, commands: zmq.Socket, results: zmq.Socket, stopping: threading.Event):
        self.engine, self.commands, self.results = engine, commands, results
        self.stopping = stopping  # set by SIGTERM
        self.core = EngineCore(engine)
        self.encoder, self.decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(ToEngine)
        self._sent: dict[int, int] = {}  # request id -> output tokens sent to the front
        self._parent = os.getppid()
        self._trim_heap = heap_trimmer()

    def send(self, message) -> None:
        self.results.send(self.encoder.encode(message))

    def run(self) -> int:
        self.send(Outputs([], self.core.snapshot()))  # /metrics has the engine's figures from the start
        stepped = False
        while True:
            idle = not self.engine.has_work()
            if idle and stepped:
                self._trim_heap()
                self.send(Outputs([], self.core.snapshot()))  # /metrics sees the engine at rest
                stepped = False
            if self.commands.poll(PARENT_CHECK_S * 1000 if idle else 0):
                for message in self._drain():
                    if isinstance(message, Shutdown):
                        self.stopping.set()
                        break
                    self._handle(message)
            if self.stopping.is_set():
                for key, failed in self.core.stop():
                    self.send(JobFailed(key, failed.status, failed.message))
                return 0
            if idle and os.getppid() != self._parent:
                logger.error("the front process is gone; the engine process stops")
                return 1
            if self.engine.has_work():
                self._step()
                stepped = True
            if self.engine.failure is not None:
                self.send(Fatal(str(self.engine.failure)))
                return 1

    def _drain(self) -> list:
        messages = []
        while True:
            try:
                messages.append(self.decoder.decode(self.commands.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return messages

    def _handle(self, message) -> None:
        if isinstance(message, AddJob):
            answer = self.core.add(message.job, message.prompt_ids, message.params)
            if isinstance(answer, Admitted):
                self.send(JobAdmitted(message.job, answer.prompt_tokens))
            elif isinstance(answer, Rejected):
                self.send(JobRejected(message.job, answer.message))
            else:
                self.send(JobFailed(message.job, answer.status, answer.message))
        elif isinstance(message, AbortJob):
            self.core.abort(message.job)
        elif isinstance(message, StopChoice):
            self.core.finish(message.job, message.choice, FinishReason.STOP)
            self.core.forget_finished([message.job])
        self._drop_sent_counts()

    def _drop_sent_counts(self) -> None:
        """Forget the counts of sequences whose job the core has forgotten (ended or aborted)."""
        for request_id in [r for r in self._sent if r not in self.core.owners]:
            del self._sent[request_id]

    def _step(self) -> None:
        updated, failed = self.core.step()
        outputs = []
        for key, choice, seq in updated:
            sent = self._sent.get(seq.request_id, 0)
            params = seq.params
            outputs.append(ChoiceOutput(
                key, choice, seq.output_ids[sent:], seq.finish_reason.value if seq.finished else None,
                seq.logprobs[sent : len(seq.output_ids)] if params.logprobs is not None else None,
                seq.prompt_logprobs if params.prompt_logprobs is not None and sent == 0 else None,
            ))
            self._sent[seq.request_id] = len(seq.output_ids)
        self.core.forget_finished({key for key, _, _ in updated})
        self._drop_sent_counts()
        self.send(Outputs(outputs, self.core.snapshot()))
        for key, answer in failed:
            self.send(JobFailed(key, answer.status, answer.message))


# What the engine process runs (not `-m`: this module is already imported with the graphrt.server
# package, and running it again as __main__ would make two copies of its classes).
ENGINE_PROCESS_MAIN = "import sys; from graphrt.server.engine_process import engine_process_main; sys.exit(engine_process_main())"


def engine_process_main() -> int:
    """The engine process: `python -c ENGINE_PROCESS_MAIN COMMANDS RESULTS`, with the LLM options and
    the cores to pin itself to (null: stay where it was started) as JSON on stdin."""
    logging.basicConfig(level=logging.WARNING, format="[graphrt engine] %(message)s")
    from graphrt.server.runner import warm_up  # the runner imports this module

    commands_address, results_address = sys.argv[1:3]
    launch = json.loads(sys.stdin.read())
    llm_kwargs, engine_cores = launch["llm_kwargs"], launch["engine_cores"]
    # Ctrl+C reaches the whole process group; the front decides when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stopping.set())  # as a Shutdown from the front
    context = zmq.Context()
    commands, results = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    commands.connect(commands_address)
    results.connect(results_address)
    results.setsockopt(zmq.LINGER, 5000)  # the last answers go out before the process exits
    encoder = msgspec.msgpack.Encoder()
    try:
        if engine_cores is not None:
            pin_process(engine_cores, "the engine process")
        import torch

        from graphrt.llm import LLM
        from graphrt.openmp import share_load_with

        if engine_cores is not None and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(len(engine_cores))
        if engine_cores is None:  # pinned, the front works on a core this process's load watch leaves out
            share_load_with(os.getppid())  # the front loads its tokenizer meanwhile: not a busy neighbour
        start = time.perf_counter()
        engine = LLM(**llm_kwargs, load_tokenizer=False).engine  # the front tokenizes
        banner = [
            f"[graphrt] load and capture {time.perf_counter() - start:.1f} s: {engine.model_dir.name}, {engine.describe()}, "
            f"buckets up to {engine.plan.max_batch}, {engine.config.max_num_seqs} sequences at once, "
            f"context {engine.max_model_len}, {engine.allocator.num_blocks - 1} KV blocks, engine in its own process",
            f"[graphrt] {engine.pipeline.matmul_summary()}",
            f"[graphrt] {engine.kernel_summary()}",
        ]
        start = time.perf_counter()
        warm_up(engine)
        banner.append(f"[graphrt] warm-up {time.perf_counter() - start:.1f} s")
    except Exception as exc:  # noqa: BLE001 - the front prints it as the reason start-up failed
        results.send(encoder.encode(Fatal(str(exc) if isinstance(exc, GraphrtError) else f"{type(exc).__name__}: {exc}")))
        return 1
    facts = EngineFacts(
        str(engine.model_dir), engine.max_model_len, engine.allocator.capacity_tokens, banner,
    )
    results.send(encoder.encode(Ready(facts)))
    try:
        return EngineLoop(engine, commands, results, stopping).run()
    except BaseException as exc:  # noqa: BLE001 - say why before the process ends
        logger.error("the engine process failed", exc_info=exc)
        results.send(encoder.encode(Fatal(f"internal error in the engine process ({type(exc).__name__}: {exc}); see its log")))
        return 1
    finally:
        engine.close()


# -- the front -------------------------------------------------------------------------------------


class _FrontJob:
    """A job as the front tracks it: the HTTP side's job and a mirror sequence per choice."""

    def __init__(self, job: GenerationJob, mirrors: list[Sequence]):
        self.job, self.mirrors = job, mirrors


class EngineClient:
    """The front's handle on the engine process: the same interface as `AsyncEngine`."""

    def __init__(self, llm_kwargs: dict, echo=print, placement: CpuPlacement | None = None):
        """Start the engine process and wait until it is loaded and warmed up. `placement`: where
        this process and the engine process run (graphrt.cpu_placement; `graphrt serve` plans it
        from --cpu-placement); None floats both over the cores this process may use."""
        # The model folder is settled first (the default model converted, once, on every core) so
        # that this process can load its tokenizer while the engine process loads the weights.
        model_dir = Path(llm_kwargs["model"]) if llm_kwargs.get("model") is not None else default_model_dir()
        self._folder = tempfile.TemporaryDirectory(prefix="graphrt-engine-")
        commands_address = f"ipc://{self._folder.name}/commands"
        results_address = f"ipc://{self._folder.name}/results"
        # Commands go out from whichever thread stops the server; results come in on the event loop.
        self._context, self._async_context = zmq.Context(), zmq.asyncio.Context()
        self._commands = self._context.socket(zmq.PUSH)
        self._commands.bind(commands_address)
        self._results = self._async_context.socket(zmq.PULL)
        self._results.bind(results_address)
        self._encoder, self._decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(ToFront)
        self.placement = placement or plan_cpu_placement("float", usable_cores())
        # Started before this process pins itself, so the engine process never runs on the front's core alone.
        self.process = subprocess.Popen(
            [sys.executable, "-c", ENGINE_PROCESS_MAIN, commands_address, results_address], stdin=subprocess.PIPE,
        )
        launch = {
            "llm_kwargs": {**llm_kwargs, "model": model_dir},
            "engine_cores": list(self.placement.engine_cores) if self.placement.pinned else None,
        }
        self.process.stdin.write(json.dumps(launch, default=str).encode())
        self.process.stdin.close()
        if self.placement.pinned:
            try:
                pin_process(self.placement.front_cores, "the server's front process")
            except BaseException:
                self._reap()
                self._close_sockets()
                raise
        loader = ThreadPoolExecutor(1, thread_name_prefix="graphrt-tokenizer")
        tokenizer = loader.submit(Tokenizer.from_dir, model_dir)
        loader.shutdown(wait=False)
        self.facts = self._wait_ready()  # the engine's errors first: a bad folder fails both, the engine says it better
        for line in self.facts.banner:
            echo(line)
        try:
            self.tokenizer = tokenizer.result()
        except BaseException:
            self._reap()
            self._close_sockets()
            raise
        self.max_model_len = self.facts.max_model_len
        self._prompts = PromptPreparer(
            self.tokenizer, self.max_model_len,
            lambda prompt_len, max_tokens: check_lengths(prompt_len, max_tokens, self.max_model_len, self.facts.capacity_tokens),
            Path(self.facts.model_dir).name,
        )
        self._outputs = OutputProcessor(self)  # detokenizing; calls self.finish at a stop string
        self._jobs: dict[int, _FrontJob] = {}
        self._ids = itertools.count()
        self._job_ids: dict[GenerationJob, int] = {}
        self._request_ids = itertools.count()
        self._owners: dict[int, tuple[int, int]] = {}  # mirror request id -> (job id, choice)
        self.snapshot = EngineSnapshot(0, 0, 0, 0, 0)
        self.accepting = False
        self.failure: GraphrtError | None = None
        self._tasks: list[asyncio.Task] = []
        self._send_lock = threading.Lock()
        self._shutdown_sent = False

    @property
    def model_dir(self) -> Path:
        return Path(self.facts.model_dir)

    def _wait_ready(self) -> EngineFacts:
        """Block until the engine process is loaded and warmed up (it prints its own progress)."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        socket = zmq.Socket.shadow(self._results.underlying)  # a blocking view of the same socket
        try:
            while time.monotonic() < deadline:
                if socket.poll(100):
                    message = self._decoder.decode(socket.recv())
                    if isinstance(message, Ready):
                        return message.facts
                    if isinstance(message, Fatal):
                        self._reap()
                        raise GraphrtError(message.message)
                if self.process.poll() is not None:
                    raise GraphrtError(f"the engine process exited with code {self.process.returncode} while starting; its output says why")
            raise GraphrtError(f"the engine process did not start within {STARTUP_TIMEOUT_S:.0f} s")
        except BaseException:  # including Ctrl+C during start-up
            self._reap()
            self._close_sockets()
            raise

    # -- the AsyncEngine interface ----------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.accepting = True
        self._tasks = [loop.create_task(self._receive()), loop.create_task(self._watch())]

    @property
    def healthy(self) -> bool:
        return self.accepting and self.failure is None and self.process.poll() is None

    async def prepare(self, job: GenerationJob) -> None:
        job.prompt_ids = await asyncio.to_thread(self._prompts.prompt_ids, job)

    def submit(self, job: GenerationJob) -> bool:
        if job.prompt_ids is None:
            raise ValueError("prepare the job before submitting it: the engine takes only token ids")
        if not self.healthy:
            return False
        job_id = next(self._ids)
        mirrors = []
        for choice, params in enumerate(job.params):
            mirror = Sequence(next(self._request_ids), job.prompt_ids[job.prompt_index(choice)], params, max_tokens=0)
            self._owners[mirror.request_id] = (job_id, choice)
            mirrors.append(mirror)
        self._jobs[job_id] = _FrontJob(job, mirrors)
        self._job_ids[job] = job_id
        self._send(AddJob(job_id, job.prompt_ids, job.params))
        return True

    def abort(self, job: GenerationJob) -> None:
        job_id = self._job_ids.get(job)
        if job_id is not None:
            self._forget(job_id)
            self._send(AbortJob(job_id))

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """The OutputProcessor found a stop string: end the choice here and in the engine."""
        seq.finish_reason = reason
        job_id, choice = self._owners[seq.request_id]
        self._send(StopChoice(job_id, choice))

    def stop(self) -> None:
        """Stop admitting; the engine answers every job in flight with a 503, then exits."""
        self.accepting = False
        if not self._shutdown_sent and self.process.poll() is None:
            self._shutdown_sent = True
            self._send(Shutdown())

    def join(self, timeout: float | None = None) -> None:
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.error("the engine process did not stop within %s s; killing it", timeout)
            self._reap()

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._reap()
        self._close_sockets()
        self._folder.cleanup()

    # -- the event loop's tasks --------------------------------------------------------------------

    def _send(self, message) -> None:
        with self._send_lock:
            try:
                self._commands.send(self._encoder.encode(message), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # the engine process is gone; the watcher fails what is in flight

    async def _receive(self) -> None:
        while True:
            message = self._decoder.decode(await self._results.recv())
            if isinstance(message, Outputs):
                self.snapshot = message.snapshot
                self._apply(message.outputs)
            elif isinstance(message, JobAdmitted):
                self._deliver(message.job, Admitted(message.prompt_tokens))
            elif isinstance(message, (JobRejected, JobFailed)):
                answer = Rejected(message.message) if isinstance(message, JobRejected) else Failed(message.status, message.message)
                self._deliver(message.job, answer)
                self._forget(message.job)
            elif isinstance(message, Fatal):
                self._fail(message.message)

    def _apply(self, outputs: list[ChoiceOutput]) -> None:
        now = time.perf_counter()
        touched: list[tuple[int, int, Sequence]] = []
        for output in outputs:
            front = self._jobs.get(output.job)
            if front is None:
                continue  # aborted here since
            mirror = front.mirrors[output.choice]
            if mirror.finished:
                continue  # ended at a stop string here; the engine's next tokens are dropped
            mirror.output_ids += output.token_ids
            if output.logprobs is not None:
                mirror.logprobs += output.logprobs
            if output.prompt_logprobs is not None:
                mirror.prompt_logprobs = output.prompt_logprobs
            if output.finish_reason is not None:
                mirror.finish_reason = FinishReason(output.finish_reason)
            touched.append((output.job, output.choice, mirror))
        texts = self._outputs.process([mirror for _, _, mirror in touched])
        for (job_id, choice, mirror), (_, text) in zip(touched, texts):
            self._jobs[job_id].job.updates.put_nowait(choice_update(choice, mirror, text, now))
        for job_id in {job_id for job_id, _, _ in touched}:
            front = self._jobs.get(job_id)
            if front is not None and all(mirror.finished for mirror in front.mirrors):
                self._forget(job_id)

    async def _watch(self) -> None:
        while self.process.poll() is None:
            await asyncio.sleep(WATCH_INTERVAL_S)
        await asyncio.sleep(WATCH_INTERVAL_S)  # the last messages it sent, first
        if self._shutdown_sent and self.process.returncode == 0:
            for job_id in list(self._jobs):  # anything the engine had not yet heard of
                self._deliver(job_id, Failed(503, "the server is shutting down; retry on another server"))
                self._forget(job_id)
            return
        self._fail(f"the engine process exited with code {self.process.returncode}; restart graphrt")

    def _fail(self, message: str) -> None:
        """The engine is gone (`message` says why and what to do): every job in flight gets a 503,
        and the server stops."""
        if self.failure is None:
            self.failure = GraphrtError(message)
            logger.error("%s; failing %d requests in flight", self.failure, len(self._jobs))
        self.accepting = False
        for job_id in list(self._jobs):
            self._deliver(job_id, Failed(503, str(self.failure)))
            self._forget(job_id)

    def _deliver(self, job_id: int, update) -> None:
        front = self._jobs.get(job_id)
        if front is not None:
            front.job.updates.put_nowait(update)

    def _forget(self, job_id: int) -> None:
        front = self._jobs.pop(job_id, None)
        if front is None:
            return
        self._job_ids.pop(front.job, None)
        for mirror in front.mirrors:
            self._owners.pop(mirror.request_id, None)
            self._outputs.forget(mirror)

    # -- clean-up ----------------------------------------------------------------------------------

    def _reap(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def _close_sockets(self) -> None:
        self._commands.close(linger=0)
        self._results.close(linger=0)
        self._context.term()
        self._async_context.term()

