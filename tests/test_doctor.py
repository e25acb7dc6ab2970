"""`graphrt doctor` on this machine: it answers, whatever the machine has."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from graphrt.cli import main
from graphrt.doctor import Gpu, peer_table


def test_doctor_reports_versions_and_exits_zero():
    result = CliRunner().invoke(main, ["doctor"])
    assert result.exit_code == 0, result.output
    assert f"torch {torch.__version__}" in result.output
    assert "nsys:" in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_doctor_says_when_there_is_no_gpu():
    result = CliRunner().invoke(main, ["doctor"])
    assert "no CUDA GPU is visible to torch, so graphrt runs on the CPU" in result.output


def test_the_peer_table_reads_row_to_column():
    gpus = [Gpu(i, "G", 1, 1, (9, 0), None) for i in range(3)]
    access = {(i, j): (i, j) != (2, 0) for i in range(3) for j in range(3) if i != j}
    links = {(0, 1): "NVLink", (1, 0): "NVLink"}
    lines = peer_table(gpus, access, links)
    assert lines[0].split() == ["GPU0", "GPU1", "GPU2"]
    assert lines[1].split()[:4] == ["GPU0", "-", "P2P,", "NVLink"]
    assert "no P2P" in lines[3] and lines[3].index("no P2P") < lines[3].index("-")
