"""The engine in a process of its own, as `graphrt serve` runs it by default.

    front process: HTTP server, tokenizing, detokenizing  <-- ZMQ -->  engine process: scheduler, ring, stages

In one process the asyncio server, the detokenizer and the engine loop share one interpreter and
its GIL, so a burst of HTTP work delays the next micro-batch launch (vLLM's API server and
EngineCore, SGLang's tokenizer manager, scheduler and detokenizer are split the same way). Here
the engine process runs an `EngineCore` in a loop: it takes the commands waiting, steps the
engine, and sends the new token ids of every sequence that got one, one message per step
(graphrt.engine.messages). The front (graphrt.frontend.engine_client) turns token ids into text
and ends a choice at a stop string by telling the engine.

If the front dies, the engine process notices its parent gone and exits. Where it runs is planned
once, in the front (graphrt.kernels.cpu.placement): pinned, the engine process is started on every
core, told its own, and pins itself.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time

import msgspec
import zmq

from graphrt.engine.core import Admitted, EngineCore, Rejected, heap_trimmer
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
    ToEngine,
)
from graphrt.engine.sequence import FinishReason
from graphrt.errors import GraphrtError
from graphrt.kernels.cpu.placement import pin_process
from graphrt.logs import configure_logging

logger = logging.getLogger("graphrt.server")

PARENT_CHECK_S = 1.0  # how long an idle engine process, or a send, waits before checking that the front is still there


class FrontGone(Exception):
    """The front process exited: nobody reads this process's answers any more."""


class EngineLoop:
    """The engine process's main loop (see the module docstring)."""

    def __init__(self, engine, commands: zmq.Socket, results: zmq.Socket, stopping: threading.Event, front_pid: int):
        self.engine, self.commands, self.results = engine, commands, results
        self.stopping = stopping  # set by SIGTERM
        self.core = EngineCore(engine)
        self.encoder, self.decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(ToEngine)
        self._parent = front_pid
        self._trim_heap = heap_trimmer()

    def send(self, message) -> None:
        """Send to the front, checking every PARENT_CHECK_S that it is still there (the results
        socket's SNDTIMEO): a front killed mid-stream left a send blocked for good once a thousand
        step messages queued for it, and the engine holding its memory with it."""
        data = self.encoder.encode(message)
        while True:
            try:
                self.results.send(data)
                return
            except zmq.Again:
                self.check_front()

    def check_front(self) -> None:
        if os.getppid() != self._parent:
            raise FrontGone

    def run(self) -> int:
        try:
            return self._run()
        except FrontGone:
            logger.error("the front process is gone; the engine process stops")
            self.results.setsockopt(zmq.LINGER, 0)  # nobody reads what is queued: exit now, not after LINGER
            return 1

    def _run(self) -> int:
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
            self.check_front()  # every pass: a busy engine must notice too (a getppid is a fraction of a microsecond)
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
                self.send(JobRejected(message.job, answer.message, answer.code))
            else:
                self.send(JobFailed(message.job, answer.status, answer.message))
        elif isinstance(message, AbortJob):
            self.core.abort(message.job)
        elif isinstance(message, StopChoice):
            self.core.finish(message.job, message.choice, FinishReason.STOP)
            self.core.forget_finished([message.job])
        elif isinstance(message, ResetPrefixCache):
            self.send(PrefixCacheReset(self.engine.reset_prefix_cache()))

    def _step(self) -> None:
        updated, failed = self.core.step()
        self.core.forget_finished({key for key, _, _ in updated})
        self.send(Outputs(updated, self.core.snapshot()))
        for key, answer in failed:
            self.send(JobFailed(key, answer.status, answer.message))


def exit_without_front(front_pid: int) -> None:
    """Ends the process once its front is gone, whatever it is doing: loading the model (minutes,
    with no loop to notice), stepping, or blocked. The loop's own check (EngineLoop.check_front)
    stops it cleanly first where it can."""
    while os.getppid() == front_pid:
        time.sleep(PARENT_CHECK_S)
    time.sleep(PARENT_CHECK_S)  # the loop's clean exit, where it is in one
    logger.error("the front process is gone; the engine process stops")
    os._exit(1)


# What the engine process runs (not `-m`: the front's graphrt.frontend.engine_client imports this
# module, and running it again as __main__ would make two copies of its classes).
ENGINE_PROCESS_MAIN = "import sys; from graphrt.engine.process import engine_process_main; sys.exit(engine_process_main())"


def engine_process_main() -> int:
    """The engine process: `python -c ENGINE_PROCESS_MAIN COMMANDS RESULTS`, with the LLM options and
    the cores to pin itself to (null: stay where it was started) as JSON on stdin."""
    configure_logging("graphrt engine")
    commands_address, results_address = sys.argv[1:3]
    launch = json.loads(sys.stdin.read())
    llm_kwargs, engine_cores = launch["llm_kwargs"], launch["engine_cores"]
    # Ctrl+C and a closed terminal's SIGHUP reach the whole process group: the front decides
    # when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    front_pid = os.getppid()
    threading.Thread(target=exit_without_front, args=(front_pid,), name="graphrt-front-watch", daemon=True).start()
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stopping.set())  # as a Shutdown from the front
    context = zmq.Context()
    commands, results = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    commands.connect(commands_address)
    results.connect(results_address)
    results.setsockopt(zmq.LINGER, 5000)  # the last answers go out before the process exits
    results.setsockopt(zmq.SNDTIMEO, int(PARENT_CHECK_S * 1000))  # EngineLoop.send checks on the front this often
    encoder = msgspec.msgpack.Encoder()
    try:
        if engine_cores is not None:
            pin_process(engine_cores, "the engine process")
        import torch

        from graphrt.engine.startup import load_and_warm_up  # torch and the model: after pinning

        if engine_cores is not None and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(len(engine_cores))
        # Floating, the front loads its tokenizer beside this load: not a busy neighbour. (Pinned, it
        # works on a core this process's load watch leaves out.)
        colleagues = (os.getppid(),) if engine_cores is None else ()
        banner: list[str] = []
        engine = load_and_warm_up(llm_kwargs, banner.append, ", engine in its own process", load_colleagues=colleagues)
    except Exception as exc:  # noqa: BLE001 - the front prints it as the reason start-up failed
        results.send(encoder.encode(Fatal(str(exc) if isinstance(exc, (GraphrtError, ValueError)) else f"{type(exc).__name__}: {exc}")))
        return 1
    facts = EngineFacts(
        str(engine.model_dir), engine.max_model_len, engine.allocator.capacity_tokens, banner,
    )
    results.send(encoder.encode(Ready(facts)))
    try:
        return EngineLoop(engine, commands, results, stopping, front_pid).run()
    except BaseException as exc:  # noqa: BLE001 - say why before the process ends
        logger.error("the engine process failed", exc_info=exc)
        with contextlib.suppress(zmq.Again):  # a front that reads nothing more must not hide the error under another
            results.send(encoder.encode(Fatal(f"internal error in the engine process ({type(exc).__name__}: {exc}); see its log")))
        return 1
    finally:
        engine.close()
