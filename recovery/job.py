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

Recovery (:meth:`ProtectedJob._recover`) runs the steps of ``docs/recovery.md`` from the
interrupt on, and again with the next generation if a fault cuts it short: the census, build
and restore are the :class:`recovery.rebuild.Rebuilder`'s, the replication the
:class:`recovery.replication.JobReplication`'s, what to do about an exception
:func:`recovery.faults.decide`'s. The job's endings are the exceptions of
:mod:`recovery.errors`, which the entry point turns into exit codes.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Mapping
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from p2p_state.layout import LayoutMismatchError
from p2p_state.replicator import Replicator
from p2p_state.state import TrainingState
from recovery import phases
from recovery import stateful as stateful_objects
from recovery.accumulation import CarriedGradients
from recovery.checkpoint import ColdCheckpointer
from recovery.comms import Interrupted
from recovery.config import RecoveryConfig
from recovery.errors import ConfigurationError, GivenBack, RecoveryFailed
from recovery.faults import Action, decide, short, without_frames
from recovery.generation import GenerationInfo
from recovery.hooks import Hook, JobHooks, hooks_from_env
from recovery.rebuild import Built, Rebuilder
from recovery.records import CAUSE_JOINED, RecoveryLog, RecoveryRecord
from recovery.replication import JobReplication
from recovery.retired import retire
from recovery.session import STOP_SIGNAL, CoordinatorsLost, JobEnded, Session
from recovery.stop import no_stop_checkpoint, stop_on_request, stop_without_coordinator
from recovery.unguarded import FIX, UnguardedCollectives
from recovery.warmup import Build

logger = logging.getLogger(__name__)

#: What the engine calls on a loader: its batches, its position, and its share after a resize.
LOADER_METHODS = ("next_batch", "state_dict", "load_state_dict", "set_world")


def checked_loader(loader: Any) -> Any:
    """``protect()``'s ``loader``, checked.

    Raises:
        TypeError: it lacks a method of :data:`LOADER_METHODS` (a torch ``DataLoader`` has
            none of them); the message names the way out.
    """
    if loader is None:
        return None
    missing = [m for m in LOADER_METHODS if not callable(getattr(loader, m, None))]
    if not missing:
        return loader
    its_dataset = " (such as your DataLoader's .dataset, with its collate_fn)"
    raise TypeError(
        f"protect(loader=...): a {type(loader).__name__} has no {', '.join(missing)}, which the "
        "engine rewinds the data with after a recovery; give "
        "dataload.loader.DatasetLoader(dataset, global_batch=..., world_size=..., rank=...) for "
        f"a map-style dataset{its_dataset if hasattr(loader, 'dataset') else ''}, or a loader "
        "of your own with next_batch(), state_dict(), load_state_dict() and set_world()"
    )


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
        stateful: Objects the loop keeps beside the model, by name (e.g. a GradScaler):
            carried with every snapshot and put back with it (:mod:`recovery.stateful`).
    """

    def __init__(
        self,
        session: Session,
        build: Build,
        *,
        loader: Any = None,
        config: RecoveryConfig | None = None,
        max_steps: int | None = None,
        stateful: Mapping[str, Any] | None = None,
    ) -> None:
        self._session = session
        self.loader = checked_loader(loader)
        self.config = config or RecoveryConfig()
        self.max_steps = max_steps
        self.user_state: dict[str, Any] = {}
        """Small msgpack-able values carried with every snapshot and restored with it."""
        self.stateful = stateful_objects.checked(stateful)
        """The objects given as ``stateful``, by name."""
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None
        self.state: TrainingState | None = None
        self.step_done = 0
        """The last completed step (the iterator yields ``step_done + 1`` next)."""
        self._hooks = JobHooks()
        self._copies = JobReplication(session, self.config, self._hooks)
        self._log = RecoveryLog(session)
        self._rebuild = Rebuilder(session, self.config, build, self._copies, self._hooks)
        self._current: int | None = None
        """The step the iterator yielded and whose guard has not ended yet."""
        self._unguarded = UnguardedCollectives(self._engine_groups)
        self._carried = CarriedGradients()
        self._captured_stateful: dict[str, Any] = {}
        """The ``stateful`` objects' states as of the last step done (captured with its extras,
        or restored)."""

    def _engine_groups(self) -> list[dist.ProcessGroup]:
        """The process groups the engine made for this generation (not the default one)."""
        comms = self._session.comms
        return [] if comms is None else list(comms.groups.values())

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
    def recoveries(self) -> list[RecoveryRecord]:
        """The recoveries this rank lived through, in order."""
        return self._log.records

    @property
    def generation(self) -> int:
        """The membership generation this rank trains in."""
        info = self._session.info
        return info.generation if info else 0

    def add_hook(self, hook: Hook) -> None:
        """Call ``hook(point, **info)`` at every point of :mod:`recovery.hooks` (for fault
        injection and progress reporting; ``P2P_JOB_HOOKS`` names hooks in the environment)."""
        self._hooks.add(hook)

    def __enter__(self) -> ProtectedJob:
        try:
            stateful_objects.check_small(self.stateful)
            self._rebuild.remember_initial(self._extras())
            attach = hooks_from_env()  # a name that cannot load is refused before any build
            info = self._session.info
            if info is not None and info.generation > 1:
                # A spare given a rank, or a rank whose first generation was superseded: every
                # member of this generation is in the restore protocol.
                rec = RecoveryRecord(info.generation, CAUSE_JOINED, started_t=info.arrived_t)
                if not info.graceful:  # a graceful one is joined when its members switch
                    rec.phases[phases.COMMUNICATORS] = self._session.joined_t - info.arrived_t
                with self._hooks.phase(rec, phases.COMMUNICATORS):
                    self._copies.form_groups()
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
        for hook in attach:
            hook(self)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        # A fault that reaches here was raised outside every step's guard: no recovery from it.
        outside = isinstance(exc, Exception) and self._decide(exc) is Action.RECOVER
        try:
            # The last round's commit is a barrier: every rank completed every step.
            if exc_type is None and self._copies.finish():
                self._hooks.call(
                    "finished", step=self.step_done, state=self.state, extras=self._extras()
                )
                self._copies.wait_checkpoint()
                if self._session.client is not None:
                    self._session.client.report_done()
        finally:
            self._shutdown()
        if outside:
            raise RecoveryFailed(
                f"a fault outside `with job.step():` after step {self.step_done} ({short(exc)}): "
                f"the loop cannot be resumed from there, so this rank leaves; {FIX}"
            ) from None

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        return self

    def __next__(self) -> tuple[int, Any]:
        if self._current is not None:
            raise RuntimeError(
                f"step {self._current} was not run inside `with job.step():`; wrap each step's "
                "body in it so a fault can be turned into a recovery"
            )
        self._unguarded.guarded(self.step_done)
        if self._session.interrupted:
            self._recover(Interrupted("a new generation arrived between steps"))
        while True:
            step = self.step_done + 1
            if self.max_steps is not None and step > self.max_steps:
                raise StopIteration
            batch, fault = self._next_batch()
            if fault is None:
                break
            self._recover(fault)  # the restored loader gives the batch of the step after
        self._unguarded.unguarded()
        self._current = step
        self._hooks.call("step_begin", step=step, batch=batch)
        return step, batch

    def _next_batch(self) -> tuple[Any, BaseException | None]:
        """The loader's next batch, or the fault its own collectives met (a loader that
        broadcasts what rank 0 read, say): the loader runs inside the engine, under its guard."""
        if self.loader is None:
            return None, None
        try:
            return self.loader.next_batch(), None
        except Exception as e:
            if isinstance(e, ConfigurationError):
                self._end_misconfigured(e)
            if self._decide(e) is not Action.RECOVER:
                raise
            return None, without_frames(e)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Guard one step's body: a fault inside becomes a recovery and the loop rewinds."""
        if self._current is None:
            raise RuntimeError("job.step() belongs inside `for step, batch in job:`")
        step = self._current
        self._unguarded.guarded(self.step_done)
        self._carried.step_began()
        fault = None
        try:
            yield
            if self._session.interrupted:
                raise Interrupted("a new generation arrived during the step")
            self._finish_step(step)
        except Exception as e:
            if isinstance(e, ConfigurationError):
                self._end_misconfigured(e)  # every rank makes the mistake: the job ends with it
            if self._decide(e) is not Action.RECOVER:
                raise
            fault = without_frames(e)  # they hold the failed step's GPU memory
        finally:
            self._current = None
        if fault is not None:
            self._recover(fault)
        self._unguarded.unguarded()

    # -- steps ---------------------------------------------------------------------------------

    def _extras(self) -> dict[str, Any]:
        extras: dict[str, Any] = {"user": self.user_state}
        if self.loader is not None:
            extras["loader"] = self.loader.state_dict()
        if self.stateful:
            extras["stateful"] = self._captured_stateful = stateful_objects.capture(self.stateful)
        return extras

    def _apply_extras(self, extras: dict[str, Any]) -> None:
        self.user_state = dict(extras.get("user", {}))
        self._captured_stateful = extras.get("stateful", {})
        if self.stateful:
            stateful_objects.restore(self.stateful, extras.get("stateful", {}))
        if self.loader is not None:
            if "loader" in extras:
                self.loader.load_state_dict(extras["loader"])
            self.loader.set_world(dist.get_world_size(), dist.get_rank())

    def _finish_step(self, step: int) -> None:
        """Replicate (and checkpoint) the step just done; switch generation if a resize was
        agreed on."""
        kept, before = self._copies.keeps(step), self._captured_stateful
        try:
            previous = self._copies.after_step(step, self._extras)
        except LayoutMismatchError as e:  # the loop changed the model: every rank does
            raise ConfigurationError(str(e)) from None
        assert self.model is not None  # built before the first step
        self._carried.step_ended(step, self.model, kept, before, self._captured_stateful)
        self.step_done = step
        self._log.step_done(step, dist.get_rank())
        if previous is None:
            return
        target = self._copies.agreed_generation(previous)
        if target == STOP_SIGNAL:
            assert self.state is not None
            self._end(
                stop_without_coordinator(
                    self._session, self.config, self.state, step, self._extras(), self._copies
                )
            )
        if target is not None:
            self._switch(step)

    # -- starting ------------------------------------------------------------------------------

    def _fresh_start(self) -> None:
        self._rebuild.check_fresh_start()
        self._copies.form_groups()
        state = self._take(self._rebuild.build())
        step, extras = 0, self._extras()
        if self.config.resume:
            step, extras = self._rebuild.resume(state)
            self._apply_extras(extras)
            logger.info("rank %d resumed from the checkpoint of step %d", dist.get_rank(), step)
        self._copies.start(state, step, extras, recovering=False)
        self.step_done = step

    def _take(self, built: Built) -> TrainingState:
        self.model, self.optimizer, self.scheduler = built.model, built.optimizer, built.scheduler
        self._carried.watch(built.optimizer)
        self.state = built.state
        return built.state

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
        left_t = self._break_generation()
        tried = 0
        while True:
            info = self._next_generation(cause, tried)
            rec = self._log.after_fault(
                info, short(cause), caught_t=caught_t, left_t=left_t, step_reached=reached
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
                self._log.abandoned(info, short(e))
                caught_t = time.monotonic()
                left_t = self._break_generation()
                cause = e

    def _break_generation(self) -> float:
        """Interrupt: this generation is over for this rank. Break its groups so nothing here
        (the replication worker) or at a peer stays blocked on them.

        Returns:
            When it was done (``time.monotonic()``).
        """
        if self._session.comms is not None:
            self._session.comms.abort()
        self._copies.break_off()
        return time.monotonic()

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
            self._end(
                no_stop_checkpoint(self._session, self.config, self.generation, e, short(cause))
            )
        except JobEnded:
            self._shutdown()
            raise

    def _switch(self, step: int) -> None:
        """Move to the graceful generation agreed on, after ``step`` committed everywhere."""
        t0 = time.monotonic()
        try:
            info = self._session.next_generation(self.config.fault_wait_s, after=self.generation)
        except CoordinatorsLost as e:
            pending = "a resize was pending"
            self._end(no_stop_checkpoint(self._session, self.config, self.generation, e, pending))
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
                self._copies.form_groups()
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
        with self._hooks.phase(rec, phases.PLAN):
            census = self._rebuild.census()
        source = self._rebuild.source(census, info.world_size)
        with self._hooks.phase(rec, phases.BUILD):
            replacing = self.model is not None
            if replacing:
                retire(self.model, self.optimizer, self.scheduler, info.generation)
            self.model = self.optimizer = self.scheduler = self.state = None
            state = self._take(self._rebuild.build(source, replacing=replacing))
        restored = self._rebuild.restore(source, census, state, info, rec)
        step, extras = restored.step, restored.extras
        with self._hooks.phase(rec, phases.DATA):
            self._apply_extras(extras)
        if info.directive == "checkpoint":
            args = (self._session, self.config, self._copies, state, restored, self._extras())
            self._end(stop_on_request(*args, reason=info.reason))
        with self._hooks.phase(rec, phases.REPLICATE):
            self._copies.start(state, step, extras, recovering=True)
            self.step_done = step
        if self.checkpointer is not None:
            # The fault cut short any checkpoint in progress: the cold fallback must not
            # fall behind for good when faults come faster than a save takes.
            with self._hooks.phase(rec, phases.CHECKPOINT):
                self._copies.catch_up(step, extras)
        self._log.done(rec, info, source, step)

    # -- plumbing ------------------------------------------------------------------------------

    def _end_misconfigured(self, error: ConfigurationError) -> NoReturn:
        """A user mistake: one line from p2p-run (the coordinator ends the job with it)."""
        self._session.report_failure(str(error), fatal=True)
        self._end(error)

    def _end(self, ending: Exception) -> NoReturn:
        """Shut down, then raise ``ending`` (without the chain that led here)."""
        self._shutdown()
        raise ending from None

    def _shutdown(self) -> None:
        self._copies.shutdown()
        if self.loader is not None and hasattr(self.loader, "close"):
            self.loader.close()
