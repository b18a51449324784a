"""Build and restore: a generation's model, optimizer and state, from the factory and a source.

Every member of a new generation takes the census of the copies the members hold, runs the
factory on the new groups (FSDP2 binds its process group when ``fully_shard`` runs, and a step
cut short leaves FSDP's internal state half-way, so nothing of the old wrapping is reused), then
fills what it built from the source :func:`recovery.source.choose_restore_source` chose: the
members' copies, the cold checkpoint, or the initial state. :class:`Rebuilder` holds what these
steps need across generations; the job calls them in the order of ``docs/recovery.md``.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from p2p_state.replicator import Replicator
from p2p_state.snapshot import Copy
from p2p_state.state import TrainingState
from recovery import phases
from recovery.checkpoint import CheckpointConfig, ColdCheckpointer, check_root, complete_steps
from recovery.config import RecoveryConfig
from recovery.devices import snapshot_device, training_device, wire_device
from recovery.errors import ConfigurationError, RecoveryFailed
from recovery.generation import GenerationInfo
from recovery.hooks import JobHooks
from recovery.planner import Source
from recovery.records import RecoveryRecord
from recovery.replication import JobReplication
from recovery.restore import ReceiveBuffer, describe_census, gather_copies, restore_from_peers
from recovery.session import Session
from recovery.source import RestoreSource, choose_restore_source
from recovery.warmup import Build, building_for_restore, capture_rng, restore_rng

logger = logging.getLogger(__name__)


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
    receive_buffer: ReceiveBuffer | None = None
    """Lends the buffer the state is received into (a spare's prepared slots, a survivor's old
    ones), if any."""


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
            receive_buffer=where.receive_buffer,
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


@dataclass(frozen=True, slots=True)
class Census:
    """The copies every member of a generation holds, and the group they were counted over."""

    held: list[set[Copy]]
    """``held[rank]`` is what that member holds."""
    group: dist.ProcessGroup
    """This generation's replication group (the restore's transfers go over it too)."""
    wire_device: torch.device


class Rebuilder:
    """One rank's part of building and restoring, at the start and in every generation.

    Args:
        session: This process's membership (its groups, and where failures are reported).
        config: The job's settings.
        build: The factory given to ``protect()``.
        copies: The rank's copies (their stores are read; their groups are used).
        hooks: Told of every build and restore phase.
    """

    def __init__(
        self,
        session: Session,
        config: RecoveryConfig,
        build: Build,
        copies: JobReplication,
        hooks: JobHooks,
    ) -> None:
        if not callable(build):
            raise TypeError(
                "protect() takes a factory that builds the sharded model and its optimizer "
                "(e.g. `def build(): ...; return model, optimizer, scheduler`): after a fault "
                "they are rebuilt on the new process groups"
            )
        self._session = session
        self._config = config
        self._build = build
        self._copies = copies
        self._hooks = hooks
        self._initial_rng: dict[str, Any] = {}
        self._initial_extras: dict[str, Any] = {"user": {}}

    def remember_initial(self, extras: dict[str, Any]) -> None:
        """Keep the initial state's RNG and extras (data position, stateful objects) as
        ``protect()`` begins: a job whose steps were never replicated starts again from there
        (:attr:`RestoreSource.INITIAL`)."""
        self._initial_rng = capture_rng()
        self._initial_extras = copy.deepcopy(extras)

    def check_fresh_start(self) -> None:
        """Refuse a checkpoint directory the job cannot write, and starting a job afresh over
        another run's checkpoints.

        Raises:
            ConfigurationError: the checkpoint directory cannot be written, or it holds
                checkpoints and the job does not resume from them.
        """
        ckpt = self._config.checkpoint
        if ckpt is None:
            return
        check_root(ckpt.root)
        steps = [] if self._config.resume else complete_steps(ckpt.root)
        if steps:
            raise ConfigurationError(
                f"the checkpoint directory {ckpt.root} already holds checkpoints of steps "
                f"{steps}: resume from them (p2p-run --resume) or give "
                "this job an empty directory"
            )

    def resume(self, state: TrainingState) -> tuple[int, dict[str, Any]]:
        """Load the newest complete checkpoint into ``state``: its step and extras."""
        assert self._config.checkpoint is not None  # RecoveryConfig checks resume has one
        group = self._copies.checkpoint_group()
        return ColdCheckpointer(self._config.checkpoint, state, group=group).load()

    def build(self, source: RestoreSource | None = None, *, replacing: bool = False) -> Built:
        """Run the factory on this generation's groups (see :func:`build_training`).

        Args:
            source: Where the state built is restored from next (``None``: nowhere, a fresh
                start). From the initial state, the RNG is first set back to what it was.
            replacing: The caller has just dropped the previous generation's model.
        """
        if replacing and self._session.device_type == "cuda":
            # An FSDP2 model and its optimizer sit in reference cycles (modules, hooks, states):
            # until a collection their GPU memory stays allocated under the new generation's.
            # One full collection, about 0.1 s, against an out-of-memory.
            gc.collect()
        if source is RestoreSource.INITIAL:
            restore_rng(self._initial_rng)
        return build_training(
            self._build,
            blob_capacity_bytes=self._config.replication.blob_capacity_bytes,
            restore_from=None if source is RestoreSource.INITIAL else source,
            hooks=self._hooks,
        )

    def census(self) -> Census:
        """What every member holds; all members call it together."""
        rep = self._config.replication
        wire = wire_device(rep, training_device(self._session.device_type))
        group = self._copies.replication_group()
        held = gather_copies(self._copies.stores.all, group, wire, rep.timeout_s)
        return Census(held, group, wire)

    def source(self, census: Census, world_size: int) -> RestoreSource:
        """Where the members restore from (the same on every member: the census is shared).

        Raises:
            RecoveryFailed: some shard is lost for good; the coordinator is told it is fatal.
        """
        ckpt = self._config.checkpoint
        try:
            return choose_restore_source(
                census.held,
                world_size,
                checkpoint_root=ckpt.root if ckpt is not None else None,
                checkpoint_steps=complete_steps,
            )
        except RecoveryFailed as e:
            logger.error("census of the copies held: %s", describe_census(census.held))
            self._session.report_failure(str(e), fatal=True)
            raise

    def restore(
        self,
        source: RestoreSource,
        census: Census,
        state: TrainingState,
        info: GenerationInfo,
        rec: RecoveryRecord,
    ) -> Restored:
        """Fill ``state`` from ``source`` (see :func:`restore_state`); all members together."""
        rank = info.rank_of(self._session.identity)
        assert rank is not None  # joining checked it
        where = Restore(
            held=census.held,
            stores=self._copies.stores.all,
            replication_group=census.group,
            checkpoint_group=self._copies.checkpoint_group,
            rank=rank,
            world_size=info.world_size,
            wire_device=census.wire_device,
            snapshot_device=snapshot_device(self._config.replication, state),
            receive_buffer=self._copies.receive_buffer(state),
        )
        return restore_state(
            source,
            state,
            where,
            self._config,
            initial_extras=self._initial_extras,
            rec=rec,
            hooks=self._hooks,
        )
