"""The cold fallback: DCP checkpoints written asynchronously, loaded bitwise, resumed, refused."""

from __future__ import annotations

import pytest

from launcher.local import WorkerGroupConfig, run_local
from tests.recovery import _workers

pytestmark = pytest.mark.slow


def test_checkpoint_loads_bitwise_and_a_fresh_job_resumes_from_it(tmp_path):
    cfg = WorkerGroupConfig(world_size=2, ranks_per_node=1, timeout_s=240)
    first = run_local(_workers.checkpoint_round_trip, cfg, (str(tmp_path),))
    for r in first:
        assert r["loaded_step"] == 4 - 2 and r["extras"] == {"offset": 20}
        assert r["load_equals_step2"], "the async save must not see later steps' updates"
        assert r["replay_equals_step4"], "RNG, schedule and data position come back too"
        assert "no complete checkpoint" in r["missing"] and "--resume" in r["missing"]
    resumed = run_local(_workers.resume_in_fresh_job, cfg, (str(tmp_path),))
    for a, b in zip(first, resumed):
        assert b["resumed_from"] == 4, "the latest complete checkpoint is the one of step 4"
        assert b["extras"] == {"offset": 40}
        assert b["step4"] == a["step4"]


def test_a_save_abandoned_by_a_fault_is_signed_and_loads(tmp_path, monkeypatch):
    from launcher import protocol

    secret_file = tmp_path / "secret"
    protocol.write_secret(str(secret_file))
    monkeypatch.setenv(protocol.ENV_SECRET_FILE, str(secret_file))
    cfg = WorkerGroupConfig(world_size=2, ranks_per_node=1, timeout_s=240)
    root = tmp_path / "ckpt"
    for r in run_local(_workers.abandoned_save_still_counts, cfg, (str(root),)):
        assert r["loaded_step"] == 2 and r["extras"] == {"offset": 2}
        assert r["equal"], "the fallback is the abandoned save, bitwise"
