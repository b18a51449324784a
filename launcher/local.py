"""Run one function on a group of local worker processes that form a process group.

This is the small, in-process way to start ranks (tests, benchmarks, the demo) without the full
control plane: the parent hosts the rendezvous ``TCPStore`` on a port the OS picks (no port races),
starts ``world_size`` ranks, gives each the parent's environment (with torchrun's variables) and
its stdout and stderr as they are at that moment, and an initialised default process group, and
collects each rank's return value.

The ranks are forked by multiprocessing's fork server, which imports torch and FSDP once for the
whole life of the parent: importing them is most of a fresh interpreter's start (about 4 s of CPU
on a 2-core host), a fork costs milliseconds. The server only imports: it makes no process group
and no CUDA context, so a rank forked from it starts as clean as a fresh interpreter would.

The parent never blocks without a deadline. When a rank fails, every other rank is killed at once;
when the deadline passes, every live rank dumps its Python stacks (``faulthandler`` on SIGUSR1)
before it is killed, so a hang is diagnosable from the test log.
"""

from __future__ import annotations

import faulthandler
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing import reduction
from pathlib import Path
from typing import Any, cast

import msgpack

from launcher import lifetime

logger = logging.getLogger(__name__)

#: How long a rank that was told to dump its stacks gets before it is killed.
_STACK_DUMP_GRACE_S = 2.0

#: What the fork server imports before it forks a rank (FSDP brings DTensor; its first
#: ``fully_shard`` imports dynamo).
_PRELOAD = ["torch", "torch.distributed.fsdp", "torch._dynamo", __name__]


class WorkerGroupError(RuntimeError):
    """A worker group did not finish as expected: a rank failed, or the deadline passed."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerGroupConfig:
    """How to start a local worker group."""

    world_size: int
    """Number of ranks."""
    ranks_per_node: int = 0
    """Ranks per emulated node (sets LOCAL_RANK/LOCAL_WORLD_SIZE/GROUP_RANK); 0 means one node."""
    backend: str = "gloo"
    """Backend of the default process group; "none" starts the ranks without one."""
    timeout_s: float = 120.0
    """Deadline for the whole group, start-up included."""
    pg_timeout_s: float = 60.0
    """Collective timeout of the default process group."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment variables for every rank."""
    expected_exit: Mapping[int, int] = field(default_factory=dict)
    """Ranks that are meant to end abnormally, with the exit code expected (``-9`` for SIGKILL)."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        rpn = self.ranks_per_node or self.world_size
        if self.world_size % rpn:
            raise ValueError(
                f"world_size={self.world_size} is not a multiple of ranks_per_node={rpn}; "
                "every emulated node must have the same number of ranks"
            )
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


class _ParentStdio:
    """The parent's stdout and stderr as they are when a rank starts, for the rank to write to.

    The fork server's own are those it had when it started: under pytest, the captured output
    of a test long over, where a rank's traceback or stack dump would be lost.
    """

    def __init__(self, fds: tuple[int, int] | None = None) -> None:
        self.fds = fds

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled while the rank is being started: the descriptors travel with the request.
        return (_ParentStdio._received, (reduction.DupFd(1), reduction.DupFd(2)))

    @staticmethod
    def _received(out: Any, err: Any) -> _ParentStdio:
        return _ParentStdio((out.detach(), err.detach()))

    def install(self) -> None:
        """Make them this process's stdout and stderr."""
        assert self.fds is not None, "only a rank's unpickled copy holds descriptors"
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, target in zip(self.fds, (1, 2), strict=True):
            os.dup2(fd, target)
            os.close(fd)


def _worker_entry(
    fn: Callable[..., Any],
    args: Sequence[Any],
    rank: int,
    cfg: WorkerGroupConfig,
    store_port: int,
    result_path: str,
) -> None:
    rpn = cfg.ranks_per_node or cfg.world_size
    # As torchrun does: one intra-op thread per rank unless told otherwise, so ranks sharing a
    # machine do not oversubscribe its cores.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.update(cfg.env)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(cfg.world_size),
        LOCAL_RANK=str(rank % rpn),
        LOCAL_WORLD_SIZE=str(rpn),
        GROUP_RANK=str(rank // rpn),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(store_port),
    )
    import torch
    import torch.distributed as dist

    # torch is already imported (by the fork server), so the variable alone would come too late
    # for its thread pool.
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if cfg.backend != "none":
        # torch re-exports TCPStore from its C module without marking it public.
        store = dist.TCPStore(  # type: ignore[attr-defined]
            "127.0.0.1",
            store_port,
            cfg.world_size,
            is_master=False,
            timeout=timedelta(seconds=cfg.pg_timeout_s),
        )
        dist.init_process_group(
            cfg.backend,
            store=store,
            rank=rank,
            world_size=cfg.world_size,
            timeout=timedelta(seconds=cfg.pg_timeout_s),
        )
    try:
        result = fn(*args)
        with open(result_path + ".tmp", "wb") as f:
            f.write(msgpack.packb(result, use_bin_type=True))
        os.replace(result_path + ".tmp", result_path)
    finally:
        if cfg.backend != "none" and dist.is_initialized():
            dist.destroy_process_group()


def rank_context() -> multiprocessing.context.ForkServerContext:
    """The multiprocessing context :func:`run_local` starts its ranks in (its queues, barriers
    and shared values are the ones to give :func:`rank_process`)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # effective when the server starts: on first use
    return ctx


def rank_process(
    target: Callable[..., Any], args: Sequence[Any], *, name: str | None = None
) -> multiprocessing.Process:
    """A process (not started) that runs ``target(*args)`` the way :func:`run_local` runs its
    ranks: forked from the server that imported torch, with the parent's environment, stdout
    and stderr of the moment it starts, its stacks dumped on SIGUSR1, and ended with the parent
    (daemonic; killed even if the parent is SIGKILLed)."""
    process = rank_context().Process(
        target=_run_as_rank,
        args=(os.getpid(), _ParentStdio(), dict(os.environ), target, args),
        name=name,
        daemon=True,
    )
    return cast(multiprocessing.Process, process)


def _run_as_rank(
    origin: int,
    stdio: _ParentStdio,
    environ: Mapping[str, str],
    target: Callable[..., Any],
    args: Sequence[Any],
) -> None:
    # The rank ends with ``origin``, the process that asked for it, however that ends (the fork
    # server, its parent, outlives them both): not left orphaned in a collective.
    lifetime.end_with(origin)
    stdio.install()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # The fork server's environment is the parent's when the server started: the parent's of now.
    os.environ.clear()
    os.environ.update(environ)
    target(*args)


def run_local(
    fn: Callable[..., Any],
    cfg: WorkerGroupConfig,
    args: Sequence[Any] = (),
) -> list[Any]:
    """Run ``fn(*args)`` on ``cfg.world_size`` new processes and return their results.

    ``fn`` must be importable (a module-level function) and return msgpack-serialisable data.
    Inside ``fn`` the default process group is initialised (unless ``backend="none"``) and the
    torchrun environment variables are set.

    Args:
        fn: The per-rank function.
        cfg: Group size, backend and deadlines.
        args: Positional arguments for ``fn`` (pickled to the child).

    Returns:
        One entry per rank: the return value of ``fn``, or ``None`` for a rank listed in
        ``cfg.expected_exit``.

    Raises:
        WorkerGroupError: a rank failed (non-zero exit not listed in ``expected_exit``), a listed
            rank ended differently, or the group outlived ``cfg.timeout_s``.
    """
    import torch.distributed as dist

    store = None
    if cfg.backend != "none":
        # The parent owns the store, so its port is bound before any rank starts.
        # torch re-exports TCPStore from its C module without marking it public.
        store = dist.TCPStore(  # type: ignore[attr-defined]
            "127.0.0.1",
            0,
            cfg.world_size,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=cfg.pg_timeout_s),
        )
    store_port = store.port if store is not None else 0
    procs: list[multiprocessing.process.BaseProcess] = []
    with tempfile.TemporaryDirectory(prefix="p2p-local-") as tmp:
        result_paths = [str(Path(tmp) / f"rank{r}.msgpack") for r in range(cfg.world_size)]
        try:
            for rank in range(cfg.world_size):
                p = rank_process(
                    _worker_entry,
                    (fn, args, rank, cfg, store_port, result_paths[rank]),
                    name=f"rank{rank}",
                )
                p.start()
                procs.append(p)
            _wait_all(procs, cfg)
            results: list[Any] = []
            for rank, path in enumerate(result_paths):
                if rank in cfg.expected_exit:
                    results.append(None)
                    continue
                with open(path, "rb") as f:
                    results.append(msgpack.unpackb(f.read(), raw=False, strict_map_key=False))
            return results
        finally:
            _kill_all(procs)
            del store


def _wait_all(procs: list[multiprocessing.process.BaseProcess], cfg: WorkerGroupConfig) -> None:
    deadline = time.monotonic() + cfg.timeout_s
    pending = {p.sentinel: rank for rank, p in enumerate(procs)}
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            _dump_and_kill(procs, [pending[s] for s in pending])
            raise WorkerGroupError(
                f"ranks {sorted(pending.values())} still running after {cfg.timeout_s:.0f}s "
                "(WorkerGroupConfig.timeout_s); their stacks were dumped to stderr"
            )
        for sentinel in multiprocessing.connection.wait(list(pending), timeout=remaining):
            # wait() hands back the sentinels it was given: the ints of ``pending``.
            rank = pending.pop(cast(int, sentinel))
            procs[rank].join()
            code = procs[rank].exitcode
            expected = cfg.expected_exit.get(rank, 0)
            if code != expected:
                _kill_all(procs)
                raise WorkerGroupError(
                    f"rank {rank} exited with code {code}, expected {expected}; "
                    "the other ranks were killed (see the rank's stderr above)"
                )


def _dump_and_kill(procs: list[multiprocessing.process.BaseProcess], ranks: list[int]) -> None:
    for rank in ranks:
        pid = procs[rank].pid
        if procs[rank].is_alive() and pid is not None:
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + _STACK_DUMP_GRACE_S
    for rank in ranks:
        procs[rank].join(timeout=max(0.0, deadline - time.monotonic()))
    _kill_all(procs)


def _kill_all(procs: list[multiprocessing.process.BaseProcess]) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            logger.error("process %s (pid %s) survived SIGKILL for 10s", p.name, p.pid)
