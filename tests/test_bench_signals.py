"""A p2p-bench run stopped from outside takes every process of its job with it: on SIGTERM
(``timeout``, a scheduler's cancel) it ends them as on Ctrl-C; SIGKILLed, its nodes are told
by the kernel (``PR_SET_PDEATHSIG``) and end their processes themselves."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.events import read_events
from launcher.lifetime import alive

pytestmark = pytest.mark.slow

DEADLINE_S = 60.0


def _job_pids(run_dir: Path) -> list[int]:
    """The ranks, spares and the coordinator of the job in ``run_dir``, once all have started
    (``[]`` until then)."""
    started = [e for e in read_events(run_dir) if e["event"] == "process_started"]
    coordinator = run_dir / "coordinator.json"
    if len(started) < 3 or not coordinator.exists():  # 2 ranks and the fault's spare
        return []
    return [int(e["pid"]) for e in started] + [json.loads(coordinator.read_text())["pid"]]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_bench_stopped_from_outside_leaves_no_process_of_its_job(tmp_path, sig):
    work = tmp_path / "work"
    bench = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.cli",
            "inject",
            "--model",
            "tiny",
            "--steps",
            "500",
            "--nnodes",
            "1",
            "--nproc-per-node",
            "2",
            "--fault",
            "kill:rank=1@step=400",
            "--no-reference",
            "--quiet",
            "--work-dir",
            str(work),
            "--out-dir",
            str(tmp_path / "report"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    pids: list[int] = []
    try:
        deadline = time.monotonic() + DEADLINE_S
        while not (pids := _job_pids(work / "checkpointless")):
            assert bench.poll() is None, bench.communicate()
            assert time.monotonic() < deadline, "the job's processes did not all start"
            time.sleep(0.1)
        bench.send_signal(sig)
        _, err = bench.communicate(timeout=DEADLINE_S)
        if sig == signal.SIGTERM:
            assert bench.returncode == 128 + signal.SIGTERM, err.decode()
            assert "p2p-bench: terminated" in err.decode()
        while left := [pid for pid in pids if alive(pid)]:
            assert time.monotonic() < deadline, f"still running after the bench ended: {left}"
            time.sleep(0.1)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
