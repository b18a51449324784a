"""Which fault a rank fires at which point of a recovery (the injector, without processes)."""

from __future__ import annotations

import pytest
import torch

from bench.faults import Injector, flip_top_mantissa_bit, parse_fault


class _Job:
    """What the injector reads of a protected job: its hooks, model and placement."""

    model = None
    replicator = None

    def __init__(self) -> None:
        self.hooks: list = []

    def add_hook(self, hook) -> None:
        self.hooks.append(hook)


def _armed(tmp_path, *specs: str, rank: int):
    fired: list[str] = []
    injector = Injector([parse_fault(s) for s in specs], str(tmp_path), lambda *a, **k: None)
    injector._fire = lambda fault: fired.append(str(fault))  # not this test's process
    injector._last_rank = rank  # the rank it had (no process group here)
    job = _Job()
    injector.arm(job)
    (hook,) = job.hooks
    return hook, fired


def test_recovery_k_is_the_one_into_generation_k_plus_1_on_every_rank(tmp_path):
    spec = "during-recovery:rank=2@recovery=2:phase=transfer"
    hook, fired = _armed(tmp_path, spec, rank=2)
    # The first recovery (into generation 2) was cut short by a fault during it, so its
    # transfer never came; the one that follows, into generation 3, is the second.
    hook("recovery_phase", phase="plan", generation=2)
    hook("recovery_phase", phase="transfer", generation=2)
    assert fired == []
    hook("recovery_phase", phase="plan", generation=3)
    assert fired == []
    hook("recovery_phase", phase="transfer", generation=3)
    assert fired == [spec]
    # Another rank, or another phase, fires nothing.
    other, none = _armed(tmp_path, spec, rank=1)
    other("recovery_phase", phase="transfer", generation=3)
    assert none == []


def test_step_faults_fire_at_their_step_and_phase_only(tmp_path):
    hook, fired = _armed(tmp_path, "kill:rank=0@step=3", rank=0)
    hook("step_begin", step=2)
    hook("recovery_phase", phase="plan", generation=3)
    assert fired == []
    hook("step_begin", step=3)
    assert fired == ["kill:rank=0@step=3:phase=forward"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_a_bitflip_flips_one_bit_that_no_rounding_can_absorb(dtype):
    t = torch.tensor([0.3, -1.7, 2.0], dtype=dtype)
    original = t.clone()
    flip_top_mantissa_bit(t)
    assert torch.equal(t[1:], original[1:])
    ratio = (t[0] / original[0]).item()
    assert 1.25 <= ratio <= 1.5 or 0.5 <= ratio <= 0.75  # a quarter to a half of itself
    # One bit: the same flip again gives the original bits back.
    flip_top_mantissa_bit(t)
    assert torch.equal(t.view(torch.uint8), original.view(torch.uint8))
