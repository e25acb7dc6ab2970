"""`graphrt doctor` on this machine: it answers, whatever the machine has."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from graphrt.cli import main
from graphrt.tools.doctor import Gpu, peer_table


@pytest.fixture(scope="module")
def doctor_run():
    """One `graphrt doctor` on this machine (it times the CPU: seconds), read by the tests below."""
    return CliRunner().invoke(main, ["doctor"])


def test_doctor_reports_versions_and_exits_zero(doctor_run):
    assert doctor_run.exit_code == 0, doctor_run.output
    assert f"torch {torch.__version__}" in doctor_run.output
    assert "nsys:" in doctor_run.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_doctor_says_when_there_is_no_gpu(doctor_run):
    assert "no CUDA GPU is visible to torch, so graphrt runs on the CPU" in doctor_run.output


def test_the_peer_table_reads_row_to_column():
    gpus = [Gpu(i, "G", 1, 1, (9, 0), None) for i in range(3)]
    access = {(i, j): (i, j) != (2, 0) for i in range(3) for j in range(3) if i != j}
    links = {(0, 1): "NVLink", (1, 0): "NVLink"}
    lines = peer_table(gpus, access, links)
    assert lines[0].split() == ["GPU0", "GPU1", "GPU2"]
    assert lines[1].split()[:4] == ["GPU0", "-", "P2P,", "NVLink"]
    assert "no P2P" in lines[3] and lines[3].index("no P2P") < lines[3].index("-")


def test_doctor_times_the_cpu_kernels_on_the_team_busy_neighbours_leave(monkeypatch):
    import threading

    import graphrt.tools.doctor as doctor
    from graphrt.kernels.cpu.openmp import LoadWatch, openmp_available

    if not openmp_available():
        pytest.skip("needs torch on libgomp")
    clock = {"now": 0.0, "busy": 0.0}

    def busy_neighbours() -> LoadWatch:  # /proc saying two busy loops took a core while doctor watched
        watch = LoadWatch(clock=lambda: clock["now"], usage=lambda: (clock["busy"], 0.0), window="just before")
        clock["now"] += 0.3
        clock["busy"] += 0.3
        return watch

    timed_on, keywords = [], []

    def spy(result):
        def record(*args, **kwargs):
            timed_on.append(torch.get_num_threads())
            keywords.append(kwargs)
            return result
        return record

    monkeypatch.setattr(doctor, "LoadWatch", lambda window: busy_neighbours())
    monkeypatch.setattr(doctor, "NEIGHBOUR_WATCH_S", 0.0)
    panel_gate_up = {"gate_up_proj": type("Choice", (), {"path": "panel"})()}  # so SiLU-and-mul is in its pass, untimed
    plan = type("Plan", (), {"summary": lambda self: "matmuls", "by_name": lambda self: panel_gate_up})()
    monkeypatch.setattr(doctor, "measure_shapes", spy(plan))
    monkeypatch.setattr(doctor, "choose_cpu_kernels", spy(type("Choice", (), {"summary": lambda self: "kernels"})()))
    monkeypatch.setattr(doctor, "choose_greedy_argmax", spy((None, "argmax")))
    box = {}

    def report():  # on a thread of its own, so this thread's team size is left alone
        torch.set_num_threads(2)
        box["lines"], box["after"] = doctor.cpu_report(), torch.get_num_threads()

    before = torch.get_num_threads()
    thread = threading.Thread(target=report)
    thread.start()
    thread.join()
    torch.set_num_threads(before)  # torch's default for new threads, as the suite had it
    assert timed_on and set(timed_on) == {1} and box["after"] == 2
    assert all(kw["fused_silu"] for kw in keywords if "fused_silu" in kw) and any("fused_silu" in kw for kw in keywords)
    assert box["lines"][-1] == "    all timed on 1 of 2 threads (other processes used 1.00 cores just before)"


def test_the_gpus_are_reported_before_the_cpu_is_timed(monkeypatch):
    """The CPU's measurements take seconds and build the CPU kernels: whoever ran doctor for the GPU
    reads about it first (one pretend GPU here)."""
    import graphrt.tools.doctor as doctor

    events = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(doctor, "list_gpus", lambda: [Gpu(0, "NVIDIA H200", 141 << 30, 140 << 30, (9, 0), "0000:01:00.0")])

    def timed(*args, **kwargs):
        events.append("CPU timed")
        raise SystemExit("enough: the order is what this test reads")

    monkeypatch.setattr(doctor, "measure_shapes", timed)
    monkeypatch.setattr(doctor, "NEIGHBOUR_WATCH_S", 0.0)
    with pytest.raises(SystemExit):
        doctor.run_doctor(echo=events.append)
    gpu_line = next(i for i, line in enumerate(events) if line.startswith("  GPU0: NVIDIA H200"))
    assert gpu_line < events.index("CPU timed")


def test_no_cpu_skips_the_cpu_measurements(monkeypatch):
    import graphrt.tools.doctor as doctor

    def refuse(*args, **kwargs):
        raise AssertionError("--no-cpu timed the CPU")

    for name in ("measure_shapes", "choose_cpu_kernels", "choose_greedy_argmax", "LoadWatch"):
        monkeypatch.setattr(doctor, name, refuse)
    result = CliRunner().invoke(main, ["doctor", "--no-cpu"])
    assert result.exit_code == 0, result.output
    assert "CPU matmul paths and kernels: not measured (--no-cpu)" in result.output
    assert "CPU: " in result.output and "nsys:" in result.output
