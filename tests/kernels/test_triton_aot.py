"""scripts/triton_aot.py: what it records of a launch is what the JIT specializes on, and with the GPU
image's triton (3.6.0) the recorded variants compile for sm_90 (skipped with any other triton).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import BaseBackend  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import triton_aot  # noqa: E402


def specialization(value):
    return native_specialize_impl(BaseBackend, value, False, True, True)


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(torch.zeros(64, dtype=torch.bfloat16), id="aligned bf16 tensor"),
        pytest.param(torch.zeros(64, dtype=torch.float16)[3:], id="unaligned fp16 view"),
        pytest.param(torch.zeros(8, dtype=torch.int64), id="int64 tensor"),
        pytest.param(1, id="int 1 (a constant)"),
        pytest.param(4096, id="int multiple of 16"),
        pytest.param(97, id="int"),
        pytest.param(2**40 + 16, id="int64 multiple of 16"),
        pytest.param(1e-5, id="float"),
        pytest.param(True, id="bool"),
    ],
)
def test_a_recorded_argument_specializes_as_the_real_one(value):
    rebuilt = triton_aot.rebuild(triton_aot.describe(value, is_constexpr=False))
    assert specialization(rebuilt) == specialization(value)


def test_the_kernels_the_code_launches_are_found():
    names = triton_aot.kernel_names_in_code()
    assert "graphrt.kernels.rmsnorm_triton:_rms_norm_kernel" in names
    assert "graphrt.kernels.paged_attention_triton:_decode_split_kernel" in names
    assert not any(name.endswith(":_rotate_heads") for name in names)  # a helper, compiled into _rotary_kernel


def test_a_launch_is_recorded_not_run_and_the_split_count_is_the_gpus():
    from graphrt.kernels import paged_attention_triton

    recorder = triton_aot.LaunchRecorder(launch=False)
    real_getitem = triton.runtime.jit.KernelInterface.__getitem__
    real_splits = paged_attention_triton.default_num_splits
    try:
        recorder.install()
        triton_aot.split_counts_as_on_the_gpu()
        q = torch.randn(1, 32, 64, dtype=torch.bfloat16)
        cache = torch.zeros(65, 16, 8, 64, dtype=torch.bfloat16)
        tables = torch.arange(1, 65).view(1, 64)  # 1024 tokens wide
        paged_attention_triton.paged_decode_attention(q, cache, cache, tables, torch.tensor([100]), 0.125)
    finally:
        triton.runtime.jit.KernelInterface.__getitem__ = real_getitem
        paged_attention_triton.default_num_splits = real_splits
    launches = {entry["kernel"].split(":")[1]: entry for entry in recorder.launches.values()}
    # On a CPU tensor the default is one split; one sequence on 132 SMs gets several, merged after.
    assert set(launches) == {"_decode_split_kernel", "_decode_merge_kernel"}
    splits = launches["_decode_split_kernel"]["args"]["NUM_SPLITS"]["value"]
    assert splits > 1
    assert launches["_decode_merge_kernel"]["args"]["NUM_SPLITS"]["value"] == splits
    assert launches["_decode_split_kernel"]["args"]["q_ptr"] == {"tensor": "bfloat16", "aligned": True}


@pytest.mark.skipif(triton.__version__ != triton_aot.GPU_TRITON, reason=f"the GPU image's triton is {triton_aot.GPU_TRITON}")
def test_recorded_variants_compile_for_sm90(tmp_path, monkeypatch):
    from graphrt.kernels import rmsnorm_triton

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    recorder = triton_aot.LaunchRecorder(launch=False)
    real_getitem = triton.runtime.jit.KernelInterface.__getitem__
    try:
        recorder.install()
        x = torch.randn(4, 2048, dtype=torch.bfloat16)
        rmsnorm_triton.rms_norm(x, torch.ones(2048, dtype=torch.bfloat16), 1e-5, x.clone())
    finally:
        triton.runtime.jit.KernelInterface.__getitem__ = real_getitem
    variants, failures = triton_aot.compile_launches(list(recorder.launches.values()))
    assert failures == []
    assert [v["kernel"] for v in variants] == ["graphrt.kernels.rmsnorm_triton:_rms_norm_kernel"]
    assert any(path.suffix == ".cubin" for path in tmp_path.rglob("*"))
