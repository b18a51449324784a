"""Ranks sharing a GPU (bench/shared_gpu.py), and gpu-check's kill-and-recover run, on CPUs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import gpu_check

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / "shared_gpu.py"), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_script_runs_as_a_host_of_its_own_with_its_arguments(tmp_path):
    (tmp_path / "sibling.py").write_text("VALUE = 7\n")
    script = tmp_path / "train.py"
    script.write_text(
        "import json, os, sys\n"
        "import sibling\n"  # imported as if the script had been run directly
        "keys = ('NCCL_HOSTID', 'NCCL_P2P_DISABLE', 'NCCL_SHM_DISABLE', 'NCCL_NET')\n"
        "print(json.dumps({'argv': sys.argv[1:], 'sibling': sibling.VALUE, "
        "'main': __name__, **{k: os.environ.get(k) for k in keys}}))\n"
    )
    runs = [json.loads(_run(str(script), "--steps", "3").stdout) for _ in range(2)]
    for out in runs:
        assert out["argv"] == ["--steps", "3"] and out["sibling"] == 7 and out["main"] == "__main__"
        assert (out["NCCL_P2P_DISABLE"], out["NCCL_SHM_DISABLE"], out["NCCL_NET"]) == (
            "1",
            "1",
            "Socket",
        )
    assert runs[0]["NCCL_HOSTID"] != runs[1]["NCCL_HOSTID"]  # one host per process


def test_no_script_is_a_one_line_usage_error(tmp_path):
    for args in ((), (str(tmp_path / "missing.py"),)):
        proc = _run(*args)
        assert proc.returncode == 2 and proc.stdout == ""
        assert len(proc.stderr.strip().splitlines()) == 1 and "usage: " in proc.stderr
    assert "missing.py" in proc.stderr


def test_gpu_check_s_kill_and_recover_is_a_real_fault_run_and_bitwise(tmp_path):
    # The same run gpu-check makes on GPUs, here over gloo: the rank is killed, the spare
    # takes its place, the state comes back from peers, and the run ends bitwise equal.
    result = gpu_check._kill_and_recover(tmp_path, "tiny", steps=8)
    assert result["passed"] is True, result
    assert result["restored_from"] == "peers" and result["steps_lost"] >= 0
    assert set(result["phases_ms"]) >= {"detect", "interrupt", "communicators", "transfer"}
    assert Path(result["report"]).is_file() and (tmp_path / "kill-and-recover.log").is_file()
    logs = {p.name for p in (tmp_path / "kill-and-recover" / "logs").iterdir()}
    assert {"checkpointless-p2p-run-0.log", "checkpointless-p2p-run-1.log"} <= logs, logs
    (line,) = gpu_check._kill_lines(result)
    assert line.startswith(f"  kill + recover   {gpu_check.KILL}: bitwise; downtime ")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: it would run")
def test_a_check_s_failed_bench_raises_with_its_last_error_and_keeps_its_log(tmp_path):
    log = tmp_path / "replication.log"
    with pytest.raises(RuntimeError) as e:
        gpu_check._bench(["replicate", "--device", "cuda"], log, timeout_s=120)
    assert "p2p-bench replicate exited 2: " in str(e.value) and str(log) in str(e.value)
    assert "this machine has no CUDA device" in str(e.value)
    assert "this machine has no CUDA device" in log.read_text()
