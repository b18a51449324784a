"""Smoke run of ``p2p-bench hostile`` at a small size: its figures are produced and hold."""

from __future__ import annotations

import json

import pytest

from bench.cli import main


@pytest.mark.slow
def test_hostile_bench_small(tmp_path, capsys):
    code = main(
        [
            "hostile",
            "--flood-sockets=10",
            "--flood-frames=5",
            "--per-kind=20",
            "--oversized-mb=4",
            f"--out-dir={tmp_path}",
            "--json",
        ]
    )
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0
    assert r["crashes"] == 0 and r["state_changes_from_unauthenticated"] == 0
    assert "agent/0" in r["members"], "the legitimate agent is a member"
    assert 0 < r["dropped"] <= r["tried_total"]
    assert r["squatted_identity_answered"] and r["legit_lost_events"] == 0
    assert r["squatter_messages_received"] == 0 and r["resizes_without_operator_key"] == 0
    assert r["tried_by_kind"]["a previous run's hello and scale"] == 20
    assert (tmp_path / "report.json").exists() and (tmp_path / "report.md").exists()
