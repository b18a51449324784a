"""Planner + executor on real processes: a rank rebuilt from scratch, bitwise."""

from __future__ import annotations

import pytest

from launcher.local import WorkerGroupConfig, run_local
from tests.recovery import _workers

pytestmark = pytest.mark.slow


def test_a_rank_restarted_from_nothing_is_rebuilt_bitwise_by_the_plan():
    cfg = WorkerGroupConfig(world_size=4, ranks_per_node=2, timeout_s=240)
    replaced = run_local(_workers.replace_from_plan, cfg, (3, 1, 64 * 1024))
    reference = run_local(_workers.reference, cfg, (3,))
    assert [r["received"] > 0 for r in replaced] == [False, True, False, False]
    for got, want in zip(replaced, reference):
        assert got["step"] == 3 and got["extras"] == {"offset": 3}
        assert got["final"] == want["final"]
        assert got["loss"] == want["loss"]
