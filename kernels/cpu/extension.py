"""The compiled CPU kernels (csrc/), built on first use into one extension library.

The kernels are torch ops under `torch.ops.graphrt`: paged decode attention
(paged_attention.py), the elementwise ops of a decoder layer (elementwise.py) and matmuls
against panel-packed weights (linear.py). They are built with torch.utils.cpp_extension (about
15 s with g++, once per machine) into $GRAPHRT_CACHE/cpu_kernels/<key>/ (default
~/.cache/graphrt), the key hashing everything the binary depends on: the sources, torch's
version, the compiler flags, and this CPU's flags. Where they can't be built (no compiler, no
ninja, a build error in any of the files), `available()` is False and `unavailable_reason()` says
why, so a caller can fall back to the torch references (and to F.linear or oneDNN for matmuls).
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

import torch

logger = logging.getLogger("graphrt")

CSRC = Path(__file__).parent / "csrc"
SOURCES = (
    CSRC / "paged_attention_cpu.cpp",
    CSRC / "elementwise_cpu.cpp",
    CSRC / "matmul_cpu.cpp",
    CSRC / "decode_layers_cpu.cpp",
    CSRC / "silu_and_mul.h",  # included by two of them: hashed and copied with them, not compiled alone
)


def default_cache_root() -> Path:
    """Under graphrt's cache folder, which GRAPHRT_CACHE moves (graphrt.model.default_model.cache_root,
    which this bottom layer does not import)."""
    return Path(os.environ.get("GRAPHRT_CACHE") or Path.home() / ".cache" / "graphrt") / "cpu_kernels"


EXTENSION_NAME = "graphrt_cpu_kernels"
NINJA_INTERRUPTED = "interrupted by user"  # what ninja says when a signal stops it ("build stopped: ...")
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
    """The outcome of building and loading the kernels: the library (its ops are registered
    under torch.ops.graphrt), or why there is none."""

    library: Path | None
    reason: str | None  # set exactly when library is None


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
    # No FMA contraction: the elementwise ops round each product before adding, as torch does.
    flags = ["-O3", "-ffp-contract=off", *CAPABILITY_FLAGS[capability]]
    if torch.backends.openmp.is_available():
        flags.append("-fopenmp")  # compile only: see the note on threads in paged_attention_cpu.cpp
    return flags


def build_key(sources: dict[str, str], flags: list[str]) -> str:
    parts = [f"{name}\0{text}" for name, text in sorted(sources.items())]
    parts += [torch.__version__, sys.version.split()[0], " ".join(flags), cpu_flags()]
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


def build(source_paths: tuple[Path, ...], cache_root: Path) -> Build:
    """Build (or find built) and load the kernels; never raises."""
    from torch.utils import cpp_extension

    missing = [str(path) for path in source_paths if not path.is_file()]
    if missing:
        return Build(None, f"the kernel source {missing[0]} is missing (an install without kernels/cpu/csrc)")
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
        sources = {path.name: path.read_text() for path in source_paths}
        flags = compile_flags(capability)
        key = build_key(sources, flags)
        build_dir = cache_root / key
        failed = build_dir / "build_error.log"
        if failed.is_file():  # the same source, flags, torch and CPU failed before: don't pay for it again
            return Build(None, f"the kernel did not build on an earlier try: {first_error_line(failed.read_text())} "
                         f"(full log: {failed}; delete {build_dir} to try again)")
        build_dir.mkdir(parents=True, exist_ok=True)
        if not (build_dir / f"{EXTENSION_NAME}_{key}.so").is_file():
            logger.warning("building the compiled CPU kernels in %s (once per machine, about 15 s)", build_dir)
        with build_lock(build_dir):
            # Build the text that was hashed, not the files in the tree, which someone may be
            # editing; rewritten only if it differs, since a newer file makes ninja rebuild.
            for name, text in sources.items():
                local_source = build_dir / name
                if not local_source.is_file() or local_source.read_text() != text:
                    local_source.write_text(text)
            library = cpp_extension.load(
                # cpp_extension renames a build whose inputs changed since the last one of that
                # name in this process (name_v1, ...): one name per key keeps each build's own.
                name=f"{EXTENSION_NAME}_{key}",
                sources=[str(build_dir / name) for name in sources if not name.endswith(".h")],
                extra_cflags=flags,
                build_directory=str(build_dir),
                is_python_module=False,
                verbose=False,
            )
    except Exception as error:  # noqa: BLE001 -- any failure means "fall back", with the reason kept
        if NINJA_INTERRUPTED in str(error):
            # Stopped from outside (a signal to this process group: Ctrl-C, a timeout), not a fault
            # of the build: kept as a failure, every later start would skip the kernels for good.
            return Build(None, f"the kernel build was interrupted ({first_error_line(str(error))}); the next start builds it again")
        log = build_dir / "build_error.log"
        with contextlib.suppress(OSError):
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text(str(error))
        return Build(None, f"the kernel did not build: {first_error_line(str(error))} (full log: {log})")
    return Build(Path(library), None)


class KernelLoader:
    """Builds and loads the kernels at most once, whichever thread asks first."""

    def __init__(self, source_paths: tuple[Path, ...] = SOURCES, cache_root: Path | None = None):
        self.source_paths = source_paths
        self.cache_root = cache_root  # None: default_cache_root() when the build happens
        self._lock = threading.Lock()
        self._build: Build | None = None

    def get(self) -> Build:
        with self._lock:
            if self._build is None:
                self._build = build(self.source_paths, self.cache_root or default_cache_root())
            return self._build


# The module's one piece of state: the process's build of the kernels, made on first use. One
# per process, since a process can register an op only once.
_LOADER = KernelLoader()


def extension() -> Build:
    """The process's build of the kernels: the library, or why there is none. Builds on first call."""
    return _LOADER.get()


def unavailable_reason(dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> str | None:
    """Why the kernels can't run here, for tensors of `dtype` on `device` if given; None when they
    can. Builds them on first call (about 15 s; then cached on disk for later processes).
    """
    if torch.device(device).type != "cpu":
        return f"the CPU kernels run on CPU tensors, not {torch.device(device).type}"
    if dtype is not None and dtype not in SUPPORTED_DTYPES:
        supported = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        return f"dtype {str(dtype).removeprefix('torch.')} is not supported ({supported} are)"
    return extension().reason


def available(dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> bool:
    """Whether the compiled kernels can run here (never raises; see `unavailable_reason`)."""
    return unavailable_reason(dtype, device) is None


__all__ = ["Build", "KernelLoader", "available", "extension", "unavailable_reason"]
