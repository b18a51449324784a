"""A p2p-bench run stopped by SIGTERM (``timeout``, ``kill``, a scheduler's cancel) ends every
process of its job as on Ctrl-C. (SIGKILLed, its job's nodes are told by the kernel: that is
``LocalJob``'s, tests/launcher/test_p2p_run.py.)"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.events import read_events
from tests.jobs import running_in_session

pytestmark = pytest.mark.slow

DEADLINE_S = 60.0


def _all_started(run_dir: Path) -> bool:
    """Whether the job's 2 ranks, the fault's spare and the coordinator have started."""
    started = [e for e in read_events(run_dir) if e["event"] == "process_started"]
    return len(started) == 3 and (run_dir / "coordinator.json").exists()


def test_a_terminated_bench_leaves_no_process_of_its_job(tmp_path):
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
    try:
        deadline = time.monotonic() + DEADLINE_S
        while not _all_started(work / "checkpointless"):
            assert bench.poll() is None, bench.communicate()
            assert time.monotonic() < deadline, "the job's processes did not all start"
            time.sleep(0.1)
        bench.send_signal(signal.SIGTERM)
        _, err = bench.communicate(timeout=DEADLINE_S)
        assert bench.returncode == 128 + signal.SIGTERM, err.decode()
        assert "p2p-bench: terminated" in err.decode()
        # The bench's p2p-run nodes, their coordinator, ranks and spare: all in its session.
        while left := running_in_session(bench.pid):
            assert time.monotonic() < deadline, f"still running after the bench ended: {left}"
            time.sleep(0.1)
    finally:  # whatever a failure left behind is in the bench's session
        with contextlib.suppress(ProcessLookupError):
            os.killpg(bench.pid, signal.SIGKILL)
        bench.wait()
