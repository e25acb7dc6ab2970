"""Stream ordering on CUDA, checked through the stream abstraction without a GPU.

torch's CUDA streams are replaced by a recorder (nothing real can run here): what matters is the
order of requests made to CUDA. A stage stream made after work was queued on its device (the KV
cache zeroed after capture) must wait for that work before its own; a thread that drives a device
(stage 0 in front of a remote link, the reply receiver) must make that device current and run on a
stream of its own, not on the default stream another thread computes on.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import pytest
import torch

from graphrt.runtime.streams import CpuStream, CudaStream, make_stream, use_own_cuda_stream


class FakeStream:
    def __init__(self, cuda: FakeCuda, name: str):
        self.cuda, self.name = cuda, name

    def wait_stream(self, other: FakeStream) -> None:
        self.cuda.log.append(("wait", self.name, other.name))

    def __repr__(self) -> str:
        return self.name


class FakeCuda:
    """Records what graphrt asks of torch.cuda, per thread: current device and stream."""

    def __init__(self):
        self.log: list[tuple] = []
        self.default = FakeStream(self, "default")
        self._local = threading.local()
        self._count = 0

    def Stream(self, device=None) -> FakeStream:  # noqa: N802 - stands in for torch.cuda.Stream
        self._count += 1
        stream = FakeStream(self, f"stream{self._count}")
        self.log.append(("new", stream.name, str(device)))
        return stream

    def current_stream(self, device=None) -> FakeStream:
        return getattr(self._local, "stream", self.default)

    def set_device(self, device) -> None:
        if isinstance(device, torch.device) and device.index is None:
            raise ValueError("Expected a torch.device with a specified index or an integer")  # as torch does
        self.log.append(("set_device", str(device), threading.current_thread().name))

    def current_device(self) -> int:
        return 0

    def set_stream(self, stream: FakeStream) -> None:
        self._local.stream = stream

    @contextmanager
    def stream(self, stream: FakeStream):
        previous = self.current_stream()
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = previous


def settled(event, safety_s: float = 30.0):
    """The event, once its worker passed it (a thread that died without passing it fails here
    instead of hanging the suite)."""
    assert event._done.wait(safety_s), "the stream's thread never reached the event"
    return event


@pytest.fixture
def fake_cuda(monkeypatch) -> FakeCuda:
    cuda = FakeCuda()
    for name in ("Stream", "current_stream", "current_device", "set_device", "set_stream", "stream"):
        monkeypatch.setattr(torch.cuda, name, getattr(cuda, name))
    return cuda


def test_a_stage_stream_starts_after_work_already_queued_on_its_device(fake_cuda):
    stream = CudaStream(torch.device("cuda:0"))
    # Its first entry is a wait for the device's current (default) stream, before any work of its own.
    assert fake_cuda.log == [("new", "stream1", "cuda:0"), ("wait", "stream1", "default")]
    assert stream._stream.name == "stream1"


def test_a_thread_driving_a_device_sets_it_and_runs_on_its_own_stream(fake_cuda):
    seen = []
    worker = CpuStream("graphrt-stage0", torch.device("cuda:1"))
    worker.submit(lambda: seen.append((threading.current_thread().name, fake_cuda.current_stream())))
    worker.record().synchronize()
    worker.close()
    assert fake_cuda.log == [
        ("set_device", "1", "graphrt-stage0"),  # the device is per thread: set in the thread itself
        ("new", "stream1", "cuda:1"),
        ("wait", "stream1", "default"),  # after what the main thread queued there
    ]
    # The work ran in that thread, on the new stream, not on the default one the main thread uses.
    assert [(thread, stream.name) for thread, stream in seen] == [("graphrt-stage0", "stream1")]


def test_cpu_threads_touch_no_cuda_state(fake_cuda):
    worker = CpuStream("graphrt-stage0", torch.device("cpu"))
    worker.submit(lambda: None)
    worker.record().synchronize()
    worker.close()
    use_own_cuda_stream(None)
    assert fake_cuda.log == []


def test_a_device_without_an_index_means_the_current_one(fake_cuda):
    worker = CpuStream("graphrt-stage0", torch.device("cuda"))
    settled(worker.record()).synchronize()
    worker.close()
    assert fake_cuda.log[0] == ("set_device", "0", "graphrt-stage0")


def test_a_thread_that_cannot_use_its_device_fails_its_waiters_instead_of_hanging(fake_cuda, monkeypatch):
    def refuse(device) -> None:
        raise RuntimeError("CUDA error: invalid device ordinal")

    monkeypatch.setattr(torch.cuda, "set_device", refuse)
    ran = []
    worker = CpuStream("graphrt-stage0", torch.device("cuda:7"))
    worker.submit(lambda: ran.append(True))
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        settled(worker.record()).synchronize()
    worker.close()
    assert ran == []  # nothing runs on a thread that is not on its device


@pytest.mark.parametrize("with_hook", [True, False], ids=["kernel set with a stream hook", "without (no OpenMP)"])
def test_a_cpu_stage_stream_runs_its_kernel_sets_hook_before_each_piece_of_work(with_hook):
    """KernelSet.stream_hook: fresh hooks per stream (a CPU stage's OpenMP team sizer), run on the
    stream's own thread before every piece of work; a set without one runs the work alone."""
    log: list[tuple[str, str]] = []
    made = []

    class Hooks:
        def before_work(self):
            log.append(("hook", threading.current_thread().name))

        def when_idle(self):
            pass

    def hook_factory():
        made.append(1)
        return Hooks()

    stream = make_stream(torch.device("cpu"), "graphrt-stage7", hook_factory if with_hook else None)
    for _ in range(2):
        stream.submit(lambda: log.append(("work", threading.current_thread().name)))
    stream.record().synchronize()
    stream.close()
    expected = [("hook", "graphrt-stage7"), ("work", "graphrt-stage7")] * 2 if with_hook else [("work", "graphrt-stage7")] * 2
    assert log == expected
    assert len(made) == int(with_hook)  # one function per stream, made when the stream is


def test_a_cpu_stage_stream_runs_its_hooks_when_idle_once_per_idle_spell(monkeypatch):
    """The hook's `when_idle` runs on the stream's thread once the queue has stayed empty IDLE_S after
    work: not before the first work, not while work keeps coming, once per idle spell; a record or a
    wait alone starts no spell."""
    monkeypatch.setattr(CpuStream, "IDLE_S", 0.05)
    log: list[tuple[str, str]] = []

    class Sizer:
        def before_work(self):
            log.append(("before", threading.current_thread().name))

        def when_idle(self):
            log.append(("idle", threading.current_thread().name))

    stream = make_stream(torch.device("cpu"), "graphrt-stage3", Sizer)
    idle = ("idle", "graphrt-stage3")

    def idle_count(after_s: float) -> int:
        threading.Event().wait(after_s)
        return log.count(idle)

    def reaches(count: int) -> bool:  # a loaded machine may run the thread late, never early
        deadline = time.monotonic() + 10
        while log.count(idle) < count and time.monotonic() < deadline:
            threading.Event().wait(0.01)
        return log.count(idle) == count

    assert idle_count(0.2) == 0  # no work yet: nothing to let go
    stream.record().synchronize()
    assert idle_count(0.2) == 0
    queued = threading.Event()
    stream.submit(lambda: queued.wait(10))  # the rest are queued before the first ends: no gap
    for _ in range(4):
        stream.submit(lambda: None)
    queued.set()
    stream.record().synchronize()
    assert reaches(1) and [kind for kind, _ in log] == ["before"] * 5 + ["idle"]  # not between them
    assert idle_count(0.2) == 1  # once per spell
    stream.submit(lambda: None)
    assert reaches(2)
    stream.close()
    assert log.count(("before", "graphrt-stage3")) == 6 and {name for _, name in log} == {"graphrt-stage3"}


def test_a_failing_idle_hook_fails_the_next_waiter_instead_of_killing_the_thread(monkeypatch):
    monkeypatch.setattr(CpuStream, "IDLE_S", 0.01)

    class Sizer:
        def before_work(self):
            pass

        def when_idle(self):
            raise RuntimeError("pause refused")

    stream = make_stream(torch.device("cpu"), "graphrt-stage4", Sizer)
    stream.submit(lambda: None)
    deadline = time.monotonic() + 10
    while stream._error is None and time.monotonic() < deadline:  # the hook runs once the queue idles
        threading.Event().wait(0.01)
    with pytest.raises(RuntimeError, match="pause refused"):
        stream.record().synchronize()
    stream.close()
