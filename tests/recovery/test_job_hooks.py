"""``P2P_JOB_HOOKS``: a tool attaches hooks to a protected script it did not write."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.probe import final_digest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "user_train.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_alone(env: dict[str, str], *args: str, world_size: int = 2) -> list[Run]:
    """The script's ranks without p2p-run (a plain gloo group from the environment)."""
    common = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), **env}
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), *args],
            env={**common, "RANK": str(rank), "WORLD_SIZE": str(world_size)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world_size)
    ]
    try:
        return [Run(p.wait(timeout=120), p.stderr.read()) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.stderr.close()


@dataclass
class Run:
    returncode: int
    stderr: str


def test_the_probe_records_every_batch_and_the_final_digest(tmp_path):
    env = {"P2P_JOB_HOOKS": "bench.probe:attach", "P2P_PROBE_DIR": str(tmp_path)}
    assert all(r.returncode == 0 for r in _run_alone(env, "--steps", "3")), "the script failed"
    record = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in record:
        assert r["step"] == 3 and sorted(r["steps"]) == ["1", "2", "3"]
    batches = [s["batch"] for r in record for s in r["steps"].values()]
    assert len(set(batches)) == 6 and all(batches)  # every rank, every step: its own batch

    # The same run again has the same record; another learning rate, another final state.
    assert all(r.returncode == 0 for r in _run_alone(env, "--steps", "3"))
    assert json.loads((tmp_path / "rank0.json").read_text()) == record[0]
    assert all(r.returncode == 0 for r in _run_alone(env, "--steps", "3", "--lr", "0.5"))
    other = json.loads((tmp_path / "rank0.json").read_text())
    assert other["steps"] == record[0]["steps"] and other["digest"] != record[0]["digest"]


def test_a_loop_logging_with_a_collective_after_its_guard_is_warned_of_once():
    warning = "collectives ran after step 1 outside `with job.step():`"
    inside = _run_alone({}, "--steps", "3", "--log-every", "1")
    assert all(r.returncode == 0 for r in inside), inside
    assert not any("outside `with job.step():`" in r.stderr for r in inside), inside[0].stderr
    outside = _run_alone({}, "--steps", "3", "--log-every", "1", "--log-outside")
    assert all(r.returncode == 0 for r in outside), outside
    assert outside[0].stderr.count(warning) == 1, outside[0].stderr  # rank 0's, once
    assert "outside `with job.step():`" not in outside[1].stderr
    # Over a group of the loop's own (built with the model, as a mesh's sub-groups are): the
    # same hazard, the same warning (tests/recovery/test_unguarded.py: and only for it).
    runs = _run_alone({}, "--steps", "3", "--log-every", "1", "--log-group", "--log-outside")
    assert all(r.returncode == 0 for r in runs), runs
    assert runs[0].stderr.count(warning) == 1, runs[0].stderr


def test_the_final_digest_covers_what_the_loop_carries_beside_the_state():
    class State:
        def digest(self) -> str:
            return "same tensors, RNG and schedule"

    extras = {"user": {"samples_seen": 80}, "stateful": {"scaler": {"scale": 65536.0}}}
    assert final_digest(State(), extras) == final_digest(State(), json.loads(json.dumps(extras)))
    for changed in (
        {**extras, "user": {"samples_seen": 88}},
        {**extras, "stateful": {"scaler": {"scale": 32768.0}}},
        {**extras, "loader": {"position": 3}},
    ):
        assert final_digest(State(), changed) != final_digest(State(), extras), changed


def test_a_hook_that_cannot_be_loaded_is_one_clear_line():
    for run in _run_alone({"P2P_JOB_HOOKS": "no_such_module:attach"}, "--steps", "2"):
        assert run.returncode == 2
        assert "P2P_JOB_HOOKS names 'no_such_module:attach'" in run.stderr
        assert "Traceback" not in run.stderr, run.stderr


def test_a_job_too_small_to_replicate_is_one_clear_line():
    (run,) = _run_alone({}, "--steps", "2", world_size=1)
    assert run.returncode == 2
    assert "needs at least 2 ranks; it has 1" in run.stderr
    assert "Traceback" not in run.stderr, run.stderr
