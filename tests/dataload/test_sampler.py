"""The sampler: exactly once per epoch and a constant global batch across replace/shrink/grow."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dataload.sampler import (
    SamplerState,
    advance,
    plan_batch,
    rank_ids,
    state_at_step,
    steps_per_epoch,
)


def consume_epoch(num_samples, global_batch, world_at_step, seed=3):
    """Run one epoch; world_at_step(step) gives the world size of each step."""
    state, step, seen, per_step = SamplerState(seed), 0, Counter(), []
    while state.epoch == 0:
        world = world_at_step(step)
        ids = [
            i for r in range(world) for i in rank_ids(state, num_samples, global_batch, world, r)
        ]
        seen.update(ids)
        per_step.append(len(ids))
        state = advance(state, num_samples, global_batch)
        step += 1
    return seen, per_step


def test_exactly_once_through_a_replace_a_shrink_and_a_grow():
    # 4 ranks; a replace at step 3 (same size), a shrink to 3 at step 6, a grow back at step 9.
    def world(step):
        return 3 if 6 <= step < 9 else 4

    seen, per_step = consume_epoch(1000, 48, world)
    assert seen == Counter(range(1000)), "every sample of the epoch exactly once"
    assert set(per_step[:-1]) == {48}, "the global batch is constant"
    assert per_step[-1] == 1000 % 48


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 400),
    st.integers(1, 64),
    st.lists(st.integers(1, 16), min_size=1, max_size=40),
)
def test_any_sequence_of_world_sizes_sees_every_sample_once(n, gb, worlds):
    worlds = [min(w, gb) for w in worlds]
    seen, per_step = consume_epoch(n, gb, lambda s: worlds[s % len(worlds)])
    assert seen == Counter(range(n))
    assert all(x == gb for x in per_step[:-1])


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 500), st.integers(1, 64), st.integers(0, 60), st.booleans())
def test_state_at_step_is_o1_and_equals_replaying(n, gb, step, drop_last):
    if drop_last and gb > n:
        return
    state = SamplerState(7)
    for _ in range(step):
        state = advance(state, n, gb, drop_last)
    assert state_at_step(7, step, n, gb, drop_last) == state


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 512), st.integers(1, 64), st.integers(1, 64))
def test_batch_plan_splits_the_global_batch_exactly(gb, world, micro):
    if world > gb:
        with pytest.raises(ValueError, match="exceeds global_batch"):
            plan_batch(gb, world, micro)
        return
    plan = plan_batch(gb, world, micro)
    assert sum(plan.per_rank) == gb and max(plan.per_rank) - min(plan.per_rank) <= 1
    for r in range(world):
        assert sum(plan.micro_batches(r)) == plan.per_rank[r]
        assert max(plan.micro_batches(r)) <= micro
    # Weighted per-rank means, averaged over ranks as DDP/FSDP average gradients, equal the
    # mean over the whole global batch: the update does not depend on the world size.
    losses = [float((i * 7919) % 101) for i in range(gb)]
    means = []
    for r in range(world):
        start, end = plan.rank_slice(r)
        means.append(plan.loss_weight(r) * sum(losses[start:end]) / (end - start))
    assert abs(sum(means) / world - sum(losses) / gb) < 1e-9


def test_permutation_depends_on_seed_and_epoch_only():
    a = rank_ids(SamplerState(1, 0, 0), 100, 10, 2, 0)
    assert list(a) == list(rank_ids(SamplerState(1, 0, 0), 100, 10, 2, 0))
    assert list(a) != list(rank_ids(SamplerState(1, 1, 0), 100, 10, 2, 0))
    assert steps_per_epoch(100, 30) == 4 and steps_per_epoch(100, 30, drop_last=True) == 3
