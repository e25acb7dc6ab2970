"""`Stream` and `Event`: the one abstraction the pipeline code sees.

On CUDA a stream is a `torch.cuda.Stream`: submitting work enqueues its kernels and returns at once.
On a CPU a stream is a worker thread that runs submitted callables in order; an event is set when
the worker passes it. torch releases the GIL inside its ops, so CPU stages really overlap.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Protocol

import torch


class CpuEvent:
    def __init__(self):
        self._done = threading.Event()
        self.error: BaseException | None = None

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise self.error

    def _set(self, error: BaseException | None) -> None:
        self.error = error
        self._done.set()


class ThreadHooks(Protocol):
    """What a CPU stage's stream runs on its own thread (a CPU stage's OpenMP team sizer:
    graphrt.kernels.cpu.openmp.TeamSizer)."""

    def before_work(self) -> None:
        """Before each piece of work (the sizer fits the team to the cores other processes leave)."""

    def when_idle(self) -> None:
        """Once the stream has had no work for CpuStream.IDLE_S (the sizer lets the team's workers go)."""


class CpuStream:
    """A worker thread running work in submission order. An error in one piece of work is kept and
    passed to every later event, so whoever waits learns of it instead of hanging.

    Given a CUDA device (a stage in front of a remote link, which must send in order from one
    thread), the thread runs its work on that device and on a CUDA stream of its own, so nothing it
    computes queues behind another thread's work on the device's default stream.

    `hooks`, if given (a kernel set's stream_hook makes one per stream), run on the thread: before
    each piece of work, and once the queue has stayed empty IDLE_S after work, once per idle spell."""

    IDLE_S = 0.1

    def __init__(self, name: str, device: torch.device | None = None, hooks: ThreadHooks | None = None):
        self.hooks = hooks
        self._idle = True  # nothing has run since the thread started (or since when_idle ran)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._device = device
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            use_own_cuda_stream(self._device)
        except BaseException as exc:  # noqa: BLE001 - every later event carries it to its waiter
            self._error = exc
        while True:
            item = self._next()
            if item is None:
                return
            kind, payload = item
            if kind == "work":
                if self._error is None:
                    try:
                        if self.hooks is not None:
                            self.hooks.before_work()
                        payload()
                    except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                        self._error = exc
            elif kind == "wait":
                payload._done.wait()
                if payload.error is not None and self._error is None:
                    self._error = payload.error
            else:  # record
                payload._set(self._error)

    def _next(self):
        """The next item of the queue, waiting for it; after work, a wait past IDLE_S runs when_idle first."""
        if self.hooks is None or self._idle:
            item = self._queue.get()
        else:
            try:
                item = self._queue.get(timeout=self.IDLE_S)
            except queue.Empty:
                try:
                    self.hooks.when_idle()
                except BaseException as exc:  # noqa: BLE001 - the next event carries it to its waiter
                    self._error = self._error or exc
                self._idle = True
                item = self._queue.get()
        if item is not None and item[0] == "work":
            self._idle = False  # the next wait may end in when_idle
        return item

    def submit(self, work: Callable[[], None]) -> None:
        self._queue.put(("work", work))

    def wait_event(self, event: CpuEvent) -> None:
        self._queue.put(("wait", event))

    def record(self) -> CpuEvent:
        event = CpuEvent()
        self._queue.put(("record", event))
        return event

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish (or skip, after an error) the queued work, then stop the worker."""
        self._queue.put(None)
        self._thread.join(timeout=timeout_s)


class CudaEvent:
    def __init__(self, stream: torch.cuda.Stream):
        self._event = torch.cuda.Event()
        self._event.record(stream)

    def query(self) -> bool:
        return self._event.query()

    def synchronize(self) -> None:
        self._event.synchronize()


class CudaStream:
    """Work is enqueued on the stage's stream as it is submitted; the host does not wait.

    A new stream starts after the work already queued on its device's current stream (the KV
    cache zeroed after capture, weights copied in): torch's streams do not wait for it by themselves."""

    def __init__(self, device: torch.device):
        self.device = device
        self._stream = new_cuda_stream(device)

    def submit(self, work: Callable[[], None]) -> None:
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            work()

    def wait_event(self, event: CudaEvent) -> None:
        self._stream.wait_event(event._event)

    def record(self) -> CudaEvent:
        return CudaEvent(self._stream)

    def close(self, timeout_s: float = 30.0) -> None:
        self._stream.synchronize()


def use_own_cuda_stream(device: torch.device | None) -> None:
    """For the calling thread, which drives `device` from now on: make the device current and run
    on a new stream of it, which first waits for the work already queued there. Nothing to do for
    a CPU (or no) device."""
    if device is None or device.type != "cuda":
        return
    # The device is per thread (a new thread starts on cuda:0); "cuda" without an index means
    # the current one, which set_device refuses.
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.set_device(index)
    torch.cuda.set_stream(new_cuda_stream(torch.device("cuda", index)))


def new_cuda_stream(device: torch.device) -> torch.cuda.Stream:
    """A stream of `device` whose first work waits for everything already queued on the device."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    return stream


def make_stream(device: torch.device, name: str, hook: Callable | None = None) -> CpuStream | CudaStream:
    """The stream of a stage on `device`; `hook`: its kernel set's stream_hook (only a CPU stage has one)."""
    if device.type == "cuda":
        return CudaStream(device)
    return CpuStream(name, hooks=hook() if hook is not None else None)
