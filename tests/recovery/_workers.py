"""Per-rank functions for the restore-executor tests."""

from __future__ import annotations

import torch
import torch.distributed as dist

from p2p_state.config import ReplicationConfig
from p2p_state.replicator import Replicator
from p2p_state.state import TrainingState
from recovery.planner import plan_restore
from recovery.restore import execute_plan
from tests.p2p_state._workers import _setup, _train_step, live_digest


def replace_from_plan(num_steps: int, lost: int, chunk_bytes: int) -> dict:
    """Rank ``lost`` starts over like a spare; the plan rebuilds it from its buddy's replica."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234 + rank)
    model, opt, sched = _setup("tiny")
    state = TrainingState(model, opt, sched)
    rep = Replicator(state, ReplicationConfig(chunk_bytes=chunk_bytes))
    for step in range(1, num_steps + 1):
        _train_step(model, opt, sched, step)
        rep.replicate(step, extras={"offset": step})
    committed = rep.flush()

    if rank == lost:
        # Everything this rank had is gone: a fresh model, optimizer and RNG, no replicas.
        torch.manual_seed(4321)
        model, opt, sched = _setup("tiny")
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        state = TrainingState(model, opt, sched)
    holders = {
        owner: [r for r in (owner, *rep.placement.holders[owner]) if r != lost]
        for owner in range(world)
    }
    plan = plan_restore(rep.layouts, rep.layouts, holders, list(range(world)), committed)
    target = torch.empty(state.layout.total_bytes, dtype=torch.uint8)
    received = execute_plan(
        plan,
        rank,
        rep.group,
        lambda owner: rep.read(owner, committed, 0, rep.layouts[owner].total_bytes),
        target,
        chunk_bytes=chunk_bytes,
        timeout_s=60,
    )
    step, extras = state.restore(target)
    loss = _train_step(model, opt, sched, step + 1)
    rep.close()
    return {
        "received": received,
        "step": step,
        "extras": extras,
        "loss": loss,
        "final": live_digest(state, step + 1),
    }


def reference(num_steps: int) -> dict:
    """The same run with no fault: ``num_steps + 1`` steps."""
    torch.manual_seed(1234 + dist.get_rank())
    model, opt, sched = _setup("tiny")
    state = TrainingState(model, opt, sched)
    loss = 0.0
    for step in range(1, num_steps + 2):
        loss = _train_step(model, opt, sched, step)
    return {"loss": loss, "final": live_digest(state, num_steps + 1)}
