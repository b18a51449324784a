"""The warning of gradients carried across steps into a kept state (recovery/accumulation.py)."""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.testing._internal.distributed.fake_pg  # registers the ``fake`` backend
from torch.distributed.fsdp import fully_shard

from recovery.accumulation import CarriedGradients
from recovery.comms import _init_default

WARNING = "ended with gradients but without an optimizer step"


def _model_and_optimizer():
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _step(carried, model, optimizer, step, *, update, kept=True, before=None, after=None):
    carried.step_began()
    model(torch.randn(3, 4)).sum().backward()
    if update:
        optimizer.step()
        optimizer.zero_grad()
    carried.step_ended(step, model, kept, before or {}, after or {})


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if WARNING in r.getMessage()]


def test_an_update_every_other_step_is_noticed_once_at_the_first_kept_step(caplog):
    model, optimizer = _model_and_optimizer()
    carried = CarriedGradients()
    carried.watch(optimizer)
    with caplog.at_level(logging.WARNING, logger="recovery.accumulation"):
        _step(carried, model, optimizer, 1, update=False, kept=False)  # not kept: harmless
        assert carried.seen_at is None and not _warnings(caplog)
        _step(carried, model, optimizer, 2, update=True)
        for step in (3, 4, 5, 6):
            _step(carried, model, optimizer, step, update=step % 2 == 0)
    assert carried.seen_at == 3
    (message,) = _warnings(caplog)
    assert message.startswith("step 3 ended") and "--replicate-every N" in message


@pytest.mark.parametrize("zero_grad_first", [False, True])
def test_a_loop_that_updates_every_step_is_never_noticed(caplog, zero_grad_first):
    # Zeroing at the start of a step leaves gradients at its end, after an update: harmless.
    model, optimizer = _model_and_optimizer()
    carried = CarriedGradients()
    carried.watch(optimizer)
    with caplog.at_level(logging.WARNING, logger="recovery.accumulation"):
        for step in range(1, 5):
            carried.step_began()
            if zero_grad_first:
                optimizer.zero_grad()
            model(torch.randn(3, 4)).sum().backward()
            optimizer.step()
            if not zero_grad_first:
                optimizer.zero_grad()
            carried.step_ended(step, model, True, {}, {})
    assert carried.seen_at is None and not _warnings(caplog)


def test_an_update_a_grad_scaler_skipped_is_told_apart(caplog):
    # A skipped step (an overflow) backs the scale off; the scaler's captured state shows it.
    model, optimizer = _model_and_optimizer()
    carried = CarriedGradients()
    carried.watch(optimizer)
    start = {"scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5, "_growth_tracker": 0}
    skipped = {**start, "scale": 32768.0}
    with caplog.at_level(logging.WARNING, logger="recovery.accumulation"):
        # The first step skipped (a high initial scale overflows): told from the start's scale.
        _step(carried, model, optimizer, 1, update=False, before={"s": start}, after={"s": skipped})
        assert carried.seen_at is None
        # The same scale again with no update: not a skip.
        _step(
            carried, model, optimizer, 2, update=False, before={"s": skipped}, after={"s": skipped}
        )
    assert carried.seen_at == 2 and len(_warnings(caplog)) == 1


def test_an_update_of_an_interrupted_step_does_not_count_for_its_redo():
    model, optimizer = _model_and_optimizer()
    carried = CarriedGradients()
    carried.watch(optimizer)
    carried.step_began()
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()  # then a fault: the step is redone after a recovery
    _step(carried, model, optimizer, 4, update=False)
    assert carried.seen_at == 4


def test_gradients_fsdp_keeps_unreduced_are_seen(leave_no_group):
    # set_requires_gradient_sync(False): the gradients stay on FSDP2's unsharded parameters;
    # the sharded ones the module shows have none.
    _init_default(dist.HashStore(), "fake", 0, 2, timedelta(seconds=30))
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    fully_shard(model[0])
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    carried = CarriedGradients()
    carried.watch(optimizer)
    carried.step_began()
    model.set_requires_gradient_sync(False)
    model(torch.randn(3, 4)).sum().backward()
    assert all(p.grad is None for p in model.parameters()), "this test would show nothing"
    carried.step_ended(1, model, True, {}, {})
    assert carried.seen_at == 1
