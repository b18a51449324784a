"""Pure: where a generation's state comes from when its members restore it."""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Sequence

from p2p_state.snapshot import Copy
from recovery.errors import RecoveryFailed
from recovery.planner import choose_source
from recovery.restore import describe_gap

logger = logging.getLogger(__name__)


class RestoreSource(str, enum.Enum):
    """Where a restored state came from (``restored_from`` in the event log)."""

    PEERS = "peers"
    """The copies the members hold: every shard of one step has one somewhere."""
    CHECKPOINT = "checkpoint"
    """The newest complete cold checkpoint: some shard has no copy left."""
    INITIAL = "initial"
    """The factory's initial state: no training step was ever replicated."""


def choose_restore_source(
    held: Sequence[set[Copy]],
    world_size: int,
    *,
    checkpoint_root: str | None,
    checkpoint_steps: Callable[[str], Sequence[int]],
) -> RestoreSource:
    """Where every member of a ``world_size``-rank generation restores its state from.

    Args:
        held: ``held[rank]``: the copies that member holds (the census).
        world_size: Ranks of the generation restored into.
        checkpoint_root: Where the job's cold checkpoints are (``None``: it has none).
        checkpoint_steps: ``checkpoint_steps(root)``: the steps of the complete checkpoints
            under ``root`` (asked only when no step has a copy of every shard).

    Returns:
        The source: peers when some step is complete, else the newest complete checkpoint,
        else the initial state: where nothing was ever replicated, or where checkpoints are
        configured but none is complete yet (a shard lost before the first one was written).

    Raises:
        RecoveryFailed: some shard is lost for good and checkpoints are not configured; the
            message names the lost shards and the fix.
    """
    if choose_source(held, world_size) is not None:
        return RestoreSource.PEERS
    if checkpoint_root is not None and checkpoint_steps(checkpoint_root):
        return RestoreSource.CHECKPOINT
    if not any(c.step > 0 for h in held for c in h):
        # No training step was ever replicated: every rank starts again from the initial
        # state (the factory's, with the RNG as it was when protect() began).
        return RestoreSource.INITIAL
    if checkpoint_root is not None:
        # A cold fallback was asked for but its first checkpoint is not complete yet: the
        # initial state is the oldest checkpoint there is. The steps so far are redone, as a
        # restart would, and the result is the same bits.
        logger.warning(
            "%s, and no checkpoint under %r is complete yet: starting again from the initial "
            "state (every step so far is redone)",
            describe_gap(held),
            checkpoint_root,
        )
        return RestoreSource.INITIAL
    raise RecoveryFailed(
        f"{describe_gap(held)}, and there is no complete checkpoint (RecoveryConfig.checkpoint "
        "is not set): the job cannot continue; raise the replication factor or configure "
        "checkpoints"
    )
