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


def checkpoint_round_trip(root: str) -> dict:
    """Async save at step 2 while training on; load it back; resume; a missing one is refused."""
    from recovery.checkpoint import CheckpointConfig, CheckpointNotFoundError, ColdCheckpointer

    torch.manual_seed(1234 + dist.get_rank())
    model, opt, sched = _setup("tiny")
    state = TrainingState(model, opt, sched)
    ckpt = ColdCheckpointer(CheckpointConfig(root=root, every_steps=2), state)
    digests = {}
    for step in range(1, 5):
        _train_step(model, opt, sched, step)
        ckpt.maybe_save(step, extras={"offset": step * 10})
        digests[step] = live_digest(state, step)
    ckpt.wait()
    loaded_step, extras = ckpt.load(2)
    after_load = live_digest(state, loaded_step)
    for step in (3, 4):
        _train_step(model, opt, sched, step)
    replayed = live_digest(state, 4)
    missing = ""
    try:
        ColdCheckpointer(CheckpointConfig(root=root + "/nothing-here"), state).load()
    except CheckpointNotFoundError as e:
        missing = str(e)
    return {
        "loaded_step": loaded_step,
        "extras": extras,
        "load_equals_step2": after_load == digests[2],
        "replay_equals_step4": replayed == digests[4],
        "step4": digests[4],
        "missing": missing,
    }


def abandoned_save_still_counts(root: str) -> dict:
    """An async save abandoned by a fault still completes, is signed, and is the fallback."""
    from recovery.checkpoint import CheckpointConfig, ColdCheckpointer

    torch.manual_seed(77 + dist.get_rank())
    model, opt, sched = _setup("tiny")
    state = TrainingState(model, opt, sched)
    ckpt = ColdCheckpointer(CheckpointConfig(root=root, every_steps=2), state)
    for step in (1, 2):
        _train_step(model, opt, sched, step)
        ckpt.maybe_save(step, extras={"offset": step})
    saved = live_digest(state, 2)
    abandoned = ckpt.abandon()  # a fault right after the save started: nobody waits for it
    assert abandoned is not None
    abandoned.result(timeout=120)
    dist.barrier()  # rank 0's signature is on disk before anyone lists the checkpoints
    _train_step(model, opt, sched, 3)
    loaded_step, extras = ckpt.load()
    return {"loaded_step": loaded_step, "extras": extras, "equal": live_digest(state, 2) == saved}


def resume_in_fresh_job(root: str) -> dict:
    """A new job (fresh processes and model) resumes from the latest checkpoint."""
    from recovery.checkpoint import CheckpointConfig, ColdCheckpointer

    torch.manual_seed(999)
    model, opt, sched = _setup("tiny")
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    state = TrainingState(model, opt, sched)
    step, extras = ColdCheckpointer(CheckpointConfig(root=root), state).load()
    for s in range(step + 1, 5):
        _train_step(model, opt, sched, s)
    return {"resumed_from": step, "extras": extras, "step4": live_digest(state, 4)}
