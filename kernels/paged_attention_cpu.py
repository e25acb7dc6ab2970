"""Paged decode attention compiled for the CPU (reference: `paged_attention.paged_decode_attention`).

The kernel (csrc/paged_attention_cpu.cpp) reads K/V straight from the cache through the block
tables, where the reference first gathers them into a new tensor, and runs each (sequence, kv head)
on torch's intra-op threads. It is built on first use with torch.utils.cpp_extension (about 10 s
with g++) into ~/.cache/graphrt/cpu_kernels/<key>/, the key hashing everything the binary depends
on: the source, torch's version, the compiler flags, and this CPU's flags. Where it can't be
built (no compiler, no ninja, a build error), `available()` is False and `unavailable_reason()`
says why, so a caller can fall back to the reference.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import shlex
import shutil
import sys
import sysconfig
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

logger = logging.getLogger("graphrt")

SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"


def default_cache_root() -> Path:
    """Under graphrt's cache folder, which GRAPHRT_CACHE moves (graphrt.default_model.cache_root,
    which this bottom layer does not import)."""
    return Path(os.environ.get("GRAPHRT_CACHE") or Path.home() / ".cache" / "graphrt") / "cpu_kernels"
EXTENSION_NAME = "graphrt_paged_attention_cpu"
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float64)

# The -m flags torch's own kernels of each capability are built with (as inductor's cpu_vec_isa);
# with these rather than -march=native a build is valid on any CPU of its capability. The key
# still hashes the CPU's flags, so no build is ever shared between two kinds of CPU.
CAPABILITY_FLAGS = {
    "AVX512": ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512dq", "-mavx512vl",
               "-mavx512bw", "-mfma"],
    "AVX2": ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"],
}


@dataclass(frozen=True)
class Build:
    """The outcome of building and loading the kernel: the op, or why there is none."""

    op: Callable[..., torch.Tensor] | None  # torch.ops.graphrt.paged_decode_attention
    reason: str | None  # set exactly when op is None
    library: Path | None = None


def cpu_flags() -> str:
    """The `flags` line of /proc/cpuinfo (what this CPU can execute), else the processor's name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "flags":
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def compile_flags(capability: str) -> list[str]:
    flags = ["-O3", *CAPABILITY_FLAGS[capability]]
    if torch.backends.openmp.is_available():
        flags.append("-fopenmp")  # compile only: see the note on threads at the top of the .cpp file
    return flags


def build_key(source: str, flags: list[str]) -> str:
    parts = [source, torch.__version__, sys.version.split()[0], " ".join(flags), cpu_flags()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


@contextlib.contextmanager
def build_lock(build_dir: Path):
    """Holds an exclusive lock on `build_dir` across processes; the OS drops it if the holder dies.

    cpp_extension's own lock (a `lock` file created with O_EXCL) is left behind by a builder that
    is killed, and then every later process waits on it forever. Under this lock no other process
    of ours is building here, so such a file is stale and is removed.
    """
    with open(build_dir / "build.lock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def first_error_line(message: str) -> str:
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]  # the compiler's or linker's own diagnostics
    return (errors or lines or ["no output"])[0][:200]


def build(source_path: Path, cache_root: Path) -> Build:
    """Build (or find built) and load the kernel; never raises."""
    from torch.utils import cpp_extension

    if not source_path.is_file():
        return Build(None, f"the kernel source {source_path} is missing (an install without kernels/csrc)")
    compiler = cpp_extension.get_cxx_compiler()  # $CXX, else c++
    try:
        program = shlex.split(compiler)[0] if compiler.strip() else ""
    except ValueError as error:  # an unbalanced quote in $CXX
        return Build(None, f"the C++ compiler {compiler!r} can't be read ({error}); fix CXX")
    if not program or shutil.which(program) is None:
        return Build(None, f"no C++ compiler: {compiler!r} is not on PATH (install g++, or set CXX)")
    scripts = sysconfig.get_path("scripts")  # pip's ninja (a dependency) lands beside this Python
    if not cpp_extension.is_ninja_available() and (Path(scripts) / "ninja").is_file():
        os.environ["PATH"] = os.pathsep.join([scripts, os.environ.get("PATH", "")])  # a venv run without activating it
    if not cpp_extension.is_ninja_available():
        return Build(None, "ninja is not on PATH (torch.utils.cpp_extension builds with it: pip install ninja)")
    capability = torch.backends.cpu.get_cpu_capability()  # what torch dispatches its own kernels to
    if capability not in CAPABILITY_FLAGS:
        # Its portable build (ATen's scalar Vectorized) measured 10-20x slower than with AVX2.
        return Build(None, f"torch reports CPU capability {capability}; the kernel is built for AVX2 or AVX-512 "
                     "only and would be slower than the reference without them")
    build_dir = cache_root  # until the key is known
    try:
        source = source_path.read_text()
        flags = compile_flags(capability)
        key = build_key(source, flags)
        build_dir = cache_root / key
        failed = build_dir / "build_error.log"
        if failed.is_file():  # the same source, flags, torch and CPU failed before: don't pay for it again
            return Build(None, f"the kernel did not build on an earlier try: {first_error_line(failed.read_text())} "
                         f"(full log: {failed}; delete {build_dir} to try again)")
        build_dir.mkdir(parents=True, exist_ok=True)
        if not (build_dir / f"{EXTENSION_NAME}_{key}.so").is_file():
            logger.warning("building the compiled CPU decode attention in %s (once per machine, about 10 s)", build_dir)
        with build_lock(build_dir):
            # Build the text that was hashed, not the file in the tree, which someone may be
            # editing; rewritten only if it differs, since a newer file makes ninja rebuild.
            local_source = build_dir / source_path.name
            if not local_source.is_file() or local_source.read_text() != source:
                local_source.write_text(source)
            library = cpp_extension.load(
                # cpp_extension renames a build whose inputs changed since the last one of that
                # name in this process (name_v1, ...): one name per key keeps each build's own.
                name=f"{EXTENSION_NAME}_{key}",
                sources=[str(local_source)],
                extra_cflags=flags,
                build_directory=str(build_dir),
                is_python_module=False,
                verbose=False,
            )
    except Exception as error:  # noqa: BLE001 -- any failure means "fall back", with the reason kept
        log = build_dir / "build_error.log"
        with contextlib.suppress(OSError):
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text(str(error))
        return Build(None, f"the kernel did not build: {first_error_line(str(error))} (full log: {log})")
    return Build(torch.ops.graphrt.paged_decode_attention, None, Path(library))


class KernelLoader:
    """Builds and loads the kernel at most once, whichever thread asks first."""

    def __init__(self, source_path: Path = SOURCE, cache_root: Path | None = None):
        self.source_path = source_path
        self.cache_root = cache_root  # None: default_cache_root() when the build happens
        self._lock = threading.Lock()
        self._build: Build | None = None

    def get(self) -> Build:
        with self._lock:
            if self._build is None:
                self._build = build(self.source_path, self.cache_root or default_cache_root())
            return self._build


# The module's one piece of state: the process's build of the kernel, made on first use. One
# per process, since a process can register the op only once.
_LOADER = KernelLoader()


def kernel_build() -> Build:
    """The process's build of the kernel: the op, or why there is none. Builds on first call."""
    return _LOADER.get()


def unavailable_reason(dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> str | None:
    """Why the kernel can't run here, for tensors of `dtype` on `device` if given; None when it can.

    Builds the kernel on first call (about 10 s; then cached on disk for later processes).
    """
    if torch.device(device).type != "cpu":
        return f"the CPU kernel runs on CPU tensors, not {torch.device(device).type}"
    if dtype is not None and dtype not in SUPPORTED_DTYPES:
        supported = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        return f"dtype {str(dtype).removeprefix('torch.')} is not supported ({supported} are)"
    return kernel_build().reason


def available(dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> bool:
    """Whether `paged_decode_attention` can run here (never raises; see `unavailable_reason`)."""
    return unavailable_reason(dtype, device) is None


def check_inputs(q, k_cache, v_cache, block_tables, seq_lens) -> None:
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables, "seq_lens": seq_lens}
    off_cpu = [name for name, tensor in tensors.items() if tensor.device.type != "cpu"]
    if off_cpu:
        raise ValueError(f"paged_decode_attention (CPU kernel): {', '.join(off_cpu)} not on the CPU; "
                         "use the Triton kernels on CUDA")
    if q.dtype not in SUPPORTED_DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"paged_decode_attention (CPU kernel): q, k_cache, v_cache are {q.dtype}, {k_cache.dtype}, "
                         f"{v_cache.dtype}; they must share one of {SUPPORTED_DTYPES}")
    if block_tables.dtype not in (torch.int32, torch.int64) or seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError("paged_decode_attention (CPU kernel): block_tables and seq_lens must be int32 or int64, "
                         f"not {block_tables.dtype} and {seq_lens.dtype}")
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("paged_decode_attention (CPU kernel): q must be (batch, heads, head_dim) and both caches "
                         f"(num_blocks, block_size, kv_heads, head_dim); got {tuple(q.shape)}, "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """The contract of `paged_attention.paged_decode_attention` (shapes and semantics there).
    `max_seq_len` is not needed: the kernel reads each row's blocks up to its seq_lens entry.
    Raises RuntimeError with the reason where the kernel can't be built."""
    del max_seq_len
    check_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    kernel = kernel_build()
    if kernel.op is None:
        raise RuntimeError(f"the CPU paged attention kernel is unavailable: {kernel.reason}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()  # a full copy: callers should not need it
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    return kernel.op(q, k_cache, v_cache, block_tables, seq_lens, float(scale))


__all__ = ["Build", "KernelLoader", "available", "kernel_build", "paged_decode_attention", "unavailable_reason"]
