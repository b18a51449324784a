"""Build and restore: a generation's model, optimizer and state, from the factory and a source.

Every member of a new generation runs the factory on the new groups (FSDP2 binds its process
group when ``fully_shard`` runs, so nothing of the old wrapping is reused), then fills what it
built from the source :func:`recovery.source.choose_restore_source` chose: the members' copies,
the cold checkpoint, or the initial state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from p2p_state.replicator import Replicator
from p2p_state.snapshot import Copy
from p2p_state.state import TrainingState
from recovery import phases
from recovery.checkpoint import CheckpointConfig, ColdCheckpointer
from recovery.config import RecoveryConfig, RecoveryRecord
from recovery.hooks import JobHooks
from recovery.planner import Source
from recovery.restore import restore_from_peers
from recovery.source import RestoreSource
from recovery.warmup import Build, building_for_restore


@dataclass(slots=True)
class Built:
    """What the factory built, and the state laid out over it."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    state: TrainingState


def build_training(
    build: Build,
    *,
    blob_capacity_bytes: int,
    restore_from: RestoreSource | None,
    hooks: JobHooks,
) -> Built:
    """Run the factory and lay its state out.

    Args:
        restore_from: Peers or checkpoint: every value is overwritten from there next, so the
            factory may skip initialising them (``p2p_state.restoring()`` is true).

    Raises:
        TypeError: the factory returned something else than (model, optimizer[, scheduler]).
    """
    with building_for_restore() if restore_from else contextlib.nullcontext():
        built = build()
    if not isinstance(built, tuple) or len(built) not in (2, 3):
        raise TypeError(
            "the factory given to protect() must return (model, optimizer) or "
            f"(model, optimizer, scheduler), not {type(built).__name__}"
        )
    model, optimizer = built[0], built[1]
    scheduler = built[2] if len(built) == 3 else None
    state = TrainingState(
        model,
        optimizer,
        scheduler,
        blob_capacity=blob_capacity_bytes,
        keep_optimizer_state=restore_from is RestoreSource.PEERS,
    )
    hooks.call("built", model=model, optimizer=optimizer)
    return Built(model, optimizer, scheduler, state)


@dataclass(frozen=True, slots=True)
class Restored:
    """The step a generation restored, its extras, and the peers' state it came from."""

    step: int
    extras: dict[str, Any]
    peers: Source | None
    """Which world and step of the peers' copies (``None``: checkpoint or initial state)."""


@dataclass(frozen=True, slots=True)
class Restore:
    """Where one member's restore reads from and talks over."""

    held: Sequence[set[Copy]]
    """The census: ``held[rank]`` is what that member holds."""
    stores: Sequence[Replicator]
    replication_group: dist.ProcessGroup
    checkpoint_group: Callable[[], dist.ProcessGroup]
    """Made only when the state comes from the checkpoint (it is a collective)."""
    rank: int
    world_size: int
    wire_device: torch.device
    snapshot_device: torch.device


def restore_state(
    source: RestoreSource,
    state: TrainingState,
    where: Restore,
    config: RecoveryConfig,
    *,
    initial_extras: dict[str, Any],
    rec: RecoveryRecord,
    hooks: JobHooks,
) -> Restored:
    """Fill ``state`` from ``source``; every member calls it together.

    Args:
        initial_extras: The extras of the initial state (for :attr:`RestoreSource.INITIAL`).
        rec: The recovery's record: the phases' times and the bytes received go there.
    """
    if source is RestoreSource.PEERS:
        rep = config.replication
        outcome = restore_from_peers(
            state,
            where.stores,
            list(where.held),
            where.replication_group,
            where.rank,
            where.world_size,
            memory=where.snapshot_device,
            chunk_bytes=rep.chunk_bytes,
            timeout_s=rep.timeout_s,
            wire_device=where.wire_device,
            on_phase=lambda name: hooks.call(
                "recovery_phase", phase=name, generation=rec.generation
            ),
        )
        rec.phases[phases.PLAN] += outcome.plan_s
        rec.phases[phases.TRANSFER] = outcome.transfer_s
        rec.phases[phases.RESTORE] = outcome.restore_s
        rec.bytes_received = outcome.bytes_received
        return Restored(outcome.step, outcome.extras, outcome.source)
    if source is RestoreSource.CHECKPOINT:
        assert isinstance(config.checkpoint, CheckpointConfig)  # the source needs one
        with hooks.phase(rec, phases.RESTORE):
            ckpt = ColdCheckpointer(config.checkpoint, state, group=where.checkpoint_group())
            step, extras = ckpt.load()
        return Restored(step, extras, None)
    # Nothing was replicated yet: start again from the initial state.
    return Restored(0, initial_extras, None)
