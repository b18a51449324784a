"""The protected training loop behind ``p2p_state.protect()``.

A :class:`ProtectedJob` owns what a rank trains with (the model, optimizer and scheduler its
factory builds, the loader, the replicator of its state and the cold checkpointer) and turns a
fault into an in-process recovery::

    with p2p_state.protect(build, loader=loader, max_steps=1000) as job:
        for step, batch in job:            # resumes at the right step after any recovery
            with job.step():               # a fault inside is turned into a recovery
                loss = job.model(batch).mean()
                loss.backward()
                job.optimizer.step()
                job.optimizer.zero_grad()

Python cannot re-enter a ``with`` body, so the step guard catches a fault, recovers, and tells the
iterator to rewind: the next step it yields is the one after the restored step.

Recovery (:meth:`ProtectedJob._recover`) follows the steps of ``docs/recovery.md`` from the third
on (the coordinator detects and decides): it breaks this generation's groups (*interrupt*), waits
for the coordinator's next generation and joins its groups (*communicators*), takes the census of
the copies the members hold and chooses where the state comes from (*census and plan*), rebuilds
the model, optimizer and scheduler from the factory on the new groups (*build*: FSDP2 binds its
process group when ``fully_shard`` runs, and a step cut short leaves FSDP's internal state
half-way, so nothing of the old wrapping is reused), restores every member's state (*transfer and
restore*) and restarts replication (*replicate*). A fault during recovery starts it again with the
next generation.

What to do about an exception is :func:`recovery.faults.decide`'s; the job's endings are the
exceptions of :mod:`recovery.errors`, which the entry point turns into exit codes.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from p2p_state.replicator import Replicator
from p2p_state.state import TrainingState
from recovery import phases
from recovery.checkpoint import ColdCheckpointer, complete_steps
from recovery.comms import Interrupted
from recovery.config import CAUSE_JOINED, RecoveryConfig, RecoveryRecord
from recovery.devices import snapshot_device, training_device, wire_device
from recovery.errors import ConfigurationError, GivenBack, RecoveryFailed
from recovery.faults import Action, decide, short, without_frames
from recovery.hooks import Hook, JobHooks, hooks_from_env
from recovery.planner import Source
from recovery.rebuild import Restore, build_training, restore_state
from recovery.replication import JobReplication
from recovery.restore import describe_census, gather_copies
from recovery.session import STOP_SIGNAL, CoordinatorsLost, GenerationInfo, JobEnded, Session
from recovery.source import RestoreSource, choose_restore_source
from recovery.stop import last_checkpoint, stop_with_checkpoint
from recovery.warmup import Build, capture_rng, restore_rng

logger = logging.getLogger(__name__)


class ProtectedJob:
    """A training loop that survives lost ranks; see the module docstring.

    Args:
        session: This process's membership (``p2p_state.init_process_group()``).
        build: Factory returning ``(model, optimizer)`` or ``(model, optimizer, scheduler)``,
            the model sharded with ``fully_shard`` (or DDP, or plain). Called once at the start
            and again after every recovery, on the new process groups.
        loader: A resumable loader (``state_dict``/``load_state_dict``/``set_world``/
            ``next_batch``), or ``None``: the iterator then yields ``(step, None)``.
        config: Replication, checkpoint and recovery settings.
        max_steps: Stop after this global step (``None``: until the loop is left).
    """

    def __init__(
        self,
        session: Session,
        build: Build,
        *,
        loader: Any = None,
        config: RecoveryConfig | None = None,
        max_steps: int | None = None,
    ) -> None:
        if not callable(build):
            raise TypeError(
                "protect() takes a factory that builds the sharded model and its optimizer "
                "(e.g. `def build(): ...; return model, optimizer, scheduler`): after a fault "
                "they are rebuilt on the new process groups"
            )
        self._session = session
        self._build = build
        self.loader = loader
        self.config = config or RecoveryConfig()
        self.max_steps = max_steps
        self.user_state: dict[str, Any] = {}
        """Small msgpack-able values carried with every snapshot and restored with it."""
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None
        self.state: TrainingState | None = None
        self.step_done = 0
        """The last completed step (the iterator yields ``step_done + 1`` next)."""
        self.recoveries: list[RecoveryRecord] = []
        self._hooks = JobHooks()
        self._copies = JobReplication(session, self.config, self._hooks)
        self._current: int | None = None
        """The step the iterator yielded and whose guard has not ended yet."""
        self._first_step_pending: RecoveryRecord | None = None
        self._source: Source | None = None
        """Which peers' state the last restore took (``None``: a checkpoint or the initial)."""
        self._initial_rng: dict[str, Any] = {}
        self._initial_loader: dict[str, Any] | None = None

    # -- public --------------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This process's rank in the current generation."""
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        """Ranks in the current generation."""
        return dist.get_world_size()

    @property
    def replicator(self) -> Replicator | None:
        """The replicator of this generation (``None`` before the start and after the end)."""
        return self._copies.replicator

    @property
    def checkpointer(self) -> ColdCheckpointer | None:
        """The cold checkpointer of this generation, if the job checkpoints."""
        return self._copies.checkpointer

    @property
    def generation(self) -> int:
        """The membership generation this rank trains in."""
        info = self._session.info
        return info.generation if info else 0

    def add_hook(self, hook: Hook) -> None:
        """Call ``hook(point, **info)`` at: ``built`` (model, optimizer), ``step_begin`` (step),
        ``replication_chunk`` (step, round, num_rounds; worker thread) and ``recovery_phase``
        (phase, generation) and, when the loop has ended cleanly, ``finished`` (step, state).
        For fault injection and progress reporting.

        Tools that run a script they did not write (``p2p-bench inject --script``) attach their
        hooks through ``P2P_JOB_HOOKS``: comma-separated ``module:function`` names, each called
        with the job once it is ready to train, before its first step."""
        self._hooks.add(hook)

    def __enter__(self) -> ProtectedJob:
        self._initial_rng = capture_rng()
        self._initial_loader = self.loader.state_dict() if self.loader is not None else None
        try:
            info = self._session.info
            if info is not None and info.generation > 1:
                # A spare given a rank, or a rank whose first generation was superseded: every
                # member of this generation is in the restore protocol.
                rec = RecoveryRecord(info.generation, CAUSE_JOINED, started_t=info.arrived_t)
                self._restore_into(info, rec)
            else:
                self._fresh_start()
        except ConfigurationError as e:
            self._end_misconfigured(e)
        except Exception as e:
            if self._decide(e) is not Action.RECOVER:
                self._shutdown()
                raise
            self._recover(e)
        try:
            attach = hooks_from_env()
        except ConfigurationError as e:
            self._end_misconfigured(e)
        for hook in attach:
            hook(self)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            # The last round's commit is a barrier: every rank completed every step.
            if exc_type is None and self._copies.finish():
                self._hooks.call("finished", step=self.step_done, state=self.state)
                self._copies.wait_checkpoint()
                if self._session.client is not None:
                    self._session.client.report_done()
        finally:
            self._shutdown()

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        return self

    def __next__(self) -> tuple[int, Any]:
        if self._current is not None:
            raise RuntimeError(
                f"step {self._current} was not run inside `with job.step():`; wrap each step's "
                "body in it so a fault can be turned into a recovery"
            )
        if self._session.interrupted:
            self._recover(Interrupted("a new generation arrived between steps"))
        step = self.step_done + 1
        if self.max_steps is not None and step > self.max_steps:
            raise StopIteration
        batch = self.loader.next_batch() if self.loader is not None else None
        self._current = step
        self._hooks.call("step_begin", step=step, batch=batch)
        return step, batch

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Guard one step's body: a fault inside becomes a recovery and the loop rewinds."""
        if self._current is None:
            raise RuntimeError("job.step() belongs inside `for step, batch in job:`")
        step = self._current
        fault = None
        try:
            yield
            if self._session.interrupted:
                raise Interrupted("a new generation arrived during the step")
            self._finish_step(step)
        except Exception as e:
            if self._decide(e) is not Action.RECOVER:
                raise
            fault = without_frames(e)  # they hold the failed step's GPU memory
        finally:
            self._current = None
        if fault is not None:
            self._recover(fault)

    # -- steps ---------------------------------------------------------------------------------

    def _extras(self) -> dict[str, Any]:
        extras: dict[str, Any] = {"user": self.user_state}
        if self.loader is not None:
            extras["loader"] = self.loader.state_dict()
        return extras

    def _apply_extras(self, extras: dict[str, Any]) -> None:
        self.user_state = dict(extras.get("user", {}))
        if self.loader is not None:
            if "loader" in extras:
                self.loader.load_state_dict(extras["loader"])
            self.loader.set_world(dist.get_world_size(), dist.get_rank())

    def _finish_step(self, step: int) -> None:
        """Replicate (and checkpoint) the step just done; switch generation if a resize was
        agreed on."""
        previous = self._copies.after_step(step, self._extras)
        self.step_done = step
        if self._first_step_pending is not None:
            rec = self._first_step_pending
            self._first_step_pending = None
            self._session.event(
                "first_step_done",
                generation=rec.generation,
                step=step,
                since_fault_s=time.monotonic() - rec.started_t,
            )
        if dist.get_rank() == 0:
            self._session.event("step_done", step=step)
        if previous is None:
            return
        target = self._copies.agreed_generation(previous)
        if target == STOP_SIGNAL:
            self._stop_without_coordinator(step)
        elif target is not None:
            self._switch(step)

    # -- starting ------------------------------------------------------------------------------

    def _fresh_start(self) -> None:
        ckpt = self.config.checkpoint
        if ckpt is not None and not self.config.resume and complete_steps(ckpt.root):
            raise ConfigurationError(
                f"the checkpoint directory {ckpt.root} already holds checkpoints of steps "
                f"{complete_steps(ckpt.root)}: resume from them (p2p-run --resume) or give "
                "this job an empty directory"
            )
        state = self._build_state()
        step, extras = 0, self._extras()
        if self.config.resume:
            assert ckpt is not None  # RecoveryConfig checks that resume has a checkpoint
            loaded = ColdCheckpointer(ckpt, state, group=self._copies.checkpoint_group())
            step, extras = loaded.load()
            self._apply_extras(extras)
            logger.info("rank %d resumed from the checkpoint of step %d", dist.get_rank(), step)
        self._start_replication(step, extras)

    def _build_state(self, *, restore_from: RestoreSource | None = None) -> TrainingState:
        built = build_training(
            self._build,
            blob_capacity_bytes=self.config.replication.blob_capacity_bytes,
            restore_from=restore_from,
            hooks=self._hooks,
        )
        self.model, self.optimizer, self.scheduler = built.model, built.optimizer, built.scheduler
        self.state = built.state
        return built.state

    def _start_replication(
        self, step: int, extras: dict[str, Any], *, recovering: bool = False
    ) -> None:
        assert self.state is not None
        self._copies.start(self.state, step, extras, recovering=recovering)
        self.step_done = step

    # -- recovery ------------------------------------------------------------------------------

    def _decide(self, exc: BaseException, *, recovering: bool = False) -> Action:
        comms = self._session.comms
        return decide(
            exc,
            standalone=self._session.standalone,
            aborted=self._session.interrupted or (comms is not None and comms.aborted),
            recovering=recovering,
        )

    def _recover(self, cause: BaseException) -> None:
        """Recover from ``cause``: the steps of ``docs/recovery.md`` from the interrupt on."""
        caught_t = time.monotonic()
        reached = self.step_done
        logger.warning("%s: fault (%s); recovering", self._session.identity, short(cause))
        self._break_generation()
        tried = 0
        while True:
            info = self._next_generation(cause, tried)
            rec = RecoveryRecord.after_fault(
                info.generation,
                short(cause),
                caught_t=caught_t,
                interrupted_t=self._session.interrupt_time() or info.arrived_t,
                generation_t=info.arrived_t,
                step_reached=reached,
            )
            tried = info.generation
            try:
                self._enter_generation(info, rec)
                return
            except Exception as e:
                action = self._decide(e, recovering=True)
                if action is Action.RAISE:
                    self._shutdown()
                if action is not Action.RECOVER:
                    raise
                logger.warning(
                    "%s: recovery into generation %d failed (%s); waiting for the next",
                    self._session.identity,
                    info.generation,
                    short(e),
                )
                self._session.event(
                    "recovery_abandoned", generation=info.generation, reason=short(e)
                )
                self._break_generation()
                caught_t = time.monotonic()
                cause = e

    def _break_generation(self) -> None:
        """Interrupt: this generation is over for this rank. Break its groups so nothing here
        (the replication worker) or at a peer stays blocked on them."""
        if self._session.comms is not None:
            self._session.comms.abort()
        self._copies.break_off()

    def _next_generation(self, cause: BaseException, after: int) -> GenerationInfo:
        """The coordinator's next generation after a fault.

        Raises:
            RecoveryFailed: none came in time (this rank reported itself failed).
            JobEnded: the coordinator ended the job.
        """
        try:
            return self._session.next_generation(self.config.fault_wait_s, after=after)
        except TimeoutError as e:
            # Nobody else saw a fault: this rank's own collective failed. Report it so the
            # coordinator replaces this rank, and leave.
            self._session.report_failure(f"{short(cause)}; {e}", fatal=False)
            self._shutdown()
            raise RecoveryFailed(str(e)) from cause
        except CoordinatorsLost as e:
            self._shutdown()
            raise self._no_stop_checkpoint(e, cause) from None
        except JobEnded:
            self._shutdown()
            raise

    def _switch(self, step: int) -> None:
        """Move to the graceful generation agreed on, after ``step`` committed everywhere."""
        t0 = time.monotonic()
        try:
            info = self._session.next_generation(self.config.fault_wait_s, after=self.generation)
        except CoordinatorsLost as e:
            self._shutdown()
            raise self._no_stop_checkpoint(e, None) from None
        rec = RecoveryRecord(info.generation, "resize", started_t=t0)
        self._copies.stop_for_resize()
        try:
            self._enter_generation(info, rec)
        except Exception as e:
            if self._decide(e) is not Action.RECOVER:
                raise
            self._recover(e)

    def _enter_generation(self, info: GenerationInfo, rec: RecoveryRecord) -> None:
        """Join ``info``'s groups and restore into them.

        Raises:
            GivenBack: ``info`` has no place for this process.
        """
        try:
            with self._hooks.phase(rec, phases.COMMUNICATORS):
                self._session.join(info)
            self._restore_into(info, rec)
        except Exception as e:
            if self._decide(e) is not Action.LEAVE:
                raise
            logger.info(
                "%s has no rank in generation %d: leaving", self._session.identity, info.generation
            )
            self._shutdown()
            raise GivenBack(str(e)) from None

    def _restore_into(self, info: GenerationInfo, rec: RecoveryRecord) -> None:
        """The restore protocol of one generation; every member runs it together."""
        rep_cfg = self.config.replication
        wire = wire_device(rep_cfg, training_device(self._session.device_type))
        with self._hooks.phase(rec, phases.PLAN):  # census
            group = self._copies.replication_group()
            held = gather_copies(self._copies.stores.all, group, wire, rep_cfg.timeout_s)
        source = self._restore_source(held, info.world_size)
        with self._hooks.phase(rec, phases.BUILD):
            if source is RestoreSource.INITIAL:
                restore_rng(self._initial_rng)
            had_model = self.model is not None
            self.model = self.optimizer = self.scheduler = self.state = None
            if had_model and self._session.device_type == "cuda":
                # An FSDP2 model and its optimizer sit in reference cycles (modules, hooks,
                # states): until a collection their GPU memory stays allocated under the new
                # generation's. One full collection, about 0.1 s, against an out-of-memory.
                gc.collect()
            state = self._build_state(
                restore_from=None if source is RestoreSource.INITIAL else source
            )
        rank = info.rank_of(self._session.identity)
        assert rank is not None  # joining checked it
        where = Restore(
            held=held,
            stores=self._copies.stores.all,
            replication_group=group,
            checkpoint_group=self._copies.checkpoint_group,
            rank=rank,
            world_size=info.world_size,
            wire_device=wire,
            snapshot_device=snapshot_device(rep_cfg, state),
        )
        initial = {"user": {}, "loader": self._initial_loader} if self.loader else {"user": {}}
        restored = restore_state(
            source,
            state,
            where,
            self.config,
            initial_extras=initial,
            rec=rec,
            hooks=self._hooks,
        )
        self._source = restored.peers
        step, extras = restored.step, restored.extras
        with self._hooks.phase(rec, phases.DATA):
            self._apply_extras(extras)
        if info.directive == "checkpoint":
            self._checkpoint_and_stop(info, step)
        with self._hooks.phase(rec, phases.REPLICATE):
            self._start_replication(step, extras, recovering=True)
        if self.checkpointer is not None:
            # The fault cut short any checkpoint in progress: the cold fallback must not
            # fall behind for good when faults come faster than a save takes.
            with self._hooks.phase(rec, phases.CHECKPOINT):
                self._copies.catch_up(step, extras)
        self._record(info, rec, source, step)

    def _restore_source(self, held: list[set[Any]], world: int) -> RestoreSource:
        ckpt = self.config.checkpoint
        try:
            return choose_restore_source(
                held,
                world,
                checkpoint_root=ckpt.root if ckpt is not None else None,
                checkpoint_steps=complete_steps,
            )
        except RecoveryFailed as e:
            logger.error("census of the copies held: %s", describe_census(held))
            self._session.report_failure(str(e), fatal=True)
            raise

    def _record(
        self, info: GenerationInfo, rec: RecoveryRecord, source: RestoreSource, step: int
    ) -> None:
        rank = info.rank_of(self._session.identity)
        rec.source, rec.step = source, step
        self.recoveries.append(rec)
        self._first_step_pending = rec
        self._session.event("recovery_done", **rec.done_event(rank, info.world_size))
        logger.warning("%s", rec.summary(rank))

    def _checkpoint_and_stop(self, info: GenerationInfo, step: int) -> None:
        """Write the restored ``step`` as the stop checkpoint and end the job.

        Raises:
            JobStopped: always, once the checkpoint is written.
        """
        assert self.state is not None
        stopped = stop_with_checkpoint(
            self._session,
            self.config,
            self.state,
            step,
            self._extras(),
            group=self._copies.checkpoint_group(),
            source=self._source,
            stores=self._copies.stores.all,
            reason=info.reason,
        )
        self._shutdown()
        raise stopped

    def _stop_without_coordinator(self, step: int) -> None:
        """No coordinator is left and every rank agreed, through the commit of replication,
        to stop after ``step``: write it as the stop checkpoint and end the job.

        Raises:
            JobStopped: always, once the checkpoint is written.
        """
        assert self.state is not None
        # A periodic save of this very step began in after_step(): it is the stop checkpoint.
        # Any other in flight ends first (its collectives run on the same group). Every rank
        # decides alike: the steps saved are the same everywhere.
        ckpt = self.config.checkpoint
        written = (
            self.checkpointer is not None and ckpt is not None and step % ckpt.every_steps == 0
        )
        self._copies.wait_checkpoint()
        lost = self._session.coordinators_lost or []
        stopped = stop_with_checkpoint(
            self._session,
            self.config,
            self.state,
            step,
            self._extras(),
            group=self._existing_checkpoint_group(),
            source=None,  # every rank of this generation holds its own state of ``step``
            stores=self._copies.stores.all,
            reason=f"no coordinator is left ({', '.join(lost)}); the ranks agreed to stop "
            f"after step {step}",
            written=written,
        )
        self._shutdown()
        raise stopped

    def _existing_checkpoint_group(self) -> dist.ProcessGroup:
        """A group of this generation to checkpoint on that exists already: with no
        coordinator, no store is left to form a new one through. The checkpoint group if the
        job checkpoints, else the default group (no collective is in flight on it between
        steps)."""
        comms = self._session.comms
        assert comms is not None and comms.default is not None  # a member has its groups
        return comms.groups.get("checkpoint", comms.default)

    def _no_stop_checkpoint(
        self, lost: CoordinatorsLost, cause: BaseException | None
    ) -> RecoveryFailed:
        """No coordinator is left and this generation could not agree on a step to stop at
        (a fault broke its groups): say so, naming the last complete checkpoint."""
        reason = (
            f"the ranks could not agree on a step to stop at (generation {self.generation} "
            "broke: a rank is lost or hung too), so no stop checkpoint was written; "
            f"{last_checkpoint(self.config)}"
        )
        self._session.event(
            "stop_checkpoint_missed",
            reason=reason,
            cause=short(cause) if cause is not None else "a resize was pending",
        )
        if self._session.client is not None:
            self._session.client.report_no_checkpoint(reason)
        return RecoveryFailed(f"{lost.reason}: {reason}")

    # -- plumbing ------------------------------------------------------------------------------

    def _end_misconfigured(self, error: ConfigurationError) -> None:
        """A user mistake: one line from p2p-run (the coordinator ends the job with it)."""
        self._session.report_failure(str(error), fatal=True)
        self._shutdown()
        raise error

    def _shutdown(self) -> None:
        self._copies.shutdown()
        if self.loader is not None and hasattr(self.loader, "close"):
            self.loader.close()
