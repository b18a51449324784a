"""``p2p-bench gpu-check`` on a machine without CUDA: one line, exit status 0."""

from __future__ import annotations

import json

import pytest
import torch

from bench.cli import main

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


def test_without_cuda_it_says_so_in_one_line(capsys, tmp_path) -> None:
    assert main(["gpu-check", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.strip().splitlines() == [
        "gpu-check: no CUDA device on this machine; nothing to check"
    ]
    assert main(["gpu-check", "--json", "--out", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out) == {"benchmark": "gpu-check", "cuda": False}


def test_bad_sizes_get_a_one_line_error(capsys) -> None:
    assert main(["gpu-check", "--mib", "0"]) == 2
    assert "argument --mib: 0 is below 1, the least it takes" in capsys.readouterr().err
