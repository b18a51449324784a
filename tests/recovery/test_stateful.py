"""``protect(stateful=...)``: what is accepted, what a snapshot carries, what a restore puts back.

The whole path (a GradScaler under fp16 autocast, faults, a checkpoint, bitwise against the
fault-free run) is ``tests/recovery/test_user_scripts.py``'s ``mlp_scheduled.py --amp fp16``.
"""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch

from p2p_state.state import pack_small, unpack_small
from recovery import stateful
from recovery.errors import ConfigurationError


class Counter:
    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]


class KeepsATensor(Counter):
    def state_dict(self) -> dict:
        return {"ema": torch.zeros(4)}


def _scaler_after_overflows(steps: int) -> tuple[torch.amp.GradScaler, torch.optim.Optimizer]:
    """A GradScaler whose scale moved: fp16 overflows skip steps, then it grows again."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=2)
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(4, 16)).float().pow(2).sum()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    return scaler, optimizer


def test_the_argument_is_checked_with_the_fix_named():
    assert stateful.checked(None) == {}
    counter = Counter()
    assert stateful.checked({"counter": counter}) == {"counter": counter}
    with pytest.raises(TypeError, match=r"a dict of names .* got a Counter"):
        stateful.checked(counter)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="the name 3 is not a string"):
        stateful.checked({3: counter})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match=r"stateful=\{'lr': \.\.\.\}\): a float has no state_dict"):
        stateful.checked({"lr": 0.1})


def _draws(generator) -> list[float]:
    if isinstance(generator, torch.Generator):
        return torch.rand(4, generator=generator).tolist()
    if isinstance(generator, random.Random):
        return [generator.random(), generator.gauss(0.0, 1.0), generator.random()]
    return [float(x) for x in generator.random(3)] + [float(generator.standard_normal())]


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.Generator().manual_seed(5),
        lambda: np.random.default_rng(5),
        lambda: np.random.Generator(np.random.MT19937(5)),
        lambda: np.random.RandomState(5),
        lambda: random.Random(5),
    ],
    ids=["torch", "numpy-pcg64", "numpy-mt19937", "numpy-randomstate", "python"],
)
def test_a_generator_of_the_scripts_own_draws_again_what_it_drew_after_its_snapshot(make):
    generator = make()
    _draws(generator)  # a gauss() leaves a cached value in Python's state: carried too
    objects = stateful.checked({"rng": generator})
    stateful.check_small(objects)
    carried = unpack_small(pack_small(stateful.capture(objects)))
    expected = _draws(generator)
    other = make()
    _draws(other)
    _draws(other)  # elsewhere in its sequence
    stateful.restore(stateful.checked({"rng": other}), carried)
    assert _draws(other) == expected
    stateful.restore(objects, carried)  # the object given is the one restored
    assert _draws(generator) == expected


def test_a_generator_without_state_is_refused_with_the_fix_named():
    with pytest.raises(TypeError, match=r"SystemRandom .* use a seeded random.Random"):
        stateful.checked({"rng": random.SystemRandom()})


def test_a_state_too_big_for_a_snapshot_is_refused_before_the_first_step():
    stateful.check_small({"counter": Counter()})
    with pytest.raises(
        ConfigurationError,
        match=r"stateful=\{'ema': \.\.\.\}.*in the model or the optimizer's state",
    ):
        stateful.check_small({"counter": Counter(), "ema": KeepsATensor()})


def test_a_grad_scaler_comes_back_exactly_through_a_snapshot():
    moved, _ = _scaler_after_overflows(7)
    fresh = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=2)
    assert moved.state_dict() != fresh.state_dict()  # else the test shows nothing
    carried = unpack_small(pack_small(stateful.capture({"scaler": moved})))
    stateful.restore({"scaler": fresh}, carried)
    assert fresh.state_dict() == moved.state_dict()


def _clean_step(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
    scaler.scale(torch.ones(()))  # as a step's scale(loss) does (a fresh scaler starts there)
    for p in optimizer.param_groups[0]["params"]:
        p.grad = torch.zeros_like(p)
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()


@pytest.mark.parametrize("redo_optimizer", ["rebuilt", "at the old address"])
def test_a_restored_grad_scaler_forgets_the_interrupted_step(redo_optimizer):
    # A fault between unscale_() and update(): the redo unscales the rebuilt optimizer, and
    # neither a rebuilt one at the old one's address (unscale_ would raise) nor the interrupted
    # step's inf (update() would back off) may come from the interrupted step.
    scaler, optimizer = _scaler_after_overflows(3)
    saved = stateful.capture({"scaler": scaler})
    params = optimizer.param_groups[0]["params"]
    for p in params:
        p.grad = torch.full_like(p, float("inf"))
    scaler.unscale_(optimizer)  # the interrupted step found an inf
    stateful.restore({"scaler": scaler}, saved)
    redo = torch.optim.SGD(params, lr=0.1) if redo_optimizer == "rebuilt" else optimizer
    _clean_step(scaler, redo)

    expected = torch.amp.GradScaler("cpu")
    expected.load_state_dict(saved["scaler"])
    _clean_step(expected, torch.optim.SGD(params, lr=0.1))
    assert scaler.state_dict() == expected.state_dict()


def test_a_disabled_grad_scaler_goes_through_as_the_no_op_it_is():
    # fp32 runs of an AMP script: GradScaler(enabled=False) has an empty state and no record.
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    carried = unpack_small(pack_small(stateful.capture({"scaler": scaler})))
    assert carried == {"scaler": {}}
    stateful.restore({"scaler": scaler}, carried)
    assert scaler.state_dict() == {}


def test_a_name_the_restored_state_lacks_keeps_its_state_and_says_so(caplog):
    counter = Counter()
    counter.count = 5
    with caplog.at_level(logging.WARNING, logger="recovery.stateful"):
        stateful.restore({"counter": counter}, {})
    assert counter.count == 5
    assert "holds nothing for stateful 'counter'" in caplog.text
