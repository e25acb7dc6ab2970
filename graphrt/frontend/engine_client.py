"""The front's handle on the engine process (graphrt.engine.process), as `graphrt serve` runs it by
default: the same interface as the in-thread `AsyncEngine`.

The front keeps its own state of each choice (RequestState) from the engine's deltas, turns
token ids into text with the `OutputProcessor` and ends a choice at a stop string by telling the
engine. If the engine process dies, every
request in flight gets a 503 and the server stops with a non-zero exit. Where the front and the
engine run is planned once, here, before anyone is pinned (graphrt.kernels.cpu.placement): the
engine process is started on every core and told its own; the front pins itself after the start.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import json
import logging
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from graphrt.engine.core import Admitted, EngineSnapshot, Failed, Rejected
from graphrt.engine.messages import (
    AbortJob,
    AddJob,
    EngineFacts,
    Fatal,
    JobAdmitted,
    JobFailed,
    JobRejected,
    Outputs,
    PrefixCacheReset,
    Ready,
    ResetPrefixCache,
    Shutdown,
    StopChoice,
    ToFront,
)
from graphrt.engine.process import ENGINE_PROCESS_MAIN
from graphrt.engine.scheduler import check_lengths
from graphrt.engine.sequence import SequenceOutput
from graphrt.errors import GraphrtError
from graphrt.frontend.async_engine import GenerationJob, PromptPreparer, choice_update
from graphrt.frontend.output_processor import OutputProcessor, RequestState
from graphrt.frontend.tokenizer import TokenizerLoading
from graphrt.kernels.cpu.placement import CpuPlacement, pin_process, plan_cpu_placement, usable_cores
from graphrt.model.default_model import model_dir_for

logger = logging.getLogger("graphrt.server")

STARTUP_TIMEOUT_S = 900.0  # loading and capturing a large model can take minutes
WATCH_INTERVAL_S = 0.1  # how often the front checks that the engine process is still there


class _FrontJob:
    """A job as the front tracks it: the HTTP side's job and the front's state of each choice."""

    def __init__(self, job: GenerationJob, states: list[RequestState]):
        self.job, self.states = job, states


class EngineClient:
    """The front's handle on the engine process: the same interface as `AsyncEngine`."""

    def __init__(self, llm_kwargs: dict, echo=print, placement: CpuPlacement | None = None):
        """Start the engine process and wait until it is loaded and warmed up. `placement`: where
        this process and the engine process run (graphrt.kernels.cpu.placement; `graphrt serve` plans it
        from --cpu-placement); None floats both over the cores this process may use."""
        # The model folder is settled first (the default model converted, once, on every core) so
        # that this process can load its tokenizer while the engine process loads the weights.
        model_dir = model_dir_for(llm_kwargs.get("model"))
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
        tokenizer = TokenizerLoading(model_dir)
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
        self._outputs = OutputProcessor(self.tokenizer)  # detokenizing, stop strings
        self._jobs: dict[int, _FrontJob] = {}
        self._ids = itertools.count()
        self._job_ids: dict[GenerationJob, int] = {}
        self._request_ids = itertools.count()
        self._owners: dict[int, tuple[int, int]] = {}  # the front's request id of a choice -> (job id, choice)
        self.snapshot = EngineSnapshot(0, 0, 0, 0, 0)
        self.accepting = False
        self.failure: GraphrtError | None = None
        self._tasks: list[asyncio.Task] = []
        self._send_lock = threading.Lock()
        self._shutdown_sent = False
        self._resets: collections.deque[asyncio.Future] = collections.deque()  # reset_prefix_cache calls awaiting their answer, in order

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
        job.prompt_ids, job.params = await asyncio.to_thread(self._prompts.prepare, job)

    def submit(self, job: GenerationJob) -> bool:
        if job.prompt_ids is None:
            raise ValueError("prepare the job before submitting it: the engine takes only token ids")
        if not self.healthy:
            return False
        job_id = next(self._ids)
        states = []
        for choice, params in enumerate(job.params):
            state = self._outputs.add(next(self._request_ids), params)
            self._owners[state.request_id] = (job_id, choice)
            states.append(state)
        self._jobs[job_id] = _FrontJob(job, states)
        self._job_ids[job] = job_id
        self._send(AddJob(job_id, job.prompt_ids, job.params))
        return True

    def abort(self, job: GenerationJob) -> None:
        job_id = self._job_ids.get(job)
        if job_id is not None:
            self._forget(job_id)
            self._send(AbortJob(job_id))

    async def reset_prefix_cache(self) -> bool:
        """Engine.reset_prefix_cache, in the engine process; False once it is gone or stopping."""
        if self.failure is not None or not self.accepting:
            return False
        answer = asyncio.get_running_loop().create_future()
        self._resets.append(answer)
        self._send(ResetPrefixCache())
        return await answer

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
                answer = Rejected(message.message, message.code) if isinstance(message, JobRejected) else Failed(message.status, message.message)
                self._deliver(message.job, answer)
                self._forget(message.job)
            elif isinstance(message, PrefixCacheReset):
                self._resets.popleft().set_result(message.done)
            elif isinstance(message, Fatal):
                self._fail(message.message)

    def _apply(self, outputs: list[tuple[int, int, SequenceOutput]]) -> None:
        now = time.perf_counter()
        deltas = []
        for job_id, choice, output in outputs:
            front = self._jobs.get(job_id)
            if front is None:
                continue  # aborted here since
            deltas.append(dataclasses.replace(output, request_id=front.states[choice].request_id))
        # A choice a stop string ended here drops the engine's tokens that were already on the way.
        states, stopped = self._outputs.process(deltas)
        for request_id in stopped:
            self._send(StopChoice(*self._owners[request_id]))
        for state in states:
            job_id, choice = self._owners[state.request_id]
            self._jobs[job_id].job.updates.put_nowait(choice_update(choice, state, now))
        for job_id in {self._owners[state.request_id][0] for state in states}:
            front = self._jobs.get(job_id)
            if front is not None and all(state.finished for state in front.states):
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
        while self._resets:
            self._resets.popleft().set_result(False)

    def _deliver(self, job_id: int, update) -> None:
        front = self._jobs.get(job_id)
        if front is not None:
            front.job.updates.put_nowait(update)

    def _forget(self, job_id: int) -> None:
        front = self._jobs.pop(job_id, None)
        if front is None:
            return
        self._job_ids.pop(front.job, None)
        for state in front.states:
            self._owners.pop(state.request_id, None)
            self._outputs.forget(state.request_id)

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
