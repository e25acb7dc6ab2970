"""`graphrt doctor`: what this machine offers graphrt, in one screen.

Versions (torch, triton, CUDA, driver), the CPU (its bfloat16 instructions, the dtype `--dtype
auto` gives a CPU stage, and which matmul path a CPU stage would measure fastest per weight shape),
each GPU with its memory, which GPU pairs can read each other's memory directly (peer-to-peer) and
over what link (NVLink, or how far apart on PCIe), and whether Nsight Systems is installed. A
machine without a GPU is a normal answer, not an error. The GPUs come first: the CPU's
measurements take seconds (and build the compiled CPU kernels on first use); `--no-cpu` skips them.
"""

from __future__ import annotations

import platform
import shutil
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Callable

import torch

from graphrt.capture.buckets import CPU_DEFAULT_MAX_BATCH
from graphrt.capture.cuda_info import driver_version
from graphrt.config import EngineConfig
from graphrt.kernels.cpu.info import cpu_bf16_support, cpu_model_name
from graphrt.kernels.cpu.kernel_choice import LayerShapes, choose_cpu_kernels, choose_greedy_argmax
from graphrt.kernels.cpu.linear import PANEL_WIDTH
from graphrt.kernels.cpu.matmul_choice import measure_shapes
from graphrt.kernels.cpu.openmp import LoadWatch
from graphrt.profiling.nvtx import find_backend

GIB = 1 << 30

# The default model's (SmolLM2-135M-Instruct) matmul weights: name -> (out_features, in_features, how many).
DEFAULT_MODEL_MATMULS = {
    "qkv_proj": (960, 576, 30),
    "o_proj": (576, 576, 30),
    "gate_up_proj": (3072, 576, 30),
    "down_proj": (576, 1536, 30),
    "lm_head": (49152, 576, 1),
}
DEFAULT_MODEL_LAYER = LayerShapes(num_heads=9, num_kv_heads=3, head_dim=64, hidden_size=576, intermediate_size=1536)

# NVML topology levels as `nvidia-smi topo -m` names them, nearest first.
PCIE_LEVELS = {
    "TOPOLOGY_INTERNAL": "same board",
    "TOPOLOGY_SINGLE": "PIX (one PCIe switch)",
    "TOPOLOGY_MULTIPLE": "PXB (several PCIe switches)",
    "TOPOLOGY_HOSTBRIDGE": "PHB (through the host bridge)",
    "TOPOLOGY_NODE": "NODE (host bridges in one NUMA node)",
    "TOPOLOGY_SYSTEM": "SYS (across NUMA nodes)",
}


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    total_bytes: int
    free_bytes: int
    capability: tuple[int, int]
    pci_bus_id: str | None


def package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def pci_bus_id(index: int) -> str | None:
    from cuda.bindings import runtime

    err, raw = runtime.cudaDeviceGetPCIBusId(32, index)
    if err != runtime.cudaError_t.cudaSuccess:
        return None
    return bytes(raw).split(b"\0", 1)[0].decode()


def list_gpus() -> list[Gpu]:
    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        free, total = torch.cuda.mem_get_info(index)
        gpus.append(Gpu(index, props.name, total, free, (props.major, props.minor), pci_bus_id(index)))
    return gpus


def peer_access(num_gpus: int) -> dict[tuple[int, int], bool]:
    """(i, j) -> whether GPU i can read GPU j's memory directly (cudaDeviceCanAccessPeer)."""
    from cuda.bindings import runtime

    access = {}
    for i in range(num_gpus):
        for j in range(num_gpus):
            if i != j:
                err, can = runtime.cudaDeviceCanAccessPeer(i, j)
                access[i, j] = err == runtime.cudaError_t.cudaSuccess and bool(can)
    return access


def link_types(gpus: list[Gpu]) -> tuple[dict[tuple[int, int], str], str | None]:
    """(i, j) -> "NVLink" or the PCIe level between the two, from NVML; plus why it is empty, if it is.

    GPUs are matched to NVML by PCI bus id, since CUDA's numbering (CUDA_VISIBLE_DEVICES, fastest
    first) need not be NVML's."""
    try:
        from cuda.bindings import nvml
    except ImportError as exc:
        return {}, f"cuda.bindings.nvml is not available ({exc})"
    try:
        nvml.init_v2()
    except Exception as exc:  # noqa: BLE001 - NvmlError, or the driver library not found at all
        return {}, f"NVML did not start ({exc})"
    try:
        handles = {g.index: nvml.device_get_handle_by_pci_bus_id_v2(g.pci_bus_id) for g in gpus if g.pci_bus_id}
        links = {}
        for i, first in handles.items():
            for j, second in handles.items():
                if i == j:
                    continue
                try:
                    nvlink = nvml.device_get_p2p_status(first, second, nvml.GpuP2PCapsIndex.P2P_CAPS_INDEX_NVLINK)
                    if nvlink == nvml.GpuP2PStatus.P2P_STATUS_OK:
                        links[i, j] = "NVLink"
                        continue
                    level = nvml.GpuTopologyLevel(nvml.device_get_topology_common_ancestor(first, second))
                    links[i, j] = PCIE_LEVELS.get(level.name, level.name)
                except nvml.NvmlError as exc:
                    links[i, j] = f"unknown ({exc})"
        return links, None
    finally:
        nvml.shutdown()


def peer_table(gpus: list[Gpu], access: dict[tuple[int, int], bool], links: dict[tuple[int, int], str]) -> list[str]:
    """Row i, column j: can GPU i read GPU j's memory, and the link between them."""
    cells = {
        (i, j): "-" if i == j else ("P2P" if access[i, j] else "no P2P") + (f", {links[i, j]}" if (i, j) in links else "")
        for i in range(len(gpus)) for j in range(len(gpus))
    }
    width = max(len(c) for c in cells.values()) + 2
    lines = ["        " + "".join(f"GPU{j}".ljust(width) for j in range(len(gpus)))]
    for i in range(len(gpus)):
        lines.append(f"  GPU{i}  " + "".join(cells[i, j].ljust(width) for j in range(len(gpus))))
    return lines


NEIGHBOUR_WATCH_S = 0.3  # how long `cpu_report` watches other processes before timing anything


def cpu_report(measure: bool = True) -> list[str]:
    """The CPU, what `--dtype auto` gives a CPU stage, and the matmul paths a CPU stage of the
    default model would choose in each dtype worth running here (measured now, on random weights;
    that builds the compiled CPU kernels on first use and takes seconds: `measure=False` skips it)."""
    bf16 = cpu_bf16_support()
    auto = "bfloat16" if bf16 else "float32"
    lines = [
        f"  CPU: {cpu_model_name()}, {torch.get_num_threads()} torch threads, bfloat16 matmul instructions: "
        f"{bf16 or 'none (emulated: slow)'}; --dtype auto on the CPU gives {auto}",
    ]
    if not measure:
        return lines + ["  CPU matmul paths and kernels: not measured (--no-cpu)"]
    lines.append("  CPU matmul paths and kernels for the default model's shapes (random values, measured now):")
    # Timed as an engine would time them: on the team its stages would run beside what other
    # processes do now (graphrt.kernels.cpu.openmp.LoadWatch), watched while this process sits idle.
    watch = LoadWatch(window="just before")
    time.sleep(NEIGHBOUR_WATCH_S)
    with watch.timing_team() as note:
        for dtype in (torch.float32, torch.bfloat16) if bf16 else (torch.float32,):
            plan = measure_shapes(DEFAULT_MODEL_MATMULS, dtype, (1, CPU_DEFAULT_MAX_BATCH))
            lines.append(f"    {str(dtype).removeprefix('torch.')}: {plan.summary()}")
            # As a stage decides: SiLU-and-mul is timed only where gate/up does not end in it (in panels).
            gate_up_rows = DEFAULT_MODEL_MATMULS["gate_up_proj"][0]
            fused_silu = plan.by_name()["gate_up_proj"].path == "panel" and gate_up_rows % (2 * PANEL_WIDTH) == 0
            kernels = choose_cpu_kernels(
                DEFAULT_MODEL_LAYER, EngineConfig.block_size, dtype, torch.device("cpu"), CPU_DEFAULT_MAX_BATCH,
                fused_silu=fused_silu,
            )
            lines.append(f"    {str(dtype).removeprefix('torch.')}: {kernels.summary()}")
        vocab_size = DEFAULT_MODEL_MATMULS["lm_head"][0]
        lines.append(f"    {choose_greedy_argmax(torch.device('cpu'), vocab_size, CPU_DEFAULT_MAX_BATCH)[1]}")
    if note is not None:
        lines.append(f"    all {note}")
    return lines


def gpu_report() -> list[str]:
    """Each GPU with its memory, and which pairs read each other's memory directly, over what link."""
    if not torch.cuda.is_available():
        return ["  GPUs: no CUDA GPU is visible to torch, so graphrt runs on the CPU (one worker thread per stage)"]
    lines = []
    gpus = list_gpus()
    try:
        from cuda.bindings import nvml

        nvml.init_v2()
        lines.append(f"  NVIDIA driver {nvml.system_get_driver_version()}")
        nvml.shutdown()
    except Exception:  # noqa: BLE001 - the driver version is a nicety; the CUDA one is above
        pass
    lines.append(f"  GPUs: {len(gpus)}")
    for gpu in gpus:
        lines.append(f"  GPU{gpu.index}: {gpu.name}, sm_{gpu.capability[0]}{gpu.capability[1]}, {gpu.total_bytes / GIB:.1f} GiB "
                     f"({gpu.free_bytes / GIB:.1f} GiB free), PCI {gpu.pci_bus_id or 'unknown'}")
    if len(gpus) > 1:
        links, why_no_links = link_types(gpus)
        lines.append("  peer-to-peer access (row reads column's memory) and link:")
        lines += peer_table(gpus, peer_access(len(gpus)), links)
        if why_no_links:
            lines.append(f"  links unknown: {why_no_links}")
    else:
        lines.append("  peer-to-peer: one GPU, no pairs (with --pp N all stages share it, each on its own stream)")
    return lines


def run_doctor(echo: Callable[[str], None] = print, measure_cpu: bool = True) -> int:
    """Print the report, the GPUs before the CPU (whose measurements take seconds; `measure_cpu`
    False skips them); always 0 (a CPU-only machine is a valid place to run graphrt)."""
    cuda_build = torch.version.cuda or "none (CPU build)"
    echo("graphrt doctor")
    echo(f"  python {platform.python_version()} on {platform.system()} {platform.machine()}")
    echo(f"  torch {torch.__version__} (CUDA build: {cuda_build}), triton {package_version('triton')}, "
         f"cuda-python {package_version('cuda-python')}, nvtx {package_version('nvtx')}")
    nvtx = find_backend()
    echo(f"  NVTX ranges: {nvtx.why}" + ("" if nvtx.name == "none" else f"; {'on' if nvtx.enabled else 'off until a profiler attaches'}"))
    driver = driver_version()
    echo(f"  CUDA driver: {'supports CUDA ' + driver if driver else 'none found'}")
    for line in gpu_report():
        echo(line)
    nsys = shutil.which("nsys")
    echo(f"  nsys: {nsys}" if nsys else "  nsys: not on PATH (install Nsight Systems to take traces; see docs/profiling.md)")
    for line in cpu_report(measure=measure_cpu):
        echo(line)
    return 0
