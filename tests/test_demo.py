"""``make demo`` runs examples/demo.py: keep it working (short settings, same code path)."""

from __future__ import annotations

import pytest

from examples import demo

pytestmark = pytest.mark.slow


def test_demo_recovers_a_wiped_rank_bitwise(capfd):
    assert demo.main(["--steps", "3", "--wipe-at", "2", "--model", "tiny"]) == 0
    out = capfd.readouterr().out
    assert "rebuilt step 2 from rank 3's replica" in out
    assert "bitwise equal to the fault-free run: True" in out
