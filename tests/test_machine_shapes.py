"""Code whose behaviour depends on the machine (how many cores this process may use, how many GPUs
torch sees, how big the last-level cache is), each run on the branches this machine would not take
by itself: the machine is a parameter here, not luck. The server's core placement has its own file
(tests/kernels/cpu/test_cpu_placement.py); the ring depth and row split theirs (tests/runtime/test_decode_split.py)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

import graphrt.kernels.cpu.info
import graphrt.tools.doctor as doctor
from graphrt.config import EngineConfig, default_devices
from graphrt.distributed.transport import cpu_threads_per_stage
from graphrt.kernels.cpu.openmp import TeamSizer, affinity_cores
from graphrt.kernels.cpu.placement import usable_cores


@pytest.fixture
def affinity(monkeypatch):
    """Make this process look as if it may run on the given cores of a `cpu_count`-core machine
    (None: a platform without sched_getaffinity, macOS)."""

    def on(cores: set[int] | None, cpu_count: int | None = 64) -> None:
        monkeypatch.setattr(os, "cpu_count", lambda: cpu_count)
        if cores is None:
            monkeypatch.delattr(os, "sched_getaffinity", raising=False)
        else:
            monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(cores))

    return on


# -- cores ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("cores, cpu_count, expected", [
    ({0}, 64, [0]),
    ({0, 1}, 2, [0, 1]),
    ({9, 2, 7, 5}, 64, [2, 5, 7, 9]),  # a taskset mask: its cores, not the machine's
    (set(range(16)), 16, list(range(16))),
    (None, 8, list(range(8))),  # no sched_getaffinity: every core the machine has
    (None, None, [0]),  # and where even that is unknown, one
])
def test_usable_cores_are_the_affinity_mask_else_the_machine(affinity, cores, cpu_count, expected):
    affinity(cores, cpu_count)
    assert usable_cores() == expected
    assert affinity_cores() == len(expected)


def test_a_stage_threads_team_is_sized_against_the_cores_it_may_use(affinity):
    affinity({9, 2, 7, 5}, cpu_count=64)
    assert TeamSizer().num_cores == 4


def test_team_sizer_on_16_cores_gives_neighbours_their_cores_and_takes_them_back():
    clock = {"now": 100.0, "busy": 0.0, "own": 0.0}
    applied = []
    sizer = TeamSizer(clock=lambda: clock["now"], usage=lambda: (clock["busy"], clock["own"]),
                      apply=lambda n: applied.append(n) or True, num_cores=16)
    sizer.fit()
    sizer.max_threads = sizer.num_threads = 16  # torch's team on 16 cores, whatever it is in this process

    def run(seconds: float, own_cores: float, other_cores: float) -> None:
        clock["now"] += seconds
        clock["own"] += own_cores * seconds
        clock["busy"] += (own_cores + other_cores) * seconds
        sizer.fit()

    run(0.6, own_cores=12.0, other_cores=3.8)  # a neighbour on 4 cores
    assert applied == [12]
    run(0.6, own_cores=12.0, other_cores=0.0)  # gone
    assert applied == [12, 16] and sizer.num_threads == 16


@pytest.mark.parametrize("num_cores, world_size, threads", [
    (16, 1, 16), (16, 2, 8), (16, 3, 5), (15, 2, 7), (2, 2, 1), (1, 4, 1), (2, 1, 2),
])
def test_cpu_stage_processes_share_the_cores_between_them(num_cores, world_size, threads):
    assert cpu_threads_per_stage(world_size, num_cores) == threads


def test_cpu_stage_processes_count_the_cores_they_may_use_not_the_machines(affinity):
    """Under `taskset -c 2,5,7,9` (or a pinned engine process) on a 64-core machine, two stage
    processes get 2 threads each, not 32 each on 4 cores."""
    affinity({9, 2, 7, 5}, cpu_count=64)
    assert cpu_threads_per_stage(2) == 2


# -- GPUs ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("cuda, num_gpus, pp, devices", [
    (False, 0, 1, ["cpu"]),
    (False, 0, 3, ["cpu"] * 3),  # no CUDA: every stage on the CPU, whatever device_count says
    (True, 1, 1, ["cuda:0"]),
    (True, 1, 2, ["cuda:0"] * 2),  # fewer GPUs than stages: all on the first
    (True, 3, 4, ["cuda:0"] * 4),
    (True, 4, 4, ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]),
    (True, 8, 2, ["cuda:0", "cuda:1"]),  # more than enough: the first pp
])
def test_default_devices_follow_the_gpus_torch_sees(monkeypatch, cuda, num_gpus, pp, devices):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: num_gpus)
    assert default_devices(pp) == devices


@pytest.mark.parametrize("num_gpus, pp, ep, stage_devices, depth", [
    (0, 2, 1, ["cpu", "cpu"], 0),
    (0, 2, 2, ["cpu", "cpu"], 0),
    (2, 2, 1, ["cuda:0", "cuda:1"], 1),
    (2, 1, 2, ["cuda:0"], 0),
    (2, 2, 2, ["cuda:0", "cuda:1"], 1),  # fewer GPUs than ranks, one per stage: torchrun over hosts (alone, Cluster.start refuses it)
    (1, 2, 2, ["cuda:0", "cuda:0"], 0),  # fewer than stages: every stage on the first
    (4, 2, 1, ["cuda:0", "cuda:1"], 1),
    (4, 2, 2, ["cuda:0", "cuda:2"], 1),  # stage-major, rank r on cuda:r: stage 1's ranks on cuda:2 and cuda:3
    (4, 1, 4, ["cuda:0"], 0),
    (8, 2, 2, ["cuda:0", "cuda:2"], 1),
    (8, 2, 4, ["cuda:0", "cuda:4"], 1),
    (8, 4, 2, ["cuda:0", "cuda:2", "cuda:4", "cuda:6"], 1),
])
def test_stages_chosen_from_the_machine_are_placed_on_their_leaders_gpus(monkeypatch, num_gpus, pp, ep, stage_devices, depth):
    """Without --devices, rank r runs on cuda:r (a worker takes cuda:LOCAL_RANK), so under --ep
    stage s's leader is on cuda:s*ep: that is the device the banner names and the depth counts."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: num_gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: num_gpus)
    config = EngineConfig(pp=pp, ep=ep)
    assert config.stage_devices() == stage_devices
    assert config.depth == depth


@pytest.mark.parametrize("num_gpus", [0, 2, 4, 8])
@pytest.mark.parametrize("pp, ep, devices, stage_devices, depth", [
    (2, 1, ["cuda:1", "cuda:0"], ["cuda:1", "cuda:0"], 1),  # one per stage
    (2, 1, ["cuda:0", "cuda:0"], ["cuda:0", "cuda:0"], 0),
    (2, 2, ["cuda:0", "cuda:1", "cuda:2", "cuda:3"], ["cuda:0", "cuda:2"], 1),  # one per rank: each stage's leader
    (2, 2, ["cuda:3", "cuda:2", "cuda:1", "cuda:0"], ["cuda:3", "cuda:1"], 1),
    (1, 2, ["cuda:4", "cuda:5"], ["cuda:4"], 0),
    (2, 2, ["cpu"] * 4, ["cpu", "cpu"], 0),
])
def test_stages_given_devices_are_placed_on_their_leaders_whatever_the_machine(monkeypatch, num_gpus, pp, ep, devices, stage_devices, depth):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: num_gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: num_gpus)
    config = EngineConfig(pp=pp, ep=ep, devices=devices)
    assert config.stage_devices() == stage_devices
    assert config.depth == depth


@pytest.mark.parametrize(
    ("pp", "ep", "message"),
    [
        (2, 1, "--procs with --pp 2 needs 2 GPUs on this host .* found 1; drop --procs"),
        (1, 2, r"--procs with --pp 1 --ep 2 needs 2 GPUs on this host \(one per rank\), found 1$"),
        (2, 2, r"--procs with --pp 2 --ep 2 needs 4 GPUs on this host \(one per rank\), found 1$"),
    ],
)
def test_stage_processes_on_fewer_gpus_than_ranks_are_refused_before_any_starts(monkeypatch, pp, ep, message):
    from graphrt.distributed.remote import Cluster

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("RANK", raising=False)
    spawned = []
    monkeypatch.setattr("graphrt.distributed.remote.spawn_workers", lambda *args: spawned.append(args))
    config = SimpleNamespace(devices=["cuda:0", "cuda:1"] if ep == 1 else None, pp=pp, ep=ep, watchdog_s=30.0)
    with pytest.raises(ValueError, match=message):
        Cluster.start("unused", config)
    assert spawned == []


@pytest.mark.parametrize(
    ("pp", "ep", "devices", "message"),
    [
        (2, 2, ["cuda:0", "cuda:1", "cuda:0", "cuda:3"],
         r"^--devices puts ranks 0 and 2 on cuda:0 \(--pp 2 --ep 2: rank = stage \* ep \+ expert rank\), "
         r"but NCCL refuses two ranks on one GPU; give each rank a GPU of its own$"),
        (1, 4, ["cuda:1", "cuda", "cuda:1", "cuda:1"], r"^--devices puts ranks 0, 2 and 3 on cuda:1 "),
        (2, 1, ["cuda:0", "cuda"], r"^--devices puts ranks 0 and 1 on cuda:0 \(--procs: rank = stage\).*; or drop --procs"),  # "cuda" is cuda:0
    ],
)
def test_a_gpu_named_for_two_ranks_is_refused_before_any_starts(monkeypatch, pp, ep, devices, message):
    from graphrt.distributed.remote import Cluster, check_one_rank_per_gpu

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("RANK", raising=False)
    spawned = []
    monkeypatch.setattr("graphrt.distributed.remote.spawn_workers", lambda *args: spawned.append(args))
    config = EngineConfig(pp=pp, ep=ep, devices=devices, procs=True)
    with pytest.raises(ValueError, match=message):
        Cluster.start("unused", config)
    assert spawned == []
    check_one_rank_per_gpu(EngineConfig(pp=pp, ep=ep, devices=[f"cuda:{rank}" for rank in range(pp * ep)], procs=True))


@pytest.mark.parametrize("num_gpus", [0, 1, 2])
def test_doctor_reports_the_gpus_the_machine_has_by_count(monkeypatch, num_gpus):
    gpus = [doctor.Gpu(i, "Fake GPU", 80 << 30, 70 << 30, (9, 0), f"0000:0{i}:00.0") for i in range(num_gpus)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: num_gpus > 0)
    monkeypatch.setattr(doctor, "list_gpus", lambda: gpus)
    monkeypatch.setattr(doctor, "peer_access", lambda count: {(i, j): True for i in range(count) for j in range(count) if i != j})
    monkeypatch.setattr(doctor, "link_types", lambda gpus: ({(0, 1): "NVLink", (1, 0): "NVLink"}, None))
    lines = doctor.gpu_report()
    if num_gpus == 0:
        assert lines == ["  GPUs: no CUDA GPU is visible to torch, so graphrt runs on the CPU (one worker thread per stage)"]
        return
    assert f"  GPUs: {num_gpus}" in lines
    assert "  GPU0: Fake GPU, sm_90, 80.0 GiB (70.0 GiB free), PCI 0000:00:00.0" in lines
    if num_gpus == 1:
        assert lines[-1].startswith("  peer-to-peer: one GPU, no pairs")
    else:
        table = lines.index("  peer-to-peer access (row reads column's memory) and link:")
        assert lines[table + 2].split()[:4] == ["GPU0", "-", "P2P,", "NVLink"]  # after the column heads


# -- caches --------------------------------------------------------------------------------------


@pytest.mark.parametrize("levels, expected", [
    ({"index0": ("1", "48K"), "index2": ("2", "2048K"), "index3": ("3", "32768K")}, 32 << 20),
    ({"index3": ("3", "105M")}, 105 << 20),
    ({"index3": ("3", "1048576")}, 1 << 20),  # no unit: bytes
    ({"index0": ("1", "32K"), "index1": ("2", "1024K")}, 7 << 20),  # no L3 (some VMs, small cores): the default
    ({}, 7 << 20),  # no sysfs at all
])
def test_the_last_level_cache_size_is_read_from_sysfs_or_defaulted(tmp_path, levels, expected):
    for name, (level, size) in levels.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "level").write_text(level + "\n")
        (tmp_path / name / "size").write_text(size + "\n")
    assert graphrt.kernels.cpu.info.cpu_l3_bytes(default=7 << 20, cache_dir=tmp_path) == expected
