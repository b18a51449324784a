"""Collectives outside the steps' guards: noticed before any fault, and a clear end after one.

Here on a gloo world of one (this process); a whole script that logs its loss with an
``all_reduce`` after the guard is ``tests/recovery/test_job_hooks.py``'s.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from recovery.unguarded import UnguardedCollectives


def test_a_collective_outside_a_guard_is_warned_of_once_on_rank_0(world_of_one, caplog):
    watch = UnguardedCollectives()
    with caplog.at_level(logging.WARNING, logger="recovery.unguarded"):
        watch.unguarded()
        watch.guarded(1)  # nothing ran between: nothing to say
        assert watch.seen_after is None and not caplog.text

        watch.unguarded()
        dist.all_reduce(torch.ones(2))  # a logging all_reduce after the guard
        watch.guarded(3)
        assert watch.seen_after == 3
        assert "collectives ran after step 3 outside `with job.step():`" in caplog.text
        assert "inside the step's `with job.step():`" in caplog.text

        caplog.clear()
        watch.unguarded()
        dist.barrier()
        watch.guarded(4)
        assert not caplog.text  # once is enough


def test_the_collectives_of_a_recovery_are_not_the_loops(world_of_one, tmp_path, caplog):
    # A recovery between the mark and the check replaces the default group: its own
    # collectives are not the loop's, and the count of the new group is another count.
    watch = UnguardedCollectives()
    watch.unguarded()
    dist.destroy_process_group()
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "s2"), 1), rank=0, world_size=1
    )
    dist.all_reduce(torch.ones(2))
    with caplog.at_level(logging.WARNING, logger="recovery.unguarded"):
        watch.guarded(5)
    assert watch.seen_after is None and not caplog.text


def test_a_group_of_the_loops_own_is_watched_and_the_engines_are_not(world_of_one, caplog):
    # A mesh's sub-group or a logging group the loop made counts as the default group does;
    # the engine's replication groups are busy on their own thread between the guards.
    loops, engines = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")
    watch = UnguardedCollectives(lambda: [engines])
    with caplog.at_level(logging.WARNING, logger="recovery.unguarded"):
        watch.unguarded()
        dist.all_reduce(torch.ones(2), group=engines)
        watch.guarded(1)
        assert watch.seen_after is None and not caplog.text
        watch.unguarded()
        dist.all_reduce(torch.ones(2), group=loops)
        watch.guarded(2)
        assert watch.seen_after == 2 and "after step 2 outside" in caplog.text
