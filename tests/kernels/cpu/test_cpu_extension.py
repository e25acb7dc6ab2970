"""Building the compiled CPU kernels (kernels/cpu/extension.py): once per machine into the graphrt
cache, on torch's own OpenMP runtime, and where they can't be built, a reason instead of an error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from graphrt.kernels.cpu import extension as cpu_extension
from graphrt.kernels.cpu import paged_attention as paged_attention_cpu
from graphrt.kernels.cpu.kernel_choice import random_decode_inputs

needs_kernels = pytest.mark.usefixtures("built_cpu_kernels")  # tests/conftest.py


@needs_kernels
@pytest.mark.skipif(not torch.backends.openmp.is_available(), reason="torch is not built with OpenMP")
def test_runs_on_torchs_openmp_threads_and_no_other_runtime():
    """The library calls into OpenMP (so at::parallel_for really forks) but brings no runtime of
    its own: the only one in the process is the one torch loaded."""
    build = cpu_extension.extension()
    assert b"GOMP_parallel" in build.library.read_bytes(), "built without -fopenmp: parallel_for runs on one thread"
    q, k_cache, v_cache, block_tables, seq_lens, scale, _ = random_decode_inputs(8, 9, 3, 64, 16, torch.float32)
    paged_attention_cpu.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("no /proc/self/maps to list loaded libraries")
    runtimes = {line.split()[-1] for line in maps.read_text().splitlines() if "gomp" in line or "libomp" in line}
    torch_lib = Path(torch.__file__).parent / "lib"
    assert runtimes and all(Path(path).parent == torch_lib for path in runtimes), runtimes


def test_says_which_dtypes_and_devices_it_takes():
    assert not cpu_extension.available(torch.float16)
    assert "float16 is not supported" in cpu_extension.unavailable_reason(torch.float16)
    assert "CPU tensors" in cpu_extension.unavailable_reason(device="cuda")
    reason = cpu_extension.unavailable_reason(torch.bfloat16)
    assert cpu_extension.available(torch.bfloat16) == (reason is None)


def test_a_missing_compiler_is_a_reason_not_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    build = cpu_extension.KernelLoader(cache_root=tmp_path).get()
    assert build.library is None and "no C++ compiler" in build.reason and "no-such-g++" in build.reason


@needs_kernels
def test_a_build_error_is_a_reason_with_the_log_kept(tmp_path):
    broken = tmp_path / "broken.cpp"
    broken.write_text('#error "this kernel does not compile"\n')
    build = cpu_extension.KernelLoader(source_paths=(broken,), cache_root=tmp_path / "cache").get()
    assert build.library is None and "did not build" in build.reason and "does not compile" in build.reason
    log = Path(build.reason.rsplit("full log: ", 1)[1].rstrip(")"))
    assert "does not compile" in log.read_text()
    # The next process does not pay for the same failing build again; it says how to retry.
    again = cpu_extension.KernelLoader(source_paths=(broken,), cache_root=tmp_path / "cache").get()
    assert again.library is None and "earlier try" in again.reason and "does not compile" in again.reason
    assert f"delete {log.parent} to try again" in again.reason


def test_an_interrupted_build_is_not_kept_as_a_failure(tmp_path, monkeypatch):
    """A build stopped by a signal (Ctrl-C, a timeout killing the process group; seen when a test
    run was stopped mid-build) is no fault of the kernels: the next start builds them again rather
    than reading a failure log and running the references for good."""
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available() or torch.backends.cpu.get_cpu_capability() not in cpu_extension.CAPABILITY_FLAGS:
        pytest.skip("no build is tried on this machine")
    source = tmp_path / "kernel.cpp"
    source.write_text("int graphrt_test_kernel() { return 1; }\n")

    def interrupted(**kwargs):
        raise RuntimeError("Error building extension 'x': ninja: build stopped: interrupted by user.")

    monkeypatch.setattr(cpp_extension, "load", interrupted)
    build = cpu_extension.KernelLoader(source_paths=(source,), cache_root=tmp_path / "cache").get()
    assert build.library is None and "interrupted" in build.reason and "builds it again" in build.reason
    assert not list((tmp_path / "cache").rglob("build_error.log"))
    calls = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: calls.append(kwargs) or str(tmp_path / "lib.so"))
    again = cpu_extension.KernelLoader(source_paths=(source,), cache_root=tmp_path / "cache").get()
    assert calls and again.library == tmp_path / "lib.so"  # tried again, not skipped


def test_an_unreadable_cxx_is_a_reason_not_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "g++ 'unbalanced")
    build = cpu_extension.KernelLoader(cache_root=tmp_path).get()
    assert build.library is None and "can't be read" in build.reason and "fix CXX" in build.reason


def test_the_build_goes_under_graphrt_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHRT_CACHE", str(tmp_path))
    assert cpu_extension.default_cache_root() == tmp_path / "cpu_kernels"
