"""The copy rate the GPU benchmarks read their weight bandwidth against, beside the datasheet peak."""

from __future__ import annotations

import math

import torch

from graphrt.profiling.bandwidth import device_copy_gb_s


def test_the_copy_rate_counts_bytes_read_and_written(monkeypatch):
    """64 MiB copied in a (pretend) millisecond each time: 2 x 64 MiB per ms."""
    clock = iter(x / 1000 for x in range(100))
    monkeypatch.setattr("graphrt.profiling.bandwidth.time.perf_counter", lambda: next(clock))
    assert math.isclose(device_copy_gb_s(torch.device("cpu"), repeats=3), 2 * (1 << 26) / 1e-3 / 1e9)


def test_the_copy_rate_of_this_cpu_is_a_rate():
    assert 0 < device_copy_gb_s(torch.device("cpu"), repeats=2) < 10_000
