"""The data plane: every rank's shard of the model and optimizer state lives on a buddy.

Most training scripts need only the two functions of the facade, :func:`init_process_group` and
:func:`protect`, which rebuild a lost rank from its peers. The facade sits above the recovery
engine and the control plane (:mod:`recovery.api`); this package's modules never import either,
and only re-export its functions here, by name.

The pieces, each usable on its own:

- :class:`TrainingState` describes a rank's live state (local FSDP shards, optimizer state, RNG,
  scheduler, step, extras) as a :class:`StateLayout`: named byte ranges of one flat buffer.
- :class:`Replicator` keeps double-buffered snapshots of it and replicates them to the buddies
  chosen by :func:`place`, in the background, after every N optimizer steps.

Typical use inside a training loop (every rank)::

    state = p2p_state.TrainingState(model, optimizer, scheduler)
    replicator = p2p_state.Replicator(state, p2p_state.ReplicationConfig())
    for step in range(1, num_steps + 1):
        ...forward, backward, optimizer.step(), scheduler.step()...
        replicator.replicate(step, extras={"sampler_offset": offset})
"""

import importlib
from typing import TYPE_CHECKING

from p2p_state.placement import Placement, place

#: Where each public name lives. They are imported on first use, so the control plane (which
#: needs only :func:`place`) starts without importing torch, and the facade's functions, which
#: live above this package, are looked up only when a training script calls them.
_EXPORTS = {
    "init_process_group": "recovery.api",
    "protect": "recovery.api",
    "restoring": "recovery.api",
    "ReplicationConfig": "p2p_state.config",
    "LayoutMismatchError": "p2p_state.layout",
    "StateLayout": "p2p_state.layout",
    "TensorEntry": "p2p_state.layout",
    "InsufficientMemoryError": "p2p_state.memory",
    "MemoryKind": "p2p_state.memory",
    "ReplicaCorruptError": "p2p_state.replicator",
    "ReplicaInfo": "p2p_state.replicator",
    "ReplicationError": "p2p_state.replicator",
    "Replicator": "p2p_state.replicator",
    "RoundStats": "p2p_state.replicator",
    "SnapshotHeader": "p2p_state.snapshot",
    "TrainingState": "p2p_state.state",
}

if TYPE_CHECKING:
    from p2p_state.config import ReplicationConfig
    from p2p_state.layout import LayoutMismatchError, StateLayout, TensorEntry
    from p2p_state.memory import InsufficientMemoryError, MemoryKind
    from p2p_state.replicator import (
        ReplicaCorruptError,
        ReplicaInfo,
        ReplicationError,
        Replicator,
        RoundStats,
    )
    from p2p_state.snapshot import SnapshotHeader
    from p2p_state.state import TrainingState
    from recovery.api import init_process_group, protect, restoring


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'p2p_state' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "InsufficientMemoryError",
    "LayoutMismatchError",
    "MemoryKind",
    "Placement",
    "ReplicaCorruptError",
    "ReplicaInfo",
    "ReplicationConfig",
    "ReplicationError",
    "Replicator",
    "RoundStats",
    "SnapshotHeader",
    "StateLayout",
    "TensorEntry",
    "TrainingState",
    "init_process_group",
    "place",
    "protect",
    "restoring",
]
