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

Recovery (:meth:`ProtectedJob._recover`) waits for the coordinator's next generation, joins its
process groups, rebuilds the model, optimizer and scheduler from the factory on the new groups
(FSDP2 binds its process group when ``fully_shard`` runs, and a step cut short leaves FSDP's
internal state half-way, so nothing of the old wrapping is reused), restores every member's state
from the copies the members hold (or from the cold checkpoint when no copy of some shard survives),
and restarts replication. A fault during recovery starts it again with the next generation.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from p2p_state.memory import BufferPool
from p2p_state.placement import Placement
from p2p_state.replicator import ReplicationError, Replicator, state_device
from p2p_state.state import TrainingState
from p2p_state.transfer import TransferError
from recovery.checkpoint import CheckpointConfig, ColdCheckpointer, complete_steps
from recovery.comms import Interrupted
from recovery.config import (
    CAUSE_JOINED,
    ConfigurationError,
    RecoveryConfig,
    RecoveryFailed,
    RecoveryRecord,
)
from recovery.planner import choose_source, shard_layout
from recovery.restore import (
    NoSurvivingCopy,
    describe_gap,
    find_copy,
    gather_copies,
    restore_from_peers,
)
from recovery.session import GenerationInfo, JobEnded, NotAMember, Session
from recovery.warmup import Build, building_for_restore, capture_rng, restore_rng

#: Hooks to attach to every protected job of the process (see :meth:`ProtectedJob.add_hook`).
ENV_JOB_HOOKS = "P2P_JOB_HOOKS"

logger = logging.getLogger(__name__)

#: After a fault, how long a rank waits for its replication worker to leave the aborted round
#: before it goes on without it (the worker only ever writes slots that are not published).
#: A worker whose transfers gloo fails on the abort leaves within milliseconds; one blocked on
#: a receive whose payload was partly read when its pair failed never does before its deadline
#: (gloo signals the failure to pending and posted operations, not to the one being read), so
#: waiting longer only adds to the recovery. Its pair is closed by then, so nothing writes into
#: its buffers any more; they are recycled if it has left by the time the new replicator is made.
_ABANDON_WAIT_S = 0.05

#: Messages of gloo and NCCL errors that mean a peer or a link failed, not a bug in the step.
_COMM_FAILURES = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Read error",
    "Write error",
    "Timed out",
    "timed out",
    "NCCL error",
    "NCCL communicator was aborted",
    "ProcessGroup",
    "Socket",
)


Hook = Callable[..., None]


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
        self.replicator: Replicator | None = None
        self.checkpointer: ColdCheckpointer | None = None
        self.step_done = 0
        """The last completed step (the iterator yields ``step_done + 1`` next)."""
        self.recoveries: list[RecoveryRecord] = []
        self._stores: list[Replicator] = []
        self._pool: BufferPool | None = None
        self._restored_step = -1
        self._current: int | None = None
        self._hooks: list[Hook] = []
        self._first_step_pending: RecoveryRecord | None = None
        self._initial_rng: dict[str, Any] = {}
        self._source = None
        self._last_replicated = -1
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
        self._hooks.append(hook)

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
            # A user mistake: one line from p2p-run (the coordinator ends the job with it).
            self._session.report_failure(str(e), fatal=True)
            self._shutdown()
            logger.error("%s", e)
            raise SystemExit(2) from None
        except BaseException as e:
            if not self._is_fault(e):
                self._shutdown()
                raise
            self._recover(e)
        self._attach_env_hooks()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if exc_type is None and self.replicator is not None:
                # The last round's commit is a barrier: every rank completed every step.
                self.replicator.flush()
                self._call_hooks("finished", step=self.step_done, state=self.state)
                if self.checkpointer is not None:
                    self.checkpointer.wait()
                if self._session.client is not None:
                    self._session.client.report_done()
        finally:
            self._shutdown()
        if exc_type is not None and issubclass(exc_type, RecoveryFailed):
            # The coordinator has the reason and p2p-run reports it; end this rank quietly.
            logger.error("%s: %s", self._session.identity, exc)
            raise SystemExit(1) from None

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
        self._call_hooks("step_begin", step=step, batch=batch)
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
        except BaseException as e:
            if not self._is_fault(e):
                raise
            fault = _without_frames(e)  # they hold the failed step's GPU memory
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
        # A graceful resize (growing into spares, giving ranks back) is agreed on through the
        # commit of replication, so every rank switches after the same step and none is lost.
        self.replicator.signal = self._session.pending_graceful()
        previous = self._last_replicated
        if len(self._stores) > 1:
            self._release_old_stores(step)
        took = self.replicator.replicate(step, self._extras())
        if self.checkpointer is not None:
            self.checkpointer.maybe_save(step, self._extras())
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
        if took:
            self._last_replicated = step
            # replicate() waited for the previous round: its agreement is known on every rank.
            target = self.replicator.agreed_signal(previous) if previous >= 0 else None
            if target and target > self.generation:
                self.replicator.flush()  # this step is committed everywhere: nothing is lost
                self._switch(step)

    def _release_old_stores(self, step: int) -> None:
        """Once the new generation's copies cover the restored step everywhere, the previous
        generations' stores are no longer needed: their memory goes to the new slots."""
        if self.replicator.due(step):
            # replicate() is about to wait for the round in flight anyway: wait first, so the
            # snapshot it takes can already go into an old buffer.
            self.replicator.flush()
        if self.replicator.committed_step < self._restored_step:
            return
        given = sum(old.give_back(self._pool) for old in self._stores[1:])
        self._session.event(
            "previous_copies_released",
            generation=self.generation,
            step=step,
            given_bytes=given,
            reused_bytes=self._pool.reused_bytes,
        )
        self._stores = self._stores[:1]
        self._pool = None

    # -- starting ------------------------------------------------------------------------------

    def _build_state(self, *, restore_from: str | None = None) -> None:
        """Run the factory and lay its state out; ``restore_from`` (peers or checkpoint): every
        value is overwritten from there next, so the factory may skip initialising them."""
        with building_for_restore() if restore_from else contextlib.nullcontext():
            built = self._build()
        if not isinstance(built, tuple) or len(built) not in (2, 3):
            raise TypeError(
                "the factory given to protect() must return (model, optimizer) or "
                f"(model, optimizer, scheduler), not {type(built).__name__}"
            )
        self.model, self.optimizer = built[0], built[1]
        self.scheduler = built[2] if len(built) == 3 else None
        self.state = TrainingState(
            self.model,
            self.optimizer,
            self.scheduler,
            blob_capacity=self.config.replication.blob_capacity_bytes,
            keep_optimizer_state=restore_from == "peers",
        )
        self._call_hooks("built", model=self.model, optimizer=self.optimizer)

    def _replication_group(self) -> dist.ProcessGroup:
        _, backend = Replicator.backend_for(self.config.replication, self._device())
        return self._session.comms.group("replication", backend)

    def _checkpoint_group(self) -> dist.ProcessGroup:
        return self._session.comms.group("checkpoint", "gloo")

    def _start_replication(
        self, step: int, extras: dict[str, Any], *, recovering: bool = False
    ) -> None:
        info = self._session.info
        k = self.config.replication.k
        if k >= dist.get_world_size():
            raise ConfigurationError(
                f"every shard is copied to k={k} other ranks, so the job needs at least "
                f"{k + 1} ranks; it has {dist.get_world_size()}: run more ranks or lower k "
                "(p2p-run --replicas, ReplicationConfig.k)"
            )
        if recovering:
            # The previous generations' stores keep the copies of the restored step (the
            # fallback until the new ones are made); the rest of their memory is reused.
            if self._pool is None:
                self._pool = BufferPool()
            for old in self._stores:
                old.give_back(self._pool, keep_step=step)
        rep = Replicator(
            self.state,
            self.config.replication,
            generation=info.generation if info else 0,
            on_replicated=self._on_replicated,
            progress_hook=self._on_chunk,
            group=self._replication_group(),
            placement=self._placement(info),
            recycle=self._pool if recovering else None,  # else prefaulted, at the job's start
        )
        self.replicator = rep
        self._stores.insert(0, rep)
        self._restored_step = step
        self._last_replicated = step
        ckpt = self.config.checkpoint
        self.checkpointer = (
            ColdCheckpointer(ckpt, self.state, group=self._checkpoint_group()) if ckpt else None
        )
        # The restored (or initial) state is replicated first, so a fault before the next step
        # still finds a copy of every shard.
        rep.replicate(step, extras)
        self.step_done = step

    def _fresh_start(self) -> None:
        ckpt = self.config.checkpoint
        if ckpt is not None and not self.config.resume and complete_steps(ckpt.root):
            raise ConfigurationError(
                f"the checkpoint directory {ckpt.root} already holds checkpoints of steps "
                f"{complete_steps(ckpt.root)}: resume from them (p2p-run --resume) or give "
                "this job an empty directory"
            )
        self._build_state()
        step, extras = 0, self._extras()
        if self.config.resume:
            ckpt = ColdCheckpointer(
                self.config.checkpoint, self.state, group=self._checkpoint_group()
            )
            step, extras = ckpt.load()
            self._apply_extras(extras)
            logger.info("rank %d resumed from the checkpoint of step %d", dist.get_rank(), step)
        self._start_replication(step, extras)

    # -- faults --------------------------------------------------------------------------------

    def _is_fault(self, exc: BaseException) -> bool:
        if isinstance(exc, (KeyboardInterrupt, SystemExit, JobEnded, RecoveryFailed)):
            return False
        if self._session.standalone:
            return False  # nobody to recover with: the error stands
        if self._session.interrupted:
            return True
        if isinstance(exc, (Interrupted, ReplicationError, TransferError, dist.DistError)):
            return True
        return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _COMM_FAILURES)

    def _recover(self, cause: BaseException) -> None:
        caught_t = time.monotonic()
        reached = self.step_done
        logger.warning("%s: fault (%s); recovering", self._session.identity, _short(cause))
        # This generation is over for this rank: break its groups so nothing here (the
        # replication worker) or at a peer stays blocked on them.
        if self._session.comms is not None:
            self._session.comms.abort()
        for store in self._stores:
            store.abandon(_ABANDON_WAIT_S)
        if self.checkpointer is not None:
            self.checkpointer.abandon()
            self.checkpointer = None
        tried = 0
        while True:
            try:
                info = self._session.next_generation(self.config.fault_wait_s, after=tried)
            except TimeoutError as e:
                # Nobody else saw a fault: this rank's own collective failed. Report it so the
                # coordinator replaces this rank, and leave.
                self._session.report_failure(f"{_short(cause)}; {e}", fatal=False)
                self._shutdown()
                raise RecoveryFailed(str(e)) from cause
            except JobEnded as e:
                self._shutdown()
                raise SystemExit(e.code or 1) from None
            arrived = self._session.interrupt_time() or info.arrived_t
            rec = RecoveryRecord(
                info.generation,
                _short(cause),
                started_t=min(arrived, caught_t),
                step_reached=reached,
            )
            # From the coordinator's word to the training thread leaving the step; or, when a
            # collective failed first, from that failure to the coordinator's word.
            rec.phases["interrupt"] = max(0.0, caught_t - arrived)
            rec.phases["wait"] = max(0.0, info.arrived_t - caught_t)
            tried = info.generation
            try:
                with self._phase(rec, "communicators"):
                    self._session.join(info)
                self._restore_into(info, rec)
                return
            except NotAMember:
                logger.info("this process has no rank in generation %d: leaving", info.generation)
                self._shutdown()
                raise SystemExit(0) from None
            except (RecoveryFailed, JobEnded, SystemExit, KeyboardInterrupt):
                raise
            except BaseException as e:
                if not self._is_fault(e) and not isinstance(e, NoSurvivingCopy):
                    self._shutdown()
                    raise
                logger.warning(
                    "%s: recovery into generation %d failed (%s); waiting for the next",
                    self._session.identity,
                    info.generation,
                    _short(e),
                )
                self._session.event(
                    "recovery_abandoned", generation=info.generation, reason=_short(e)
                )
                if self._session.comms is not None:
                    self._session.comms.abort()
                for store in self._stores:
                    store.abandon(_ABANDON_WAIT_S)
                caught_t = time.monotonic()
                cause = e

    def _switch(self, step: int) -> None:
        """Move to the graceful generation agreed on, after ``step`` committed everywhere."""
        t0 = time.monotonic()
        info = self._session.next_generation(self.config.fault_wait_s, after=self.generation)
        rec = RecoveryRecord(info.generation, "resize", started_t=t0)
        for store in self._stores:
            store.abandon()
        if self.checkpointer is not None:
            self.checkpointer.wait()
            self.checkpointer = None
        try:
            with self._phase(rec, "communicators"):
                self._session.join(info)
            self._restore_into(info, rec)
        except NotAMember:
            logger.info(
                "%s was given back by generation %d: leaving",
                self._session.identity,
                info.generation,
            )
            self._shutdown()
            raise SystemExit(0) from None
        except BaseException as e:
            if not self._is_fault(e):
                raise
            self._recover(e)

    def _restore_into(self, info: GenerationInfo, rec: RecoveryRecord) -> None:
        """The restore protocol of one generation; every member runs it together."""
        rank, world = info.rank_of(self._session.identity), info.world_size
        rep_cfg = self.config.replication
        wire = self._wire_device()
        with self._phase(rec, "plan"):
            group = self._replication_group()
            held = gather_copies(self._stores, group, wire, rep_cfg.timeout_s)
        mode = "peers" if choose_source(held, world) is not None else self._fallback_mode(held)
        with self._phase(rec, "build"):
            if mode == "initial":
                restore_rng(self._initial_rng)
            self.model = self.optimizer = self.scheduler = self.state = None
            self._build_state(restore_from=None if mode == "initial" else mode)
        extras: dict[str, Any]
        self._source = None
        if mode == "peers":
            outcome = restore_from_peers(
                self.state,
                self._stores,
                held,
                group,
                rank,
                world,
                memory=self._snapshot_device(),
                chunk_bytes=rep_cfg.chunk_bytes,
                timeout_s=rep_cfg.timeout_s,
                wire_device=wire,
                on_phase=lambda name: self._call_hooks(
                    "recovery_phase", phase=name, generation=info.generation
                ),
            )
            rec.phases["plan"] += outcome.plan_s
            rec.phases["transfer"] = outcome.transfer_s
            rec.phases["restore"] = outcome.restore_s
            rec.bytes_received = outcome.bytes_received
            step, extras = outcome.step, outcome.extras
            self._source = outcome.source
        elif mode == "checkpoint":
            with self._phase(rec, "restore"):
                ckpt = ColdCheckpointer(
                    self.config.checkpoint, self.state, group=self._checkpoint_group()
                )
                step, extras = ckpt.load()
        else:  # nothing was replicated yet: start again from the initial state
            step = 0
            extras = {"user": {}, "loader": self._initial_loader} if self.loader else {"user": {}}
        with self._phase(rec, "data"):
            self._apply_extras(extras)
        if info.directive == "checkpoint":
            self._checkpoint_and_stop(info, step)
        with self._phase(rec, "replicate"):
            self._start_replication(step, extras, recovering=True)
        if self.checkpointer is not None:
            # The fault cut short any checkpoint in progress: the cold fallback must not
            # fall behind for good when faults come faster than a save takes.
            with self._phase(rec, "checkpoint"):
                self.checkpointer.catch_up(step, extras)
        rec.source, rec.step = mode, step
        self.recoveries.append(rec)
        self._first_step_pending = rec
        self._session.event(
            "recovery_done",
            generation=info.generation,
            rank=rank,
            world_size=world,
            restored_from=mode,
            step=step,
            phases=rec.phases,
            bytes_received=rec.bytes_received,
            cause=rec.cause,
            started_t=rec.started_t,
            step_reached=rec.step_reached,
        )
        logger.warning(
            "rank %d: restored step %d from %s in generation %d (%s)",
            rank,
            step,
            mode,
            info.generation,
            ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in rec.phases.items()),
        )

    def _fallback_mode(self, held: list[set]) -> str:
        """Where the state comes from when no step has a copy of every shard."""
        ckpt = self.config.checkpoint
        if ckpt is not None and complete_steps(ckpt.root):
            return "checkpoint"
        if not any(c[2] > 0 for h in held for c in h):
            # No training step was ever replicated: every rank starts again from the initial
            # state (the factory's, with the RNG as it was when protect() began).
            return "initial"
        reason = (
            f"{describe_gap(held)}, and there is no complete checkpoint "
            f"{'under ' + repr(ckpt.root) if ckpt else '(RecoveryConfig.checkpoint is not set)'}"
            ": the job cannot continue; raise the replication factor or configure checkpoints"
        )
        self._session.report_failure(reason, fatal=True)
        raise RecoveryFailed(reason)

    def _checkpoint_and_stop(self, info: GenerationInfo, step: int) -> None:
        root = (
            self.config.checkpoint.root
            if self.config.checkpoint
            else self.config.emergency_checkpoint_root
            or os.path.join(os.environ.get("P2P_RUN_DIR", "."), "checkpoints")
        )
        ckpt = ColdCheckpointer(
            CheckpointConfig(root=root, async_save=False),
            self.state,
            group=self._checkpoint_group(),
        )
        rank_states, world = None, None
        if self._source is not None:
            # The checkpoint carries every rank's RNG, schedule and extras of the world the
            # state came from, lost ranks' included (from the copies held of them), so a job
            # resumed at that size continues exactly.
            rank_states, world = self._rank_states(step), self._source.world_size
        ckpt.save(step, self._extras(), rank_states=rank_states, world_size=world)
        self._session.event("stop_checkpoint_written", step=step, root=root)
        if self._session.client is not None:
            self._session.client.report_done(checkpoint_step=step)
        logger.error("the job stops: %s; a checkpoint of step %d is in %s", info.reason, step, root)
        self._shutdown()
        raise SystemExit(1)

    def _rank_states(self, step: int) -> dict[int, bytes]:
        source, rank = self._source, dist.get_rank()
        docs = {source.inherits_from[rank]: self.state.small_state(step, self._extras())}
        inherited = set(source.inherits_from)
        for owner in range(source.world_size):
            if owner not in inherited and min(source.holders[owner]) == rank:
                copy = find_copy(self._stores, source.world_size, owner, step)
                layout = shard_layout(self.state.layout, source.world_size, owner)
                docs[owner] = TrainingState.small_state_of(layout, copy.buffer)
        return docs

    # -- plumbing ------------------------------------------------------------------------------

    def _device(self) -> torch.device:
        """Where training runs: the current CUDA device under CUDA, else the CPU."""
        if self._session.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _wire_device(self) -> torch.device:
        """Device of small control tensors on the replication group (CUDA under NCCL)."""
        _, backend = Replicator.backend_for(self.config.replication, self._device())
        return self._device() if backend == "nccl" else torch.device("cpu")

    def _snapshot_device(self) -> torch.device:
        kind, _ = Replicator.backend_for(self.config.replication, state_device(self.state))
        return state_device(self.state) if kind.value == "gpu" else torch.device("cpu")

    def _placement(self, info: GenerationInfo | None) -> Placement | None:
        """The coordinator's replica map for this generation (the replicator's default if none)."""
        if info is None or len(info.holders) != info.world_size:
            return None
        holders = tuple(tuple(info.holders[r]) for r in range(info.world_size))
        if any(len(h) != self.config.replication.k for h in holders):
            raise ConfigurationError(
                f"the coordinator keeps {len(holders[0])} copies of every shard (p2p-run "
                f"--replicas) but ReplicationConfig.k is {self.config.replication.k}; make them "
                "agree"
            )
        rpn = int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size))
        return Placement(info.world_size, rpn, self.config.replication.k, holders)

    def _on_replicated(self, step: int) -> None:
        if self._session.client is not None:
            self._session.client.report_replicated(step, self.generation)

    def _on_chunk(self, step: int, round_: int, num_rounds: int) -> None:
        self._call_hooks("replication_chunk", step=step, round=round_, num_rounds=num_rounds)

    def _attach_env_hooks(self) -> None:
        for name in filter(None, os.environ.get(ENV_JOB_HOOKS, "").split(",")):
            module_name, _, function = name.strip().partition(":")
            try:
                attach = getattr(importlib.import_module(module_name), function)
            except (ImportError, AttributeError, ValueError) as e:
                reason = (
                    f"{ENV_JOB_HOOKS} names {name!r}, which cannot be loaded ({e}): write "
                    "module:function of an importable module"
                )
                self._session.report_failure(reason, fatal=True)
                self._shutdown()
                logger.error("%s", reason)
                raise SystemExit(2) from None
            attach(self)

    def _call_hooks(self, point: str, **info: Any) -> None:
        for hook in self._hooks:
            hook(point, **info)

    @contextlib.contextmanager
    def _phase(self, rec: RecoveryRecord, name: str) -> Iterator[None]:
        self._call_hooks("recovery_phase", phase=name, generation=rec.generation)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            rec.phases[name] = rec.phases.get(name, 0.0) + time.perf_counter() - t0

    def _shutdown(self) -> None:
        for store in self._stores:
            store.abandon()
        self._stores = []
        self.replicator = None
        if self.checkpointer is not None:
            self.checkpointer.abandon()
            self.checkpointer = None
        if self.loader is not None and hasattr(self.loader, "close"):
            self.loader.close()


def _short(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return f"{type(exc).__name__}: {text[:200]}"


def _without_frames(exc: BaseException) -> BaseException:
    """``exc`` with the tracebacks of it and its causes cut, so their frames can be freed.

    The links are cut, not only dropped: the interpreter and ``contextlib`` still hold the
    outermost traceback entries while a ``with`` block's exception is being handled.
    """
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        tb = e.__traceback__
        while tb is not None:
            tb.tb_next, tb = None, tb.tb_next
        e.__traceback__ = None
        e = e.__cause__ or e.__context__
    return exc
