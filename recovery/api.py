"""The user-facing API: ``p2p_state.init_process_group()`` and ``p2p_state.protect()``.

A thin facade over the recovery engine (``recovery``) and the control-plane client
(``launcher.client``), at the top of the layers: it imports them, nothing below imports it.
``p2p_state`` re-exports its functions by name, resolved on first use, so ``import p2p_state``
(and the control plane, which needs only ``p2p_state.placement``) stays free of torch.

A training script changes by a handful of lines::

    p2p_state.init_process_group()              # instead of dist.init_process_group()

    def build():                                # the model, sharded, and its optimizer
        model = Transformer(cfg)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
        return model, optimizer, CosineAnnealingLR(optimizer, T_max=steps)

    with p2p_state.protect(build, loader=loader, max_steps=steps) as job:
        for step, batch in job:
            with job.step():
                loss = loss_fn(job.model(batch))
                loss.backward()
                job.optimizer.step()
                job.scheduler.step()
                job.optimizer.zero_grad()

Under ``p2p-run`` a spare process runs the same script: it waits inside
``init_process_group()`` until it is given a lost rank's place, and ``protect()`` fills its state
from its peers before its first step.
"""

from __future__ import annotations

import atexit
import logging
import os
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch

from launcher.client import ClientConfig
from launcher.protocol import (
    ENV_CHECKPOINT_DIR,
    ENV_CHECKPOINT_EVERY,
    ENV_COORDINATOR,
    ENV_LAZY_GLOO,
    ENV_REPLICAS,
    ENV_REPLICATE_EVERY,
    ENV_RESUME,
)
from p2p_state.config import ReplicationConfig
from recovery.checkpoint import CheckpointConfig
from recovery.comms import Interrupted
from recovery.config import RecoveryConfig
from recovery.errors import EXIT_OK, ConfigurationError, RecoveryFailed, exit_code_of
from recovery.gloo_pairs import LAZY_FROM_RANKS
from recovery.job import ProtectedJob
from recovery.session import JobEnded, NotAMember, Session, default_backend, device_type_of_job
from recovery.warmup import restoring as _restoring
from recovery.warmup import warm_up

logger = logging.getLogger(__name__)

_session: Session | None = None


def _gloo_pairs_choice(value: str) -> bool | None:
    """``P2P_LAZY_GLOO`` as p2p-run sets it: ``1`` (``--lazy-gloo``), ``0`` (``--eager-gloo``)
    or unset (by world size, :func:`recovery.gloo_pairs.pairs_on_first_use`)."""
    if value not in ("", "0", "1"):
        logger.warning(
            "%s=%r is neither 1 (pairs on first use) nor 0 (every pair when made): ignored, "
            "gloo groups connect pairs on first use from %d ranks",
            ENV_LAZY_GLOO,
            value,
            LAZY_FROM_RANKS,
        )
    return {"1": True, "0": False}.get(value)


def init_process_group(
    backend: str | None = None,
    *,
    timeout_s: float = 300.0,
    join_timeout_s: float = 3600.0,
    warmup: Any = None,
    warmup_step: Any = None,
) -> None:
    """Join the job's default process group (instead of ``torch.distributed.init_process_group``).

    Under ``p2p-run``: a rank waits until every rank of the job has connected to the
    coordinator and joins the first generation's group; a hot spare waits here until the
    coordinator gives it a lost rank's place (and exits with code 0 if the job ends first).
    Afterwards ``RANK``/``WORLD_SIZE``/``dist.get_rank()`` are this process's place. Without
    ``p2p-run`` (e.g. under torchrun) this is ``init_process_group`` from the environment, and
    a lost rank cannot be recovered in place.

    Args:
        backend: Backend of the default group (default: ``gloo`` on CPU, NCCL for CUDA with
            gloo beside it).
        timeout_s: Collective timeout of every group (a last resort: faults interrupt them).
        join_timeout_s: How long to wait for the first generation, or, for a spare, for a rank.
        warmup: The factory later given to :func:`protect`. A spare runs it once while it
            waits (on a private one-rank group) so its first real build costs what a
            survivor's does: the first ``fully_shard`` and optimizer step of a process take
            about a second of one-time set-up.
        warmup_step: Optional ``warmup_step(model, optimizer)``: one training step on made-up
            data shaped like a real batch, run by the spare on the model ``warmup`` built, so
            its first real step also costs what a survivor's does.

    Raises:
        RuntimeError: called twice.
        TimeoutError: no generation in time (names the setting).
    """
    global _session
    if _session is not None:
        raise RuntimeError("p2p_state.init_process_group() was already called in this process")
    device_type = device_type_of_job()
    client_config = ClientConfig.from_env() if os.environ.get(ENV_COORDINATOR) else None
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    # A spare joins the pool only once it is warm: what it needs before its first step (what a
    # restore runs, DCP, the planner, replication, is imported with this module) costs nothing
    # on the recovery's critical path.
    if client_config is not None and client_config.role == "spare" and warmup is not None:
        seconds = warm_up(warmup, backend or default_backend(device_type), warmup_step)
        logger.info("spare warmed up in %.2f s", seconds)
    session = Session(
        client_config,
        timeout_s=timeout_s,
        device_type=device_type,
        backend=backend,
        lazy_gloo=_gloo_pairs_choice(os.environ.get(ENV_LAZY_GLOO, "")),
    )
    atexit.register(session.close)
    if client_config is None:
        session.start_standalone()
        _session = session
        return
    tried = 0
    while True:
        try:
            info = session.next_generation(join_timeout_s, after=tried)
        except JobEnded as e:
            if client_config.role == "spare":
                logger.info("the job ended before this spare was needed")
                session.close()
                raise SystemExit(EXIT_OK) from None
            raise SystemExit(exit_code_of(e)) from None
        tried = info.generation
        try:
            session.join(info)
        except NotAMember:
            logger.warning("generation %d has no rank for %s", info.generation, session.identity)
            continue
        except (Interrupted, RuntimeError) as e:
            # The generation could not form (superseded, or a member died meanwhile): the
            # coordinator's next one follows; a process that never acknowledges is replaced.
            logger.warning("could not join generation %d: %s", info.generation, e)
            continue
        break
    rank = info.rank_of(session.identity)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(info.world_size))
    _session = session


def protect(
    build: Any,
    *,
    loader: Any = None,
    config: Any = None,
    max_steps: int | None = None,
    stateful: Mapping[str, Any] | None = None,
) -> _EntryPoint:
    """Wrap a training loop so a lost rank is rebuilt from its peers in place.

    Args:
        build: Factory returning ``(model, optimizer)`` or ``(model, optimizer, scheduler)``,
            the model sharded with ``fully_shard``. Called at the start and again after every
            recovery, on the new process groups (train through ``job.model``,
            ``job.optimizer`` and ``job.scheduler``, which change after a recovery).
        loader: A resumable loader such as ``dataload.loader.ResumableLoader`` or, over a
            dataset of your own, ``dataload.loader.DatasetLoader`` (its position is
            carried with every snapshot); ``None`` yields ``(step, None)``.
        config: A ``recovery.config.RecoveryConfig``. By default it follows p2p-run's
            ``--replicas``, ``--checkpoint-dir``, ``--checkpoint-every`` and ``--resume``.
        max_steps: The last global step (``None``: until the loop is left).
        stateful: Objects the loop keeps beside the model, by name, each with ``state_dict()``
            and ``load_state_dict()`` and a small state (numbers, strings, lists, dicts): e.g.
            ``{"scaler": scaler}`` for a ``torch.amp.GradScaler``. Carried with every snapshot
            and checkpoint and put back with them on every rank.

    Returns:
        A context manager whose ``with`` gives the :class:`recovery.job.ProtectedJob` (iterate
        it for the steps). It is the entry point of the engine's endings: a job given back,
        stopped, failed or set up wrongly ends the process with its exit code
        (:func:`recovery.errors.exit_code_of`), with one line in the log and no traceback.
    """
    if _session is None:
        raise RuntimeError(
            "call p2p_state.init_process_group() before p2p_state.protect() (it replaces "
            "torch.distributed.init_process_group)"
        )
    return _EntryPoint(
        ProtectedJob(
            _session,
            build,
            loader=loader,
            config=config or config_from_env(),
            max_steps=max_steps,
            stateful=stateful,
        )
    )


class _EntryPoint:
    """Where a protected job's ending becomes the process's exit code (the one place)."""

    def __init__(self, job: ProtectedJob) -> None:
        self.job = job

    def __getattr__(self, name: str) -> Any:
        # Before the `with`, the job's own API (add_hook, config, ...) is reached through here.
        return getattr(self.job, name)

    def __enter__(self) -> ProtectedJob:
        try:
            return self.job.__enter__()
        except Exception as e:
            _exit_if_ending(e)
            raise

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            self.job.__exit__(exc_type, exc, tb)
        except Exception as e:
            _exit_if_ending(e)  # a fault outside the steps' guards ends this rank in one line
            raise
        if isinstance(exc, Exception):
            _exit_if_ending(exc)


def _exit_if_ending(exc: Exception) -> None:
    """End the process with ``exc``'s exit code if it is one of the job's endings."""
    code = exit_code_of(exc)
    if code is None:
        return  # the user's own error: it stands, traceback and all
    if isinstance(exc, RecoveryFailed) and _session is not None:
        # The coordinator has the reason and p2p-run reports it: one line here, no traceback.
        logger.error("%s: %s", _session.identity, exc)
    elif isinstance(exc, (ConfigurationError, RecoveryFailed)):
        logger.error("%s", exc)
    raise SystemExit(code) from None


def restoring() -> bool:
    """Whether :func:`protect` is running the factory to restore a state into what it builds.

    True while it rebuilds after a fault or a resize and restores from peers' copies (or a cold
    checkpoint), and while a hot spare warms up: every parameter, persistent buffer and
    optimizer state value is overwritten next, so the factory may skip initialising the
    weights, as FSDP2 allows with a model built on the meta device::

        def build():
            with torch.device("meta") if p2p_state.restoring() else contextlib.nullcontext():
                model = Transformer(cfg)
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
            if p2p_state.restoring():
                model.to_empty(device="cpu")  # storage for the local shards, not initialised
            ...

    Non-persistent buffers are not part of the state: a factory that skips initialisation must
    still compute them.
    """
    return _restoring()


def config_from_env() -> RecoveryConfig:
    """The :class:`recovery.config.RecoveryConfig` p2p-run's flags describe (defaults otherwise)."""
    env = os.environ
    checkpoint = None
    if env.get(ENV_CHECKPOINT_DIR):
        checkpoint = CheckpointConfig(root=env[ENV_CHECKPOINT_DIR])
        if ENV_CHECKPOINT_EVERY in env:
            checkpoint = replace(checkpoint, every_steps=int(env[ENV_CHECKPOINT_EVERY]))
    replication = ReplicationConfig()
    if ENV_REPLICAS in env:
        replication = replace(replication, k=int(env[ENV_REPLICAS]))
    if ENV_REPLICATE_EVERY in env:
        replication = replace(replication, interval_steps=int(env[ENV_REPLICATE_EVERY]))
    return RecoveryConfig(
        replication=replication,
        checkpoint=checkpoint,
        resume=env.get(ENV_RESUME) == "1",
    )


def current_session() -> Session | None:
    """The process's :class:`recovery.session.Session` (``None`` before init_process_group)."""
    return _session
