"""A spare's warm-up: it runs the factory and a step on a private group and leaves no trace."""

from __future__ import annotations

import random

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from recovery.warmup import warm_up


def _build():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_warm_up_runs_the_step_and_leaves_rng_and_groups_as_they_were():
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    expected = (torch.rand(4), random.random(), np.random.random())
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    stepped = []

    def step(model, optimizer):
        before = [p.detach().full_tensor().clone() for p in model.parameters()]
        model(torch.randn(4, 8)).sum().backward()  # draws from the RNG, as dropout does
        optimizer.step()
        after = [p.detach().full_tensor() for p in model.parameters()]
        stepped.append(any(not torch.equal(a, b) for a, b in zip(before, after)))

    assert warm_up(_build, "gloo", step) > 0
    assert stepped == [True]
    assert not dist.is_initialized()
    assert torch.equal(torch.rand(4), expected[0])
    assert (random.random(), np.random.random()) == expected[1:]


def test_a_spare_warms_up_the_build_it_will_restore_into():
    import p2p_state

    seen = []

    def build():
        seen.append(p2p_state.restoring())
        return _build()

    assert not p2p_state.restoring()
    warm_up(build, "gloo")
    assert seen == [True] and not p2p_state.restoring()


def test_what_the_warm_up_built_is_freed_before_it_returns():
    # An FSDP2 model sits in reference cycles: without the collection in warm_up() its memory
    # (GPU memory on a GPU) would stay allocated until the spare's first real build.
    import gc
    import weakref

    built = []

    def build():
        model, opt = _build()
        built.append(weakref.ref(model))
        return model, opt

    gc.collect()
    gc.disable()  # only warm_up()'s own collection may free it
    try:
        warm_up(build, "gloo")
        assert built and built[0]() is None
    finally:
        gc.enable()
