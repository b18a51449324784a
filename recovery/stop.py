"""The checkpoint a job writes when it must stop.

The coordinator stops a job that cannot go on (no spare came in time and it may not shrink):
every member restores the newest state first, then writes it as a cold checkpoint with every
rank's RNG, schedule and extras of the world the state came from, lost ranks' included (from
the copies held of them), so a job resumed at that size continues exactly.

A job whose coordinators are all lost stops by itself: its ranks agree on a step through the
commit of replication (:mod:`recovery.job`) and write their own states of that step.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from launcher.protocol import ENV_RUN_DIR
from p2p_state.replicator import Replicator
from p2p_state.state import TrainingState
from recovery.checkpoint import CheckpointConfig, ColdCheckpointer, complete_steps
from recovery.config import RecoveryConfig
from recovery.errors import JobStopped, RecoveryFailed
from recovery.planner import Source, shard_layout
from recovery.rebuild import Restored
from recovery.replication import JobReplication
from recovery.restore import find_copy
from recovery.session import CoordinatorsLost, Session

logger = logging.getLogger(__name__)


def stop_checkpoint_root(config: RecoveryConfig) -> str:
    """Where the stop checkpoint goes: the job's checkpoints, else the emergency root, else
    ``<run dir>/checkpoints``."""
    if config.checkpoint is not None:
        return config.checkpoint.root
    return config.emergency_checkpoint_root or os.path.join(
        os.environ.get(ENV_RUN_DIR, "."), "checkpoints"
    )


def stop_with_checkpoint(
    session: Session,
    config: RecoveryConfig,
    state: TrainingState,
    step: int,
    extras: dict[str, Any],
    *,
    group: dist.ProcessGroup,
    source: Source | None,
    stores: Sequence[Replicator],
    reason: str,
    written: bool = False,
) -> JobStopped:
    """Write ``step`` as the stop checkpoint and tell the coordinator and the node's agent.

    Args:
        reason: Why the job stops.
        written: The periodic checkpoint of ``step`` is complete already: it is the stop
            checkpoint.

    Returns:
        The ending to raise once the job has shut down.
    """
    root = stop_checkpoint_root(config)
    if not written:
        write_stop_checkpoint(root, state, step, extras, group=group, source=source, stores=stores)
    session.event("stop_checkpoint_written", step=step, root=root)
    if session.client is not None:
        session.client.report_done(checkpoint_step=step, checkpoint_root=root)
    logger.error("the job stops: %s; a checkpoint of step %d is in %s", reason, step, root)
    return JobStopped(f"{reason}; a checkpoint of step {step} is in {root}")


def stop_on_request(
    session: Session,
    config: RecoveryConfig,
    copies: JobReplication,
    state: TrainingState,
    restored: Restored,
    extras: dict[str, Any],
    *,
    reason: str,
) -> JobStopped:
    """The coordinator asked this generation to stop (no spare came and the job may not
    shrink): write the step it restored as the stop checkpoint, lost ranks' states included
    from the peers' copies it came from.

    Returns:
        The ending to raise once the job has shut down.
    """
    return stop_with_checkpoint(
        session,
        config,
        state,
        restored.step,
        extras,
        group=copies.checkpoint_group(),
        source=restored.peers,
        stores=copies.stores.all,
        reason=reason,
    )


def stop_without_coordinator(
    session: Session,
    config: RecoveryConfig,
    state: TrainingState,
    step: int,
    extras: dict[str, Any],
    copies: JobReplication,
) -> JobStopped:
    """No coordinator is left and every rank agreed, through the commit of replication, to stop
    after ``step``: write it as the stop checkpoint.

    Returns:
        The ending to raise once the job has shut down.
    """
    # A periodic save of this very step began in after_step(): it is the stop checkpoint. Any
    # other in flight ends first (its collectives run on the same group). Every rank decides
    # alike: the steps saved are the same everywhere.
    ckpt = config.checkpoint
    written = copies.checkpointer is not None and ckpt is not None and step % ckpt.every_steps == 0
    copies.wait_checkpoint()
    lost = session.coordinators_lost or []
    return stop_with_checkpoint(
        session,
        config,
        state,
        step,
        extras,
        group=_existing_checkpoint_group(session),
        source=None,  # every rank of this generation holds its own state of ``step``
        stores=copies.stores.all,
        reason=f"no coordinator is left ({', '.join(lost)}); the ranks agreed to stop after "
        f"step {step}",
        written=written,
    )


def _existing_checkpoint_group(session: Session) -> dist.ProcessGroup:
    """A group of this generation to checkpoint on that exists already: with no coordinator,
    no store is left to form a new one through. The checkpoint group if the job checkpoints,
    else the default group (no collective is in flight on it between steps)."""
    comms = session.comms
    assert comms is not None and comms.default is not None  # a member has its groups
    return comms.groups.get("checkpoint", comms.default)


def no_stop_checkpoint(
    session: Session,
    config: RecoveryConfig,
    generation: int,
    lost: CoordinatorsLost,
    cause: str,
) -> RecoveryFailed:
    """No coordinator is left and this generation could not agree on a step to stop at (a
    fault broke its groups): say so, naming the last complete checkpoint."""
    reason = (
        f"the ranks could not agree on a step to stop at (generation {generation} broke: a "
        f"rank is lost or hung too), so no stop checkpoint was written; {last_checkpoint(config)}"
    )
    session.event("stop_checkpoint_missed", reason=reason, cause=cause)
    if session.client is not None:
        session.client.report_no_checkpoint(reason)
    return RecoveryFailed(f"{lost.reason}: {reason}")


def last_checkpoint(config: RecoveryConfig) -> str:
    """Which complete checkpoint a job that stops without one leaves behind, in words."""
    root = stop_checkpoint_root(config)
    steps = complete_steps(root)
    if not steps:
        return f"there is no complete checkpoint in {root}"
    return (
        f"the last complete checkpoint is step {steps[-1]} in {root} (resume with p2p-run "
        f"--checkpoint-dir {root} --resume)"
    )


def write_stop_checkpoint(
    root: str,
    state: TrainingState,
    step: int,
    extras: dict[str, Any],
    *,
    group: dist.ProcessGroup,
    source: Source | None,
    stores: Sequence[Replicator],
) -> None:
    """Write ``step`` as a synchronous cold checkpoint under ``root``; collective over ``group``.

    Args:
        source: The peers' state restored (``None``: a checkpoint or the initial state, whose
            per-rank states are this world's own).
        stores: Where this member's copies are, for the per-rank states of lost ranks.
    """
    ckpt = ColdCheckpointer(CheckpointConfig(root=root, async_save=False), state, group=group)
    rank_states, world = None, None
    if source is not None:
        rank_states = _rank_states(state, step, extras, source, stores)
        world = source.world_size
    ckpt.save(step, extras, rank_states=rank_states, world_size=world)


def _rank_states(
    state: TrainingState,
    step: int,
    extras: dict[str, Any],
    source: Source,
    stores: Sequence[Replicator],
) -> dict[int, bytes]:
    """The small per-rank states this member writes: its own, and those of the lost ranks it
    is the first holder of."""
    rank = dist.get_rank()
    docs = {source.inherits_from[rank]: state.small_state(step, extras)}
    inherited = set(source.inherits_from)
    for owner in range(source.world_size):
        if owner not in inherited and min(source.holders[owner]) == rank:
            copy = find_copy(stores, source.world_size, owner, step)
            layout = shard_layout(state.layout, source.world_size, owner)
            assert copy.buffer is not None  # a verified copy has its bytes
            docs[owner] = TrainingState.small_state_of(layout, copy.buffer)
    return docs
