"""The checkpoint a job writes when it must stop (no spare came in time and it may not shrink).

Every member restores the newest state first, then writes it as a cold checkpoint with every
rank's RNG, schedule and extras of the world the state came from, lost ranks' included (from
the copies held of them), so a job resumed at that size continues exactly.
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
from recovery.checkpoint import CheckpointConfig, ColdCheckpointer
from recovery.config import RecoveryConfig
from recovery.errors import JobStopped
from recovery.planner import Source, shard_layout
from recovery.replication import JobReplication
from recovery.restore import find_copy
from recovery.session import GenerationInfo, Session

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
    copies: JobReplication,
    source: Source | None,
    info: GenerationInfo,
) -> JobStopped:
    """Write the restored ``step`` as the stop checkpoint and tell the coordinator.

    Args:
        copies: The rank's copies (their stores and checkpoint group).
        source: The peers' state restored (``None``: a checkpoint or the initial state).
        info: The generation whose directive is to stop (with the reason).

    Returns:
        The ending to raise once the job has shut down.
    """
    root = stop_checkpoint_root(config)
    group, stores = copies.checkpoint_group(), copies.stores.all
    write_stop_checkpoint(root, state, step, extras, group=group, source=source, stores=stores)
    session.event("stop_checkpoint_written", step=step, root=root)
    if session.client is not None:
        session.client.report_done(checkpoint_step=step)
    reason = info.reason
    logger.error("the job stops: %s; a checkpoint of step %d is in %s", reason, step, root)
    return JobStopped(f"{reason}; a checkpoint of step {step} is in {root}")


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
