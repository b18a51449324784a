"""``p2p-run``: a torchrun-style launcher with a fault-tolerant control plane.

    p2p-run --nnodes 2 --nproc-per-node 4 --node-rank 0 --spares 1 train.py --lr 3e-4

The process with node rank 0 starts the job's coordinator (its own process, so it outlives any
rank), and node 1 (``--standby-coordinators``) a standby that takes over if it is lost; every
``p2p-run`` then runs its node's agent. On a head node that trains nothing, ``p2p-run
coordinator --coordinator HOST:PORT [flags]`` runs the coordinator in the foreground (with
``--standby-of HOST:PORT``, a standby), and every node is started with ``--external-coordinator``
and the same ``--coordinator``. Several ``p2p-run`` processes on one machine with different
``--node-rank`` form one job: that is how multi-node runs are tested on one host. Inside a Slurm
allocation the job's shape comes from ``SLURM_*`` (:mod:`launcher.slurm`; any flag given wins).
User mistakes end with one line on stderr and a non-zero exit code, never a traceback.

Exit codes (how the job ended, as this node saw it):

- 0: the job finished: every rank completed its training, whatever happened to lost nodes; or
  this node was declared lost while it still ran (a hang, a partition) and the job went on
  without it (the line on stderr says so), which is no failure of this node's Slurm step.
- 1: the job ended without finishing (stopped with a checkpoint, a fatal error, or this node
  lost its coordinator); the line on stderr says which.
- 2: a usage error (nothing was started).
- 3: nodes did not join within ``--join-timeout``; the line names them.
- 128 + N: this node was stopped by signal N (130: Ctrl-C, 143: SIGTERM).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any, NoReturn

from launcher import protocol, slurm
from launcher import secret as secret_file
from launcher.agent import (
    AgentConfig,
    AgentError,
    run_agent,
    visible_devices,
)
from launcher.config import add_flags, dump, from_args, setting, write_private
from launcher.coordinator import COORDINATOR_FILE, CoordinatorConfig, config_file
from launcher.coordinator import run as run_coordinator
from launcher.events import read_events
from launcher.lifetime import die_with_parent
from launcher.membership import JOIN_FAILED, NOT_THE_ENGINE, MembershipConfig
from launcher.output import LINE_PREFIX_ENV, OutputConfig, node_log_dir
from launcher.policy import ElasticConfig
from recovery.gloo_pairs import LAZY_FROM_RANKS

#: How long node 0 waits for its coordinator to listen.
_COORDINATOR_START_S = 60.0


class Exit(IntEnum):
    """``p2p-run``'s exit codes (128 + N when a signal N stopped it)."""

    FINISHED = 0
    FAILED = 1
    USAGE = 2
    NOT_JOINED = JOIN_FAILED


def describe_exit(code: int) -> str:
    """What a ``p2p-run`` exit code says about the job (for people and batch scripts)."""
    if code == Exit.FINISHED:
        return "the job finished"
    if code == Exit.USAGE:
        return "usage error: nothing was started"
    if code == Exit.NOT_JOINED:
        return "nodes did not join within --join-timeout: the job never started"
    if code > 128:
        return f"this node was stopped by signal {code - 128}"
    return "the job ended without finishing (stopped with a checkpoint, or failed)"


class UsageError(Exception):
    """A user mistake: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not usage + error
        raise UsageError(message)


@dataclass(frozen=True, slots=True)
class RunOptions:
    """p2p-run's own settings. Every other flag is a setting of the config that uses it
    (:func:`build_parser` lists where), declared there once with :func:`launcher.config.setting`.
    """

    join_timeout_s: float = setting(
        300.0,
        flag="--join-timeout",
        help="start-up deadline: nodes that have not joined by then end the job, and a node "
        "that cannot reach the coordinator or the secret gives up, seconds (default {default})",
    )
    """Also the coordinator's ``MembershipConfig.join_timeout_s`` and the agent's
    ``welcome_timeout_s``."""
    print_config: bool = setting(
        False,
        flag="--print-config",
        help="print the resolved settings and where each came from (flag, SLURM_*, default), "
        "then exit",
    )
    external_coordinator: bool = setting(
        False,
        flag="--external-coordinator",
        help="the coordinator at --coordinator runs elsewhere (p2p-run coordinator on a head "
        "node): node 0 starts none",
    )
    standby_coordinators: str | None = setting(
        None,
        flag="--standby-coordinators",
        help="node ranks that run a standby coordinator, which takes over when the active one "
        "falls silent, comma-separated, or 'none' (default: node 1 when there are 2+ nodes)",
    )
    local_addr: str | None = setting(
        None,
        flag=("--local-addr", "--local_addr"),
        help="this node's address as the other nodes reach it, as torchrun's: a standby "
        "coordinator started here is announced there (default: this host's name)",
    )
    replicate_every: int = setting(
        1,
        flag="--replicate-every",
        help="replicate the state after every Nth step (default {default}): a recovery then "
        "redoes up to N-1 more steps; a loop that steps its optimizer every N iterations needs "
        f"it ({protocol.ENV_REPLICATE_EVERY})",
    )
    checkpoint_dir: str | None = setting(
        None,
        flag="--checkpoint-dir",
        help="directory or fsspec URL of the cold DCP checkpoints (engine scripts; "
        f"{protocol.ENV_CHECKPOINT_DIR})",
    )
    checkpoint_every: int = setting(
        1000, flag="--checkpoint-every", help="steps between cold checkpoints (default {default})"
    )
    resume: bool = setting(
        False,
        flag="--resume",
        help="start from the latest complete checkpoint under --checkpoint-dir",
    )
    lazy_gloo: bool = setting(
        False,
        flag="--lazy-gloo",
        help="gloo groups connect a pair of ranks the first time it is used, not every pair "
        f"when a generation forms, at every size (the default from {LAZY_FROM_RANKS} ranks; "
        "docs/recovery.md)",
    )
    eager_gloo: bool = setting(
        False,
        flag="--eager-gloo",
        help="gloo groups connect every pair of ranks when a generation forms, at every size "
        f"(the default below {LAZY_FROM_RANKS} ranks)",
    )
    secret_file: str | None = setting(
        None,
        flag="--secret-file",
        help="per-job secret (mode 0600); by default node 0 creates <run-dir>/secret once and "
        "the other nodes wait for it (at most --join-timeout)",
    )
    module: bool = setting(False, flag=("-m", "--module"), help="run the script as a module")
    no_python: bool = setting(
        False,
        flag=("--no-python", "--no_python"),
        help="run the script as a program of its own (e.g. a shell script), not with python",
    )
    rdzv_backend: str | None = setting(
        None,
        flag=("--rdzv-backend", "--rdzv_backend"),
        help="accepted as torchrun's and ignored, with a warning: the coordinator is the "
        "rendezvous",
    )
    rdzv_conf: str | None = setting(
        None,
        flag=("--rdzv-conf", "--rdzv_conf"),
        help="torchrun's key=value,...: join_timeout sets --join-timeout; other keys are "
        "ignored with a warning",
    )
    monitor_interval: float | None = setting(
        None,
        flag=("--monitor-interval", "--monitor_interval"),
        help="accepted as torchrun's and ignored, with a warning: an agent sees an exit at "
        "once (a pidfd per process), not at an interval",
    )


def build_parser() -> argparse.ArgumentParser:
    """The flags (torchrun's names where they mean the same thing), each derived from the
    setting it fills."""
    p = _Parser(prog="p2p-run", description=__doc__.splitlines()[0], allow_abbrev=False)
    # Flags that Slurm can also give default to None: "not given" must be told apart.
    add_flags(p, slurm.Flags, "nnodes", "nproc_per_node", "node_rank", "coordinator")
    add_flags(p, slurm.Flags, "rdzv_endpoint", "master_addr", "master_port", "standalone")
    add_flags(p, RunOptions, "rdzv_backend", "rdzv_conf", "monitor_interval")
    add_flags(p, AgentConfig, "start_method")
    add_flags(p, RunOptions, "join_timeout_s", "print_config")
    add_flags(p, slurm.Flags, "spares")
    add_flags(p, AgentConfig, "heartbeat_interval_s", "virtual_local_rank")
    add_flags(
        p, MembershipConfig, "heartbeat_timeout_s", "ack_timeout_s", "spare_wait_s", "max_restarts"
    )
    add_flags(p, AgentConfig, "coordinator_timeout_s", "stop_checkpoint_timeout_s")
    add_flags(p, RunOptions, "external_coordinator", "standby_coordinators", "local_addr")
    add_flags(p, CoordinatorConfig, "takeover_timeout_s")
    add_flags(p, slurm.Flags, "run_dir", "job_id")
    add_flags(p, MembershipConfig, "replicas")
    add_flags(p, RunOptions, "replicate_every")
    elastic = p.add_argument_group(
        "elastic jobs", "let the job shrink after a fault with no spare, and grow into spares"
    )
    add_flags(
        elastic,
        ElasticConfig,
        "min_ranks",
        "max_ranks",
        "allowed_sizes",
        "scale_up_delay_s",
        "graceful_timeout_s",
    )
    add_flags(p, RunOptions, "checkpoint_dir", "checkpoint_every", "resume", "secret_file")
    add_flags(p, RunOptions, "lazy_gloo", "eager_gloo")
    add_flags(p, CoordinatorConfig, "env_store")
    add_flags(p, RunOptions, "module", "no_python")
    output = p.add_argument_group(
        "the processes' output", "torchrun's flags, with torchrun's meanings (docs/launcher.md)"
    )
    add_flags(
        output,
        OutputConfig,
        *("log_dir", "redirects", "tee", "local_ranks_filter", "role", "line_prefix"),
    )
    p.add_argument("script", nargs="?", help="training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments of the script")
    return p


def _resolve(args: argparse.Namespace, environ: Mapping[str, str]) -> slurm.Resolved:
    """Fill the job's shape from the flags, then ``SLURM_*``, then the defaults."""
    counted = None
    if isinstance(args.nproc_per_node, str):
        args.nproc_per_node, counted = _count_slots(args.nproc_per_node, args.spares or 0)
    flags = from_args(slurm.Flags, args, max_ranks=args.max_ranks, spares=args.spares or 0)
    lookup = slurm.node_address if slurm.SLURM_JOB_ID in environ else (lambda name: name)
    try:
        resolved = slurm.resolve(flags, environ, lookup)
    except ValueError as e:
        raise UsageError(str(e)) from None
    args.nnodes, args.node_rank = resolved.nnodes, resolved.node_rank
    args.nproc_per_node, args.coordinator = resolved.nproc_per_node, resolved.coordinator
    args.job_id, args.run_dir, args.max_ranks = (
        resolved.job_id,
        resolved.run_dir,
        resolved.max_ranks,
    )
    resolved.sources["spares"] = slurm.DEFAULT if args.spares is None else slurm.FLAG
    if counted is not None:
        resolved.sources["nproc_per_node"] = counted
    args.spares = args.spares or 0
    return resolved


def _count_slots(word: str, spares: int) -> tuple[int, str]:
    """torchrun's ``--nproc-per-node gpu|cpu|auto``, counted on this node: one rank per GPU
    that no spare holds (a spare needs a device of its own), or one per CPU.

    Returns:
        The ranks per node, and where the number came from.
    """
    if word != "cpu":
        import torch  # only here: p2p-run itself never needs it

        if word == "gpu" or torch.accelerator.is_available():
            kind = "CUDA device" if word == "gpu" else "accelerator"
            count = torch.cuda.device_count() if word == "gpu" else torch.accelerator.device_count()
            if count < 1:
                raise UsageError(f"--nproc-per-node {word}: this node has no {kind}; give a number")
            if count - spares < 1:
                raise UsageError(
                    f"--nproc-per-node {word}: {count} {kind}(s) leave none for a rank beside "
                    f"--spares {spares} (a spare needs a device of its own); give fewer spares"
                )
            return (
                count - spares,
                f"--nproc-per-node {word}: {count} {kind}(s) less --spares {spares}",
            )
    cpus = len(os.sched_getaffinity(0))
    return cpus, f"--nproc-per-node {word}: {cpus} CPUs"


def _torchrun_leftovers(args: argparse.Namespace) -> list[str]:
    """Apply what torchrun's own flags mean here; returns a warning for each ignored one."""
    ignored = []
    if args.rdzv_backend is not None:
        ignored.append(
            f"--rdzv-backend {args.rdzv_backend} is ignored: the coordinator at --coordinator "
            "(--rdzv-endpoint) is the rendezvous"
        )
    for part in (args.rdzv_conf or "").split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UsageError(f"--rdzv-conf {args.rdzv_conf!r} is not key=value,key=value")
        if key == "join_timeout":
            try:
                args.join_timeout_s = float(value)
            except ValueError:
                raise UsageError(f"--rdzv-conf join_timeout={value} is not seconds") from None
        else:
            ignored.append(f"--rdzv-conf {key}={value} is ignored: only join_timeout applies")
    if args.monitor_interval is not None:
        ignored.append(
            f"--monitor-interval {args.monitor_interval:g} is ignored: an agent sees an exit at "
            "once"
        )
    return ignored


def _without_effect(args: argparse.Namespace) -> list[str]:
    """A warning for each setting given that this job never uses (after :func:`_validate`).

    A job of a fixed size (``--min-ranks`` = ``--max-ranks``) never resizes: it neither grows
    (``--scale-up-delay``) nor gives ranks back (``--graceful-timeout``). One that may shrink
    uses both, since it grows back into spares and may be told to shrink.
    """
    if args.min_ranks != args.max_ranks:
        return []
    size = f"the job's size is fixed at {args.max_ranks} ranks"
    unused = {
        "scale_up_delay_s": (
            "--scale-up-delay",
            f"{size}, so it never grows (give --max-ranks, or --nnodes MIN:MAX, to let it grow "
            "into spares)",
        ),
        "graceful_timeout_s": (
            "--graceful-timeout",
            f"{size}, so no rank is ever given back (give --min-ranks below {args.max_ranks} to "
            "let `p2p-run scale` shrink it)",
        ),
    }
    parser = build_parser()
    return [
        f"{flag} {getattr(args, dest):g} has no effect: {why}"
        for dest, (flag, why) in unused.items()
        if getattr(args, dest) != parser.get_default(dest)
    ]


def _validate(args: argparse.Namespace, script: bool = True) -> None:
    if args.join_timeout_s <= 0:
        raise UsageError("--join-timeout must be > 0 seconds")
    if script and args.script is None and not args.print_config:
        raise UsageError("no training script given (p2p-run [flags] train.py [args])")
    if args.nnodes < 1 or args.nproc_per_node < 1:
        raise UsageError("--nnodes and --nproc-per-node must be >= 1")
    world = args.nnodes * args.nproc_per_node
    args.min_ranks = world if args.min_ranks is None else args.min_ranks
    args.max_ranks = world if args.max_ranks is None else args.max_ranks
    if not 1 <= args.min_ranks <= world <= args.max_ranks:
        raise UsageError(
            f"--min-ranks {args.min_ranks} <= the start size {world} (--nnodes x "
            f"--nproc-per-node) <= --max-ranks {args.max_ranks} does not hold"
        )
    joining = args.max_ranks > world and args.node_rank >= args.nnodes
    if args.node_rank < 0 or (args.node_rank >= args.nnodes and not joining):
        raise UsageError(
            f"--node-rank {args.node_rank} is outside 0..{args.nnodes - 1} (--nnodes {args.nnodes})"
            "; a node joins a running job only when --max-ranks leaves room"
        )
    if args.min_ranks < world and args.min_ranks <= args.replicas:
        raise UsageError(
            f"--min-ranks {args.min_ranks} leaves no room for --replicas {args.replicas} "
            "copies of every shard on other ranks; raise it above --replicas"
        )
    if args.allowed_sizes:
        try:
            args.allowed_sizes = tuple(int(x) for x in args.allowed_sizes.split(","))
        except ValueError:
            raise UsageError(f"--allowed-sizes {args.allowed_sizes!r} is not like 2,4,8") from None
    if args.spares < 0:
        raise UsageError("--spares must be >= 0")
    if args.max_restarts < 0:
        raise UsageError("--max-restarts must be >= 0 (0: stop the job at the first fault)")
    world = args.nnodes * args.nproc_per_node
    if world > 1 and not 1 <= args.replicas < world:
        raise UsageError(f"--replicas {args.replicas} must be between 1 and {world - 1}")
    if args.heartbeat_interval_s <= 0 or args.heartbeat_timeout_s <= args.heartbeat_interval_s:
        raise UsageError("--heartbeat-timeout must be larger than --heartbeat-interval > 0")
    if args.resume and not args.checkpoint_dir:
        raise UsageError("--resume needs --checkpoint-dir (where to resume from)")
    if args.lazy_gloo and args.eager_gloo:
        raise UsageError("--lazy-gloo and --eager-gloo contradict each other: give one of them")
    if args.checkpoint_every < 1:
        raise UsageError("--checkpoint-every must be >= 1")
    if args.replicate_every < 1:
        raise UsageError("--replicate-every must be >= 1")
    standby_nodes(args.standby_coordinators, args.nnodes)
    visible = visible_devices()
    slots = args.nproc_per_node + args.spares
    if args.virtual_local_rank and visible is not None and len(visible) < slots:
        raise UsageError(
            f"--virtual-local-rank gives each of this node's {slots} processes (ranks and "
            f"spares) a device of its own, and CUDA_VISIBLE_DEVICES lists {len(visible)}: list "
            "more devices, or start fewer processes"
        )
    if args.local_addr is not None and (
        not args.local_addr or any(c.isspace() or c in "/:[]" for c in args.local_addr)
    ):
        raise UsageError(
            f"--local-addr {args.local_addr!r} must be a host name or an IPv4 address "
            "the other nodes reach this one at (no port)"
        )
    if not 0 < args.takeover_timeout_s < args.coordinator_timeout_s:
        raise UsageError(
            f"--takeover-timeout {args.takeover_timeout_s} must be > 0 and below "
            f"--coordinator-timeout {args.coordinator_timeout_s}"
        )
    if args.coordinator_timeout_s <= 1.0:
        raise UsageError(
            "--coordinator-timeout must be more than 1 s (the coordinator beats at 5 Hz)"
        )
    if args.stop_checkpoint_timeout_s <= 0:
        raise UsageError("--stop-checkpoint-timeout must be more than 0 s")
    if args.module and args.no_python:
        raise UsageError("--module and --no-python cannot both be given")
    runs = not args.print_config and script
    if runs and args.no_python and shutil.which(args.script) is None:
        raise UsageError(f"{args.script} is neither an executable file nor a program on PATH")
    if runs and not args.module and not args.no_python and not Path(args.script).is_file():
        raise UsageError(f"script {args.script} does not exist")
    if args.line_prefix is None:  # torchrun takes it from its environment only
        args.line_prefix = os.environ.get(LINE_PREFIX_ENV)
    try:
        args.output = from_args(OutputConfig, args)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.external_coordinator and not args.coordinator:
        raise UsageError("--external-coordinator needs --coordinator host:port (where it runs)")
    if args.node_rank > 0 and not args.coordinator:
        raise UsageError("nodes other than 0 need --coordinator host:port (node 0's address)")
    if args.coordinator:
        host, _, port = args.coordinator.rpartition(":")
        if not host or not port.isdigit() or not 0 <= int(port) < 65536:
            raise UsageError(f"--coordinator {args.coordinator!r} is not host:port")


def _secret_file(args: argparse.Namespace, run_dir: Path) -> str:
    """The job's secret: the one given, or ``<run-dir>/secret`` made once by node 0."""
    path = Path(args.secret_file) if args.secret_file else run_dir / secret_file.SECRET_FILE
    try:
        if args.secret_file:
            protocol.read_secret(str(path))
        elif args.node_rank == 0 and not args.external_coordinator:
            secret_file.create_once(path)
        else:
            secret_file.wait_for(path, args.join_timeout_s)
    except ValueError as e:
        raise UsageError(f"{e} (--secret-file)") from None
    return str(path)


def _operator_key(run_dir: Path) -> None:
    """Make ``<run-dir>/operator.key`` (0600) once: the credential ``p2p-run scale`` signs with."""
    try:
        secret_file.create_once(run_dir / secret_file.OPERATOR_KEY_FILE)
    except ValueError as e:
        raise UsageError(f"{e} (the operator key p2p-run scale uses)") from None


def standby_nodes(spec: str | None, nnodes: int) -> list[int]:
    """The node ranks of ``--standby-coordinators`` (default: node 1 of a 2+ node job).

    Raises:
        UsageError: not a list of node ranks of this job other than 0.
    """
    if spec is None:
        return [1] if nnodes >= 2 else []
    if spec.strip().lower() == "none":
        return []
    try:
        nodes = sorted({int(x) for x in spec.split(",") if x.strip()})
    except ValueError:
        raise UsageError(
            f"--standby-coordinators {spec!r} is not a comma-separated list of node ranks "
            "(or 'none')"
        ) from None
    bad = [n for n in nodes if not 0 < n < nnodes]
    if bad:
        raise UsageError(
            f"--standby-coordinators {spec!r}: node(s) {bad} cannot run a standby (node 0 runs "
            f"the active coordinator; this job has nodes 0..{nnodes - 1})"
        )
    return nodes


def _elastic(args: argparse.Namespace, world: int) -> ElasticConfig | None:
    """The elastic policy the flags describe; ``None`` for a job of a fixed size."""
    if args.min_ranks == args.max_ranks == world and not args.allowed_sizes:
        return None
    return from_args(
        ElasticConfig,
        args,
        allowed_sizes=args.allowed_sizes or None,
        scale_down_wait_s=args.spare_wait_s,
    )


def coordinator_config(
    args: argparse.Namespace, run_dir: Path, secret: str, host: str, port: int, **given: Any
) -> CoordinatorConfig:
    """The configuration of this job's coordinator, from the (resolved, validated) flags.

    Raises:
        UsageError: a setting the configuration refuses.
    """
    world = args.nnodes * args.nproc_per_node
    try:
        membership = from_args(
            MembershipConfig,
            args,
            world_size=world,
            ranks_per_node=args.nproc_per_node,
            join_timeout_s=args.join_timeout_s,
            elastic=_elastic(args, world),
        )
        return from_args(
            CoordinatorConfig,
            args,
            host=host,
            port=port,
            job_id=args.job_id,
            secret_file=secret,
            operator_key_file=str(run_dir / secret_file.OPERATOR_KEY_FILE),
            run_dir=str(run_dir),
            membership=membership,
            **given,
        )
    except ValueError as e:
        raise UsageError(str(e)) from None


def _start_coordinator(
    args: argparse.Namespace, run_dir: Path, secret: str, standby_of: str | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    host, port = "127.0.0.1", 0
    if args.coordinator:
        host, _, p = args.coordinator.rpartition(":")
        port = int(p)
    advertise = host
    if standby_of is not None:
        # A standby listens on this node: on loopback when the job does, else everywhere,
        # announced under this host's name.
        port = 0
        if host not in ("127.0.0.1", "localhost", "::1"):
            host, advertise = "0.0.0.0", args.local_addr or socket.gethostname()
    if port:
        with socket.socket() as s:  # a clear message beats a coordinator dying at bind()
            # As ZeroMQ binds: a previous run's connections in TIME_WAIT do not hold the port.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as e:
                raise UsageError(
                    f"cannot start the coordinator on {host}:{port}: {e.strerror}"
                ) from None
    address_file = run_dir / (
        COORDINATOR_FILE if standby_of is None else f"coordinator-{args.node_rank}.json"
    )
    address_file.unlink(missing_ok=True)
    standby = (
        {}
        if standby_of is None
        else {"standby_of": standby_of, "node": str(args.node_rank), "advertise": advertise}
    )
    settings = coordinator_config(args, run_dir, secret, host, port, **standby)
    path = config_file(run_dir, settings.node)
    write_private(path, dump(settings))
    cmd = [sys.executable, "-m", "launcher.coordinator", "--config", str(path)]
    proc = subprocess.Popen(cmd, preexec_fn=die_with_parent())
    deadline = time.monotonic() + _COORDINATOR_START_S
    while not address_file.exists():
        if proc.poll() is not None:
            raise UsageError(f"the coordinator exited with code {proc.returncode} at start-up")
        if time.monotonic() > deadline:
            proc.kill()
            raise UsageError(f"the coordinator did not start within {_COORDINATOR_START_S:.0f}s")
        try:
            proc.wait(timeout=0.05)  # wakes early if it dies
        except subprocess.TimeoutExpired:
            pass
    info = json.loads(address_file.read_text())
    if standby_of is not None:
        return proc, info["address"]
    return proc, f"{host}:{info['port']}"


def _engine_env(args: argparse.Namespace) -> dict[str, str]:
    """The settings engine scripts read (``p2p_state.protect``'s defaults), and the rest of
    torchrun's environment: frameworks tell a torchrun launch by ``TORCHELASTIC_RUN_ID``
    (``torch.distributed.is_torchelastic_launched()``). The restart count stays 0: p2p-run
    never restarts the ranks as a group."""
    env = {
        "TORCHELASTIC_RUN_ID": args.job_id,
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": str(args.max_restarts),
        "ROLE_NAME": args.role,
        protocol.ENV_REPLICAS: str(args.replicas),
        protocol.ENV_REPLICATE_EVERY: str(args.replicate_every),
    }
    if args.checkpoint_dir:
        env[protocol.ENV_CHECKPOINT_DIR] = args.checkpoint_dir
        env[protocol.ENV_CHECKPOINT_EVERY] = str(args.checkpoint_every)
    if args.resume:
        env[protocol.ENV_RESUME] = "1"
    if args.lazy_gloo or args.eager_gloo:
        env[protocol.ENV_LAZY_GLOO] = "1" if args.lazy_gloo else "0"
    return env


def _command(args: argparse.Namespace) -> tuple[str, ...]:
    if args.no_python:
        return (args.script, *args.script_args)
    if args.module:
        return (sys.executable, "-u", "-m", args.script, *args.script_args)
    return (sys.executable, "-u", args.script, *args.script_args)


def _made_folders(args: argparse.Namespace) -> Path:
    """Make the run folder and a local ``--checkpoint-dir`` before anything starts (a remote
    one, ``s3://...``, is the ranks' to try): the run folder.

    Raises:
        UsageError: one cannot be made (a file in the way, no permission), naming its flag.
    """
    folders = [("--run-dir", args.run_dir or str(Path("runs") / args.job_id))]
    if args.checkpoint_dir and "://" not in args.checkpoint_dir:
        folders.append(("--checkpoint-dir", args.checkpoint_dir))
    for flag, folder in folders:
        try:
            Path(folder).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            why = "a file is there" if isinstance(e, FileExistsError) else e.strerror
            raise UsageError(
                f"{flag} {folder}: cannot make it ({why}): give a folder you can write"
            ) from None
    return Path(folders[0][1]).resolve()


def _log_dir(args: argparse.Namespace, run_dir: Path) -> str | None:
    """This node's folder of log files, made and announced when some stream goes to a file."""
    output: OutputConfig = args.output
    if not output.writes_files():
        return None
    base = Path(output.log_dir) if output.log_dir else run_dir / "logs"
    try:
        folder = node_log_dir(base.resolve(), args.job_id, args.node_rank)
    except OSError as e:
        raise UsageError(f"cannot make a log folder under --log-dir {base}: {e}") from None
    print(
        f"p2p-run: node {args.node_rank}: the processes' log files are in {folder}", file=sys.stderr
    )
    return str(folder)


def _report_end(code: int, reason: str, env_store: bool = True) -> None:
    if code != 0 and reason:
        recorded = re.search(rf"exited with code -?\d+ \((.*)\) and {NOT_THE_ENGINE}", reason)
        if (
            NOT_THE_ENGINE in reason
            and not env_store
            and (recorded is None or "MASTER_" in recorded.group(1))
        ):
            # A torchrun user's first run: init_process_group() found no MASTER_PORT (unless
            # the rank recorded another error).
            reason += (
                "; a script that calls init_process_group() itself needs --env-store "
                "(torchrun's MASTER_ADDR:MASTER_PORT store)"
            )
        print(f"p2p-run: the job failed: {reason}", file=sys.stderr)


def _say_dropped(reason: str) -> None:
    print(
        f"p2p-run: this node was declared lost ({reason}); the job went on without it",
        file=sys.stderr,
    )


def dropped_from_job(events: list[dict[str, Any]], node_rank: int) -> str | None:
    """Why the coordinator declared this node lost, if it did (the job then went on without it).

    Args:
        events: The job's event log (the coordinator's records are in it).
        node_rank: This node's rank.
    """
    identity = f"agent/{node_rank}"
    reason = None
    for e in events:
        # The active coordinator's records, or a standby's that took over (``coordinator/1``).
        if e.get("identity") != identity or not protocol.is_coordinator(str(e.get("source"))):
            continue
        if e.get("event") == "hello":
            reason = None  # a run directory used again: only this node's last run counts
        elif e.get("event") == "fault":
            reason = str(e.get("reason"))
    return reason


def _head_node(argv: list[str]) -> int:
    """``p2p-run coordinator [--standby-of HOST:PORT] --coordinator HOST:PORT [flags]``: the
    job's coordinator (or a standby) in the foreground, on a host that trains nothing."""
    parser = build_parser()
    parser.prog = "p2p-run coordinator"
    add_flags(parser, CoordinatorConfig, "standby_of")
    try:
        args = parser.parse_args(argv)
        _resolve(args, os.environ)
        _validate(args, script=False)
        if not args.coordinator:
            raise UsageError("p2p-run coordinator needs --coordinator host:port (where to listen)")
        run_dir = _made_folders(args)
        args.node_rank, args.external_coordinator = 0, args.standby_of is not None
        secret = _secret_file(args, run_dir)
        if not args.standby_of:
            _operator_key(run_dir)
        host, _, port = args.coordinator.rpartition(":")
        standby = {"node": "head", "advertise": host} if args.standby_of else {}
        settings = coordinator_config(args, run_dir, secret, host, int(port), **standby)
    except UsageError as e:
        print(f"p2p-run: error: {e}", file=sys.stderr)
        return Exit.USAGE
    except TimeoutError as e:
        print(f"p2p-run: error: {e}", file=sys.stderr)
        return Exit.NOT_JOINED
    return run_coordinator(settings)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``p2p-run`` console script (``p2p-run scale ...`` resizes a job)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["scale"]:
        from launcher.scale import main as scale_main

        return scale_main(argv[1:])
    if argv[:1] == ["coordinator"]:
        return _head_node(argv[1:])
    coordinator = None
    run_dir: Path | None = None
    try:
        args = build_parser().parse_args(argv)
        resolved = _resolve(args, os.environ)
        for warning in _torchrun_leftovers(args):
            print(f"p2p-run: warning: {warning}", file=sys.stderr)
        _validate(args)
        for warning in _without_effect(args):
            print(f"p2p-run: warning: {warning}", file=sys.stderr)
        if args.print_config:
            print(
                slurm.format_config(
                    resolved,
                    {
                        "spares": (args.spares, resolved.sources["spares"]),
                        "join_timeout_s": (args.join_timeout_s, "--join-timeout"),
                    },
                )
            )
            return Exit.FINISHED
        run_dir = _made_folders(args)
        secret = _secret_file(args, run_dir)
        address = args.coordinator
        if args.node_rank == 0 and not args.external_coordinator:
            _operator_key(run_dir)
            coordinator, address = _start_coordinator(args, run_dir, secret)
        elif args.node_rank in standby_nodes(args.standby_coordinators, args.nnodes):
            coordinator, _ = _start_coordinator(args, run_dir, secret, standby_of=address)
        command = _command(args)
        log_dir = _log_dir(args, run_dir)
        code = run_agent(
            from_args(
                AgentConfig,
                args,
                node_rank=args.node_rank,
                nnodes=args.nnodes,
                nproc_per_node=args.nproc_per_node,
                spares=args.spares,
                command=command,
                coordinator=address,
                job_id=args.job_id,
                secret_file=secret,
                run_dir=str(run_dir),
                welcome_timeout_s=args.join_timeout_s,
                resizes=args.min_ranks < args.max_ranks,
                extra_env=_engine_env(args),
                output=args.output,
                log_dir=log_dir,
            ),
            on_end=functools.partial(_report_end, env_store=args.env_store),
        )
        dropped = (
            dropped_from_job(read_events(run_dir), args.node_rank)
            if code == Exit.FINISHED
            else None
        )
        if coordinator is not None and code < 128 and dropped is None:
            # Not stopped by a signal, and the job ended: the coordinator ends by itself. (The
            # standby of a node the job went on without is ended below, at once.)
            try:
                coordinator.wait(timeout=10)
            except subprocess.TimeoutExpired:
                coordinator.terminate()
        if dropped is not None:
            _say_dropped(dropped)  # it heard so from the coordinator once it could again
        return code
    except UsageError as e:
        print(f"p2p-run: error: {e}", file=sys.stderr)
        return Exit.USAGE
    except TimeoutError as e:  # the secret or the coordinator never came: the job never started
        print(f"p2p-run: error: {e}", file=sys.stderr)
        return Exit.NOT_JOINED
    except AgentError as e:
        # A node the coordinator declared lost hears no more from it. If the shared event log
        # says so, the job went on without this node: it was a fault of the job's, recovered,
        # not a failure of this node's task.
        reason = dropped_from_job(read_events(run_dir), args.node_rank) if run_dir else None
        if reason is not None:
            _say_dropped(reason)
            return Exit.FINISHED
        print(f"p2p-run: error: {e}", file=sys.stderr)
        return Exit.FAILED
    except KeyboardInterrupt:
        return 130
    finally:
        if coordinator is not None and coordinator.poll() is None:
            coordinator.terminate()
            try:
                coordinator.wait(timeout=5)
            except subprocess.TimeoutExpired:
                coordinator.kill()


if __name__ == "__main__":
    sys.exit(main())
