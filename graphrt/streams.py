"""`Stream` and `Event`: the one abstraction the pipeline code sees.

On CUDA a stream is a `torch.cuda.Stream`: submitting work enqueues its kernels and returns at once.
On a CPU a stream is a worker thread that runs submitted callables in order; an event is set when
the worker passes it. torch releases the GIL inside its ops, so CPU stages really overlap.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

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


class CpuStream:
    """A worker thread running work in submission order. An error in one piece of work is kept and
    passed to every later event, so whoever waits learns of it instead of hanging."""

    def __init__(self, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            kind, payload = item
            if kind == "work":
                if self._error is None:
                    try:
                        payload()
                    except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                        self._error = exc
            elif kind == "wait":
                payload._done.wait()
                if payload.error is not None and self._error is None:
                    self._error = payload.error
            else:  # record
                payload._set(self._error)

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
    """Work is enqueued on the stage's stream as it is submitted; the host does not wait."""

    def __init__(self, device: torch.device):
        self.device = device
        self._stream = torch.cuda.Stream(device)

    def submit(self, work: Callable[[], None]) -> None:
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            work()

    def wait_event(self, event: CudaEvent) -> None:
        self._stream.wait_event(event._event)

    def record(self) -> CudaEvent:
        return CudaEvent(self._stream)

    def close(self, timeout_s: float = 30.0) -> None:
        self._stream.synchronize()


def make_stream(device: torch.device, name: str) -> CpuStream | CudaStream:
    return CudaStream(device) if device.type == "cuda" else CpuStream(name)
