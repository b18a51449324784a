"""``make demo`` runs examples/demo.py: keep it working (short settings, same code path)."""

from __future__ import annotations

import re

import pytest

from examples import demo

pytestmark = pytest.mark.slow


def test_demo_recovers_a_killed_rank_bitwise(capfd, tmp_path):
    assert (
        demo.main(["--steps", "4", "--kill-at", "3", "--model", "tiny", "--run-dir", str(tmp_path)])
        == 0
    )
    out = capfd.readouterr().out
    assert "the coordinator saw the crash" in out
    # The committed step: 2, or 1 if step 2's replication was still in flight.
    assert re.search(r"spare 1 restored step [12] from peers", out)
    assert "bitwise equal to the fault-free run: True" in out
