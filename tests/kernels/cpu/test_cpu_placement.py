"""`--cpu-placement`: where the server's front and engine process run, planned once in the front
from the cores it may use (graphrt.kernels.cpu.placement), on every core count by parameter; and the pinned
layout run for real on this machine, whatever its core count."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from graphrt.kernels.cpu.placement import CpuPlacement, core_list, plan_cpu_placement

CORES = {1: [0], 2: [0, 1], 4: [0, 1, 2, 3], 16: list(range(16)), "sparse": [9, 2, 7, 5]}


PIN_LAYOUTS = [
    (CORES[2], (0,), (1,)),
    (CORES[4], (0,), (1, 2, 3)),
    (CORES[16], (0,), tuple(range(1, 16))),
    (CORES["sparse"], (2,), (5, 7, 9)),  # the first usable core, not core 0
]


@pytest.mark.parametrize("cores, front, engine", PIN_LAYOUTS, ids=["2", "4", "16", "sparse"])
def test_pin_puts_the_front_on_the_first_core_and_the_engine_on_the_rest(cores, front, engine):
    placement = plan_cpu_placement("pin", cores)
    assert (placement.mode, placement.front_cores, placement.engine_cores) == ("pin", front, engine)
    assert placement.pinned


@pytest.mark.parametrize("cores, front, engine", PIN_LAYOUTS[1:], ids=["4", "16", "sparse"])
def test_auto_pins_from_4_cores_as_pin_does(cores, front, engine):
    assert plan_cpu_placement("auto", cores).engine_cores == plan_cpu_placement("pin", cores).engine_cores == engine
    assert plan_cpu_placement("auto", cores).front_cores == front


def test_the_banner_says_where_each_process_runs_and_why():
    assert plan_cpu_placement("pin", CORES[16]).describe() == "cpu placement: pin (front on core 0, engine on cores 1-15)"
    assert plan_cpu_placement("auto", CORES[16]).describe() == (
        "cpu placement: pin (16 usable cores: front on core 0, engine on cores 1-15)")
    assert plan_cpu_placement("pin", CORES[2]).describe() == "cpu placement: pin (front on core 0, engine on core 1)"
    assert plan_cpu_placement("pin", CORES["sparse"]).describe() == "cpu placement: pin (front on core 2, engine on cores 5,7,9)"
    assert plan_cpu_placement("auto", CORES[2]).describe() == (
        "cpu placement: float (2 usable cores; pinning needs 4, or --cpu-placement pin)")
    assert plan_cpu_placement("float", CORES[16]).describe() == (
        "cpu placement: float (--cpu-placement float: front and engine share cores 0-15)")


@pytest.mark.parametrize("cores", [CORES[1], CORES[2], [0, 1, 2]], ids=["1", "2", "3"])
def test_auto_floats_below_4_cores(cores):
    placement = plan_cpu_placement("auto", cores)
    assert (placement.mode, placement.front_cores, placement.engine_cores) == ("float", tuple(cores), tuple(cores))
    assert not placement.pinned
    assert f"{len(cores)} usable core" in placement.reason


@pytest.mark.parametrize("cores", [CORES[1], CORES[2], CORES[4], CORES[16], CORES["sparse"]], ids=["1", "2", "4", "16", "sparse"])
def test_float_never_pins(cores):
    placement = plan_cpu_placement("float", cores)
    assert placement == CpuPlacement("float", tuple(sorted(cores)), tuple(sorted(cores)), placement.reason)


def test_pin_on_one_core_says_what_to_do_instead():
    with pytest.raises(ValueError, match=r"pin needs 2 usable cores.*may run on core 3 only; pass --cpu-placement float"):
        plan_cpu_placement("pin", [3])


@pytest.mark.parametrize("cores", [CORES[1], CORES[2], CORES[16]], ids=["1", "2", "16"])
def test_with_the_engine_on_a_thread_auto_floats_and_pin_is_refused(cores):
    placement = plan_cpu_placement("auto", cores, engine_process=False)
    assert (placement.mode, placement.engine_cores) == ("float", tuple(cores))
    assert "thread of the server's process" in placement.reason
    with pytest.raises(ValueError, match="--no-engine-process runs the engine in the front's process; drop one of the two"):
        plan_cpu_placement("pin", cores, engine_process=False)


def test_an_unknown_mode_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="'pinned' is not one of auto, pin, float"):
        plan_cpu_placement("pinned", CORES[4])


@pytest.mark.parametrize("cores, text", [
    ([3], "core 3"), ([0, 1], "cores 0-1"), ([1, 2, 3, 4], "cores 1-4"), ([9, 2, 7, 5, 8], "cores 2,5,7-9"), ([0, 2, 3], "cores 0,2-3"),
])
def test_core_lists_read_as_taskset_writes_them(cores, text):
    assert core_list(cores) == text


# -- the pinned layout, for real -----------------------------------------------------------------


def cpus_allowed(pid: int) -> dict[int, set[int]]:
    """Each thread of process `pid` -> the cores it may run on."""
    return {int(task.name): os.sched_getaffinity(int(task.name)) for task in Path(f"/proc/{pid}/task").iterdir()}


@pytest.mark.slow
def test_serve_pinned_on_this_machine_pins_both_processes_and_stops_cleanly_with_streams_in_flight():
    """--cpu-placement pin on however few cores this machine has (2 here): the engine process
    started on a one-core mask inherited from the pinned front, found no core left for itself and
    exited with EINVAL before the server ever served."""
    httpx = pytest.importorskip("httpx")
    from helpers import API_KEY, children_of, start_server

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("pinning needs 2 usable cores")
    proc, url, banner = start_server(max_batch=2, extra_args=("--cpu-placement", "pin"))
    try:
        assert banner[-3] == f"[graphrt] cpu placement: pin (front on {core_list(cores[:1])}, engine on {core_list(cores[1:])})"
        (engine_pid,) = children_of(proc.pid)
        for pid, expected in ((proc.pid, set(cores[:1])), (engine_pid, set(cores[1:]))):
            threads = cpus_allowed(pid)
            assert len(threads) > 1 and set(map(frozenset, threads.values())) == {frozenset(expected)}, (pid, threads)

        headers = {"Authorization": f"Bearer {API_KEY}"}
        bodies = [
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a story."}]}),
            ("/v1/completions", {"prompt": "Once upon a time"}),
        ]
        events = [[] for _ in bodies]
        first_token = [threading.Event() for _ in bodies]

        def stream(index: int) -> None:
            path, body = bodies[index]
            body = {**body, "max_tokens": 400, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url + path, json=body, headers=headers, timeout=60) as response:
                for line in response.iter_lines():
                    if line:
                        events[index].append(line)
                        first_token[index].set()

        readers = [threading.Thread(target=stream, args=(index,)) for index in range(len(bodies))]
        for reader in readers:
            reader.start()
        for index, started in enumerate(first_token):
            assert started.wait(30), f"stream {index} produced no token"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        for reader in readers:
            reader.join(10)
            assert not reader.is_alive()
        for stream_events in events:
            assert "shutting down" in stream_events[-2] and stream_events[-1] == "data: [DONE]", stream_events[-3:]
        assert "[graphrt] stopped" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_refuses_pin_with_the_engine_on_a_thread_before_loading_anything():
    pytest.importorskip("uvicorn")
    result = subprocess.run(
        [sys.executable, "-m", "graphrt", "serve", "--port", "0", "--cpu-placement", "pin", "--no-engine-process"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 1
    assert result.stderr.startswith("error: --cpu-placement pin places the front and the engine process apart")
    assert "Traceback" not in result.stderr + result.stdout and "load and capture" not in result.stdout


def test_serve_options_refuse_an_unknown_placement():
    pytest.importorskip("uvicorn")
    from graphrt.server import ServeOptions

    with pytest.raises(ValueError, match="cpu_placement 'pinned' is not one of auto, pin, float"):
        ServeOptions(cpu_placement="pinned")
