"""``launcher.local``: ranks forked from a server that imported torch once still write where
the parent writes now, and a hung group is diagnosable from that output."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from launcher.lifetime import alive
from launcher.local import WorkerGroupConfig, WorkerGroupError, rank_process, run_local
from tests.launcher import _local_workers

pytestmark = pytest.mark.slow

ALONE = WorkerGroupConfig(world_size=2, backend="none", timeout_s=120)


def test_a_rank_writes_to_the_parents_stderr_of_the_moment_it_starts(capfd):
    # The fork server may have started in an earlier test; if not, it starts here, while the
    # parent's stderr is not the one captured below.
    with capfd.disabled():
        assert run_local(_local_workers.say, ALONE, ("started",)) == [0, 1]
    assert run_local(_local_workers.say, ALONE, ("hello",)) == [0, 1]
    err = capfd.readouterr().err
    assert "hello from rank 0" in err and "hello from rank 1" in err, err


def test_a_rank_sees_the_parents_environment_of_the_moment_it_starts(monkeypatch):
    run_local(_local_workers.env_value, ALONE, ("P2P_LOCAL_PROBE",))  # the server is up now
    monkeypatch.setenv("P2P_LOCAL_PROBE", "set after the server started")
    got = run_local(_local_workers.env_value, ALONE, ("P2P_LOCAL_PROBE",))
    assert got == ["set after the server started"] * 2


def test_a_process_a_test_starts_itself_writes_there_too(capfd):
    process = rank_process(_local_workers.say_alone, ("hello",))
    process.start()
    process.join(timeout=120)
    assert process.exitcode == 0
    assert "hello from a process of its own" in capfd.readouterr().err


def test_a_hung_rank_dumps_its_stacks_where_the_parent_reads_before_it_is_killed(capfd):
    # One rank: the dumps of several would interleave on the one stderr.
    hung = WorkerGroupConfig(world_size=1, backend="none", timeout_s=5)
    with pytest.raises(WorkerGroupError, match=r"ranks \[0\] still running after 5s"):
        run_local(_local_workers.stuck_in_a_wait, hung)
    err = capfd.readouterr().err
    # faulthandler's dump: the function the rank was stuck in.
    assert "in stuck_in_a_wait" in err, err


def test_ranks_end_with_the_process_that_started_them_even_when_it_is_sigkilled(tmp_path):
    # Their parent is the fork server, which outlives it: they watch it themselves.
    origin = subprocess.Popen([sys.executable, "-m", "tests.launcher._local_workers", tmp_path])
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(pids := [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]) < 2:
            assert origin.poll() is None and time.monotonic() < deadline, "no ranks started"
            time.sleep(0.05)
        origin.kill()
        origin.wait()
        while left := [pid for pid in pids if alive(pid)]:
            assert time.monotonic() < deadline, f"ranks {left} outlived their parent"
            time.sleep(0.05)
    finally:
        origin.kill()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
