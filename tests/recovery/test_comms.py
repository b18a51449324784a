"""A process given another rank in a new generation builds that rank's shards.

DTensor caches sharding decisions by device mesh, and meshes of the same ranks compare equal
whatever this process's place in them. A resize that renumbers the ranks (4 -> 3 -> 4) must not
hand a new build the shard offsets of the rank this process had the last time its world had
this size. torch's ``fake`` backend lets one process be any rank of a 4-rank world.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
import torch.testing._internal.distributed.fake_pg  # registers the ``fake`` backend
from torch.distributed.fsdp import fully_shard

from p2p_state.state import TrainingState
from recovery.comms import _init_default

ROWS = 13  # 4 ranks shard 13 rows as 4/4/4/1: every rank has a different offset


def _build_layout(rank: int, world_size: int) -> list[tuple[str, int]]:
    _init_default(dist.HashStore(), "fake", rank, world_size, timedelta(seconds=30))
    model = torch.nn.Sequential(torch.nn.Linear(8, ROWS), torch.nn.Linear(ROWS, 6))
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = TrainingState(model, optimizer, keep_optimizer_state=True)
    return [(e.name, e.dim0_offset) for e in state.layout.entries if e.name.endswith("0.weight")]


def test_a_renumbered_rank_gets_its_new_rank_s_offsets(leave_no_group):
    first = _build_layout(2, 4)
    _build_layout(1, 3)  # a shrink renumbers rank 2 to 1
    regrown = _build_layout(1, 4)  # a grow keeps it there
    assert {offset for _, offset in first} == {8}
    assert {offset for _, offset in regrown} == {4}, regrown
    assert _build_layout(1, 4) == regrown  # the same place again: the same layout
