"""A protected job's copies, step by step: replication, cold checkpoints and agreed resizes.

:class:`JobReplication` owns the current replicator, the cold checkpointer and the stores of
older generations (:class:`recovery.stores.GenerationStores`). After every step it replicates
the state (a round every ``ReplicationConfig.interval_steps``), checkpoints it when one is due,
and learns from the commit of replication whether every rank agreed on a graceful resize.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from p2p_state.memory import BufferPool
from p2p_state.replicator import Replicator, state_device
from p2p_state.state import TrainingState
from recovery.checkpoint import ColdCheckpointer
from recovery.config import RecoveryConfig
from recovery.devices import (
    placement_of,
    replication_backend,
    snapshot_device,
    training_device,
)
from recovery.errors import ConfigurationError
from recovery.hooks import JobHooks
from recovery.restore import ReceiveBuffer
from recovery.session import Session
from recovery.stores import GenerationStores


class JobReplication:
    """The copies of one rank's training state; see the module docstring.

    Args:
        session: This process's membership (groups, generation, control-plane reports).
        config: The job's settings.
        hooks: Told of every replication chunk.
    """

    def __init__(self, session: Session, config: RecoveryConfig, hooks: JobHooks) -> None:
        self._session = session
        self._config = config
        self._hooks = hooks
        self.stores = GenerationStores()
        self.replicator: Replicator | None = None
        self.checkpointer: ColdCheckpointer | None = None
        self._last_replicated = -1
        self._prepared: BufferPool | None = None
        """A spare's buffers allocated ahead, until the replicator has taken its slots."""

    def form_groups(self) -> None:
        """Form this generation's groups besides the default one: the replication group, the
        gloo group of its headers beside NCCL, the checkpoint group when checkpoints are on.

        Called by every member right after it joined the generation, so each creation (a
        collective) happens in the same order everywhere and its time, an NCCL split or a gloo
        rendezvous, counts in the recovery's ``communicators`` phase rather than in the plan or
        the first replication round. A group asked for later (a stop checkpoint's without
        periodic checkpoints) is still made on first use. Where gloo pairs connect on first
        use, the members then give each other their addresses (:meth:`Comms.share_addresses`),
        so that no pair of these groups needs the store again.
        """
        self.replication_group()
        self.control_group()
        if self._config.checkpoint is not None:
            self.checkpoint_group()
        assert self._session.comms is not None
        self._session.comms.share_addresses()

    def replication_group(self) -> dist.ProcessGroup:
        """This generation's group for replication and restores."""
        device = training_device(self._session.device_type)
        backend = replication_backend(self._config.replication, device)
        assert self._session.comms is not None  # a member of a generation has its groups
        return self._session.comms.group("replication", backend)

    def control_group(self) -> dist.ProcessGroup | None:
        """This generation's gloo group for replication's headers and commits beside an NCCL
        replication group (``None``: the replication group is gloo and carries them)."""
        device = training_device(self._session.device_type)
        if replication_backend(self._config.replication, device) == "gloo":
            return None
        assert self._session.comms is not None
        return self._session.comms.group("replication-control", "gloo")

    def checkpoint_group(self) -> dist.ProcessGroup:
        """This generation's group for cold checkpoints."""
        assert self._session.comms is not None
        return self._session.comms.group("checkpoint", "gloo")

    def adopt_prepared(self) -> None:
        """A spare that takes a rank: its slots (and the buffer it receives its state into)
        come from the buffers it allocated while it waited, if any."""
        if self._prepared is None and (prepared := self._session.take_prepared()) is not None:
            self.stores.adopt(prepared)
            self._prepared = prepared

    def receive_buffer(self, state: TrainingState) -> ReceiveBuffer | None:
        """Where a restore into ``state`` receives its bytes, lent by the pool the next
        replicator's slots come from and given back to it for a slot to take next: a spare's
        prepared pool, or the one a survivor's old stores give their memory to (all but the
        copies of the restored step and of the last committed step, which the restore and a
        fault before the next commit may read; :meth:`GenerationStores.recycle_for`). ``None``
        with neither (a new buffer)."""
        self.adopt_prepared()
        kind, _ = Replicator.backend_for(self._config.replication, state_device(state))
        device = snapshot_device(self._config.replication, state)
        prepared = self._prepared
        if prepared is not None:
            return lambda nbytes, step: prepared.borrowed(nbytes, kind, device)
        if not self.stores.all:
            return None
        stores = self.stores
        return lambda nbytes, step: stores.recycle_for(step).borrowed(nbytes, kind, device)

    def start(
        self, state: TrainingState, step: int, extras: dict[str, Any], *, recovering: bool
    ) -> None:
        """Replicate ``state`` in this generation, starting with ``step`` at once, so a fault
        before the next step still finds a copy of every shard.

        Raises:
            ConfigurationError: the world is too small for the replication factor.
        """
        info = self._session.info
        k = self._config.replication.k
        if k >= dist.get_world_size():
            raise ConfigurationError(
                f"every shard is copied to k={k} other ranks, so the job needs at least "
                f"{k + 1} ranks; it has {dist.get_world_size()}: run more ranks or lower k "
                "(p2p-run --replicas, ReplicationConfig.k)"
            )
        # After a recovery the previous generations' stores keep the copies of the restored
        # step (the fallback until the new ones are made); the rest of their memory is reused.
        # At the job's start the slots are prefaulted instead.
        if recovering and (left := self.stores.left_behind()):
            self._session.event("replication_workers_left_behind", workers=left)
        if recovering:
            self.adopt_prepared()
        rep = Replicator(
            state,
            self._config.replication,
            generation=info.generation if info else 0,
            on_replicated=self._on_replicated,
            progress_hook=self._on_chunk,
            group=self.replication_group(),
            control_group=self.control_group(),
            placement=placement_of(info, k),
            recycle=self.stores.recycle_for(step) if recovering else None,
        )
        self.replicator = rep
        self.stores.add(rep, restored_step=step)
        if self._session.client is not None:  # what a spare allocates to take this place
            self._session.client.report_memory(rep.kind.value, rep.slot_sizes, rep.generation)
        self._last_replicated = step
        ckpt = self._config.checkpoint
        self.checkpointer = (
            ColdCheckpointer(ckpt, state, group=self.checkpoint_group()) if ckpt else None
        )
        rep.replicate(step, extras)

    def keeps(self, step: int) -> bool:
        """Whether the state of ``step`` is replicated or checkpointed (see :meth:`after_step`)."""
        rep, ckpt = self.replicator, self.checkpointer
        return (rep is not None and rep.due(step)) or (ckpt is not None and ckpt.due(step))

    def after_step(self, step: int, extras: Callable[[], dict[str, Any]]) -> int | None:
        """Replicate and checkpoint ``step`` (when due).

        Returns:
            The step whose round's agreement is now known on every rank (``None`` if no round
            began); see :meth:`agreed_generation`.
        """
        rep = self.replicator
        assert rep is not None
        # A graceful resize (growing into spares, giving ranks back) is agreed on through the
        # commit of replication, so every rank switches after the same step and none is lost.
        rep.signal = self._session.pending_graceful()
        previous = self._last_replicated
        if self.stores.has_old:
            self._release_old_stores(step)
        carried = extras()  # once: a stateful object's state_dict() may sync the GPU
        took = rep.replicate(step, carried)
        if self._prepared is not None and rep.slots_allocated:
            self._prepared_used(self._prepared)
            self._prepared = None
        if self.checkpointer is not None:
            self.checkpointer.maybe_save(step, carried)
        if not took:
            return None
        self._last_replicated = step
        return previous

    def agreed_generation(self, previous: int | None) -> int | None:
        """The newer generation every rank agreed to switch to with ``previous``'s round, if
        any; its step is then committed everywhere."""
        rep = self.replicator
        assert rep is not None
        # replicate() waited for the previous round: its agreement is known on every rank.
        target = rep.agreed_signal(previous) if previous is not None and previous >= 0 else None
        info = self._session.info
        if not target or target <= (info.generation if info else 0):
            return None
        rep.flush()  # this step is committed everywhere: nothing is lost
        return target

    def catch_up(self, step: int, extras: dict[str, Any]) -> bool:
        """After a recovery, save the restored step if the cold fallback fell behind.

        Returns:
            Whether there is a checkpointer.
        """
        if self.checkpointer is None:
            return False
        self.checkpointer.catch_up(step, extras)
        return True

    def break_off(self) -> None:
        """After a fault: stop replicating (without waiting for the worker) and drop any
        checkpoint in progress. The copies stay readable for the restore."""
        self.stores.abandon(wait_s=0.0)  # the workers are asked at recycling (left_behind)
        if self.checkpointer is not None:
            self.checkpointer.abandon()
            self.checkpointer = None

    def stop_for_resize(self) -> None:
        """Before a graceful switch: stop replicating and finish any checkpoint in progress."""
        self.stores.abandon()
        if self.checkpointer is not None:
            self.checkpointer.wait()
            self.checkpointer = None

    def finish(self) -> bool:
        """The loop ended cleanly: wait for the last round (a barrier: every rank completed
        every step) and for the checkpoint in progress.

        Returns:
            Whether the job was replicating at all.
        """
        if self.replicator is None:
            return False
        self.replicator.flush()
        return True

    def wait_checkpoint(self) -> None:
        """Wait for the cold checkpoint in progress, if any."""
        if self.checkpointer is not None:
            self.checkpointer.wait()

    def shutdown(self) -> None:
        """Stop everything; the job is over."""
        self.stores.clear()
        self.replicator = None
        if self.checkpointer is not None:
            self.checkpointer.abandon()
            self.checkpointer = None

    def _release_old_stores(self, step: int) -> None:
        """Once the new generation's copies cover the restored step everywhere, the previous
        generations' stores are no longer needed: their memory goes to the new slots."""
        rep = self.replicator
        assert rep is not None
        if rep.due(step):
            # replicate() is about to wait for the round in flight anyway: wait first, so the
            # snapshot it takes can already go into an old buffer.
            rep.flush()
        released = self.stores.release_old()
        if released is not None:
            info = self._session.info
            self._session.event(
                "previous_copies_released",
                generation=info.generation if info else 0,
                step=step,
                given_bytes=released[0],
                reused_bytes=released[1],
                lent_bytes=released[2],
            )

    def _prepared_used(self, pool: BufferPool) -> None:
        """A spare's replicator holds all its slots: say how many came from the buffers it
        allocated while it waited, and let go of the rest."""
        info = self._session.info
        self._session.event(
            "prepared_memory_used",
            generation=info.generation if info else 0,
            lent_bytes=pool.lent_bytes,
            reused_bytes=pool.reused_bytes,
            fresh_bytes=pool.fresh_bytes,
            unused_bytes=self.stores.drop_pool(),
        )

    def _on_replicated(self, step: int) -> None:
        if self._session.client is not None:
            info = self._session.info
            self._session.client.report_replicated(step, info.generation if info else 0)

    def _on_chunk(self, step: int, round_: int, num_rounds: int) -> None:
        self._hooks.call("replication_chunk", step=step, round=round_, num_rounds=num_rounds)
