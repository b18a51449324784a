"""The node agent: starts and watches the node's rank processes and hot spares.

One single-threaded event loop polls, with a timeout, the DEALER socket to the coordinator, a
pidfd per child (a child's exit wakes the loop at once: no polling interval) and the signal
wake-up pipe. It sends its own heartbeat, reports every exit with its code, kills what the
coordinator declares hung, starts spares on request, and on every way out (the job's end,
SIGINT, SIGTERM, an error) terminates every child it started. Children also get
``PR_SET_PDEATHSIG``, so they die with the agent even if it is SIGKILLed: a lost agent is a
lost node, and its processes must not linger as ghosts in the job.

Each child also gets a local channel to the agent (a Unix socket pair, ``P2P_AGENT_FD``). When
no coordinator has been heard for ``--coordinator-timeout`` (the active one and every standby
are gone), the agent says so on every channel and gives the ranks up to
``--stop-checkpoint-timeout`` to agree on a step among themselves and write a checkpoint of it
(:mod:`recovery.job`); they say on the channel where it is, and the agent ends with one line
naming it and how to resume.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from launcher import protocol
from launcher.config import setting
from launcher.events import EventLog
from launcher.forkserver import (
    ChildProcess,
    ForkedProcess,
    ForkServer,
    ForkServerError,
    split_python_command,
    start_method,
)
from launcher.lifetime import die_with_parent
from launcher.link import CoordinatorLinks
from launcher.output import OutputConfig, Streams, error_file, read_error_file

logger = logging.getLogger(__name__)

#: How long children get between SIGTERM and SIGKILL when the agent shuts down.
_TERMINATE_GRACE_S = 3.0


class AgentError(RuntimeError):
    """The agent cannot run its node (e.g. the coordinator refused it)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentConfig:
    """What one node runs."""

    node_rank: int
    nnodes: int
    nproc_per_node: int
    spares: int
    command: tuple[str, ...]
    """The program and its arguments (e.g. ``(python, script.py, --lr, 3e-4)``)."""
    coordinator: str
    job_id: str
    secret_file: str
    run_dir: str
    heartbeat_interval_s: float = setting(
        0.5, flag="--heartbeat-interval", help="seconds (default {default})"
    )
    welcome_timeout_s: float = 60.0
    coordinator_timeout_s: float = setting(
        30.0,
        flag="--coordinator-timeout",
        help="silence from every coordinator after which a node's ranks stop with a "
        "checkpoint and p2p-run exits with an error, seconds (default {default})",
    )
    """Silence from the coordinator after which the node gives up: its ranks stop with a
    checkpoint, then p2p-run exits with an error (the coordinator heartbeats every agent 5 times
    a second)."""
    stop_checkpoint_timeout_s: float = setting(
        300.0,
        flag="--stop-checkpoint-timeout",
        help="once no coordinator is left, how long the ranks get to agree on a step and write "
        "its checkpoint before the node stops them, seconds (default {default})",
    )
    start_method: str = setting(
        "forkserver",
        flag=("--start-method", "--start_method"),
        type=start_method,
        help="forkserver (default; fork is the same): the processes are forked from one "
        "interpreter per node that imported torch once (docs/launcher.md); spawn: each starts "
        "a fresh interpreter, as torchrun's",
    )
    virtual_local_rank: bool = setting(
        False,
        flag=("--virtual-local-rank", "--virtual_local_rank"),
        help="each process sees only its own GPU, as device 0 (LOCAL_RANK=0, "
        "CUDA_VISIBLE_DEVICES its slot's device), as torchrun's",
    )
    resizes: bool = False
    """The job may change size (``--min-ranks`` below ``--max-ranks``), which renumbers its
    ranks: under ``--local-ranks-filter`` every process's output then comes through the
    agent, as a spare's does, so that the console follows the ranks (:meth:`Streams.moved`)."""
    extra_env: dict[str, str] = field(default_factory=dict)
    output: OutputConfig = field(default_factory=OutputConfig)
    """Where the processes' stdout and stderr go (:mod:`launcher.output`)."""
    log_dir: str | None = None
    """This node's folder of log files, where ``output`` sends any stream to a file."""


@dataclass(slots=True)
class _Child:
    identity: str
    routing: str
    role: str
    rank: int | None
    local_rank: int | None
    proc: ChildProcess
    pidfd: int
    channel: socket.socket
    """The agent's end of the child's local channel (``P2P_AGENT_FD``)."""
    name: str
    """Its folder of log files and its console prefix (``rank3``, ``spare1-5``)."""
    error_file: Path
    """Where it records the exception that ends it (torchrun's ``TORCHELASTIC_ERROR_FILE``)."""
    heard_all: bool = False
    """Its channel has closed: nothing more will come on it."""
    lines: protocol.LocalLines = field(default_factory=protocol.LocalLines)


#: How long a hello may go unanswered before it is sent again, on a fresh connection.
_HELLO_RETRY_S = 2.0
#: How long the fork server gets to import torch before the node does without it.
_FORKSERVER_READY_S = 300.0
#: How long an exit report is kept to be sent again to a coordinator that takes over.
_EXITS_KEPT_S = 60.0


def visible_devices() -> list[str] | None:
    """The devices ``CUDA_VISIBLE_DEVICES`` lets this node's processes use (``None``: all)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return None if visible is None else [d.strip() for d in visible.split(",") if d.strip()]


def slot_device(local_rank: int) -> str:
    """The one device local slot ``local_rank`` sees under ``--virtual-local-rank``: the
    slot's entry of ``CUDA_VISIBLE_DEVICES``, else the device of that index."""
    visible = visible_devices()
    return str(local_rank) if visible is None else visible[local_rank]


class Agent:
    """Runs one node of a job until the coordinator ends it or a signal arrives."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.identity = f"agent/{config.node_rank}"
        self.codec = protocol.Codec(
            protocol.read_secret(config.secret_file), config.job_id, self.identity
        )
        self.events = EventLog(config.run_dir, self.identity)
        self.children: dict[int, _Child] = {}
        self.streams = Streams(config.output, config.log_dir)
        self._spawned = 0
        self.forkserver: ForkServer | None = None
        """The node's fork server (:mod:`launcher.forkserver`); ``None``: each process starts
        a fresh interpreter."""
        self._entry: list[str] = []
        """What a forked process runs: ``[script, args...]`` or ``["-m", module, args...]``."""
        self._signal: int | None = None
        self.env_store_port = 0
        """Port of torch's TCPStore when p2p-run was given ``--env-store`` (else 0)."""
        self.end_reason: str | None = None
        """The coordinator's reason when it ended the job."""
        self.links: CoordinatorLinks | None = None
        self._voted_for: tuple[int, str] | None = None
        self._generation = 0
        """The newest generation a coordinator's message carried: a standby that mirrored an
        older one would take over a job that has moved on, and gets no vote."""
        self._beat: int | None = None
        """The ``beat`` of the active coordinator's last heartbeat, echoed in this node's."""
        self._exits: list[tuple[float, dict[str, Any]]] = []
        """Exits reported lately: sent again to a coordinator that takes over (the one they
        went to may have died before acting on them)."""
        self._stopped: dict[str, dict[str, Any]] = {}
        """What each child said on its channel about the checkpoint of a stopping job."""

    # -- children ------------------------------------------------------------------------------

    def _env(
        self,
        identity: str,
        routing: str,
        role: str,
        rank: int | None,
        local_rank: int | None,
        channel: int,
        error_file: Path,
    ) -> dict[str, str]:
        cfg = self.config
        env = self._shared_env()
        world = cfg.nnodes * cfg.nproc_per_node
        host = cfg.coordinator.rsplit(":", 1)[0]
        env.update(
            {
                "WORLD_SIZE": str(world),
                "ROLE_WORLD_SIZE": str(world),
                "LOCAL_WORLD_SIZE": str(cfg.nproc_per_node),
                "GROUP_RANK": str(cfg.node_rank),
                "GROUP_WORLD_SIZE": str(cfg.nnodes),
                "MASTER_ADDR": host,
                protocol.ENV_COORDINATOR: self._coordinators(),
                protocol.ENV_JOB_ID: cfg.job_id,
                protocol.ENV_SECRET_FILE: cfg.secret_file,
                protocol.ENV_ROLE: role,
                protocol.ENV_IDENTITY: identity,
                protocol.ENV_ROUTING_ID: routing,
                protocol.ENV_NODE_RANK: str(cfg.node_rank),
                protocol.ENV_HEARTBEAT_INTERVAL: str(cfg.heartbeat_interval_s),
                protocol.ENV_RUN_DIR: cfg.run_dir,
                protocol.ENV_AGENT_PID: str(os.getpid()),
                protocol.ENV_AGENT_FD: str(channel),
                "TORCHELASTIC_ERROR_FILE": str(error_file),
            }
        )
        if self.env_store_port:
            # A plain env:// script joins the coordinator's TCPStore as a client: it outlives
            # any rank. Protected scripts rendezvous through the authenticated store instead.
            env.update(MASTER_PORT=str(self.env_store_port), TORCHELASTIC_USE_AGENT_STORE="True")
        if rank is not None:
            env.update(RANK=str(rank), LOCAL_RANK=str(local_rank), ROLE_RANK=str(rank))
        else:
            for var in ("RANK", "ROLE_RANK"):
                env.pop(var, None)
            # A spare's device: the slots after the node's ranks (on a GPU node, one per spare).
            env["LOCAL_RANK"] = str(local_rank)
        if cfg.virtual_local_rank:
            assert local_rank is not None
            env.update(LOCAL_RANK="0", CUDA_VISIBLE_DEVICES=slot_device(local_rank))
        return env

    def _shared_env(self) -> dict[str, str]:
        """The environment every process of the node has (the fork server imports in it)."""
        env = dict(os.environ)
        env.update(self.config.extra_env)
        if self.config.nproc_per_node > 1:
            env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does
        return env

    def _start_forkserver(self, wake_fd: int) -> bool:
        """Start the node's fork server under ``--start-method forkserver``, where the command
        allows it, and wait for its imports (before this node says hello: the coordinator
        hears it from then on). ``False``: a signal came first."""
        cfg = self.config
        split = split_python_command(cfg.command) if cfg.start_method == "forkserver" else None
        if split is None:
            if cfg.start_method == "forkserver":
                logger.debug(
                    "%s is not `python [options] script.py` nor `python -m module`: each "
                    "process starts a fresh interpreter",
                    " ".join(cfg.command[:3]),
                )
            return True
        interpreter, self._entry = split
        started = time.monotonic()
        try:
            server = ForkServer(interpreter, self._shared_env())
        except OSError as e:
            logger.warning(
                "the fork server could not start (%s): each process starts a fresh interpreter", e
            )
            return True
        try:
            while not server.wait_ready(started + _FORKSERVER_READY_S - time.monotonic(), wake_fd):
                os.read(wake_fd, 4096)
                if self._signal is not None:
                    server.close()
                    return False
        except ForkServerError as e:
            logger.warning("%s: each process starts a fresh interpreter", e)
            server.close()
            return True
        self.forkserver = server
        self.events.write(
            "forkserver_ready",
            pid=server.pid,
            preloaded=server.preloaded,
            seconds=round(time.monotonic() - started, 3),
        )
        return True

    def _coordinators(self) -> str:
        """Every coordinator known now, the active one first (``P2P_COORDINATOR``)."""
        if self.links is None:
            return self.config.coordinator
        others = [a for a in self.links.sockets if a != self.links.active]
        return ",".join([self.links.active, *others])

    def _spawn(self, role: str, rank: int | None = None, local_rank: int | None = None) -> None:
        self._spawned += 1
        identity = f"{role}/{self.config.node_rank}/{self._spawned}"
        routing = protocol.routing_id(identity)
        name = (
            self._rank_name(rank)
            if rank is not None
            else f"spare{self.config.node_rank}-{self._spawned}"
        )
        assert local_rank is not None
        errors = error_file(self.config.log_dir, self.config.run_dir, name, identity)
        mine, theirs = socket.socketpair()

        def popen(**streams: Any) -> ChildProcess:
            env = self._env(identity, routing, role, rank, local_rank, theirs.fileno(), errors)
            if self.forkserver is not None:
                try:
                    return self.forkserver.spawn(
                        self._entry, env=env, pass_fds=(theirs.fileno(),), **streams
                    )
                except ForkServerError as e:
                    logger.warning("%s: %s starts a fresh interpreter", e, identity)
                    if self.forkserver.gone:  # its processes went with it
                        self.forkserver.close()
                        self.forkserver = None
            return subprocess.Popen(
                list(self.config.command),
                env=env,
                preexec_fn=die_with_parent(),
                pass_fds=(theirs.fileno(),),
                **streams,
            )

        try:
            movable = rank is None or self.config.resizes
            proc = self.streams.start(name, local_rank, popen, rank=rank, movable=movable)
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        mine.setblocking(False)
        # A forked process is the server's child: its pidfd came from the server, which took
        # it before the process could be reaped (its pid alone could be reused by then).
        pidfd = os.dup(proc.pidfd) if isinstance(proc, ForkedProcess) else os.pidfd_open(proc.pid)
        self.children[pidfd] = _Child(
            identity, routing, role, rank, local_rank, proc, pidfd, mine, name, errors
        )
        self.events.write(
            "process_started", identity=identity, role=role, rank=rank, pid=proc.pid, name=name
        )

    def _spawn_spare(self) -> None:
        # A spare's LOCAL_RANK is the first local slot after the ranks' that no live spare
        # holds (the device it would use on a GPU node).
        taken = {c.local_rank for c in self.children.values() if c.role == "spare"}
        local = next(i for i in itertools.count(self.config.nproc_per_node) if i not in taken)
        self._spawn("spare", None, local)

    def _reap(self, pidfd: int) -> None:
        child = self.children.pop(pidfd)
        code = child.proc.wait()
        os.close(pidfd)
        self._hear(child)  # what it said last, before it exited
        child.channel.close()
        error = read_error_file(child.error_file, protocol.MAX_ERROR_CHARS) if code else ""
        self.events.write(
            "process_exited",
            identity=child.identity,
            pid=child.proc.pid,
            code=code,
            rank=child.rank,
            **({"error": error} if error else {}),
        )
        body = {
            "identity": child.identity,
            "pid": child.proc.pid,
            "code": code,
            "rank": child.rank,
            "role": child.role,
        }
        if error:
            # torchrun's root cause: said where the node's output is read, and to the
            # coordinator, whose reason for the fault (or the job's end) ends with it.
            body["error"] = error
            logger.warning(
                "%s (%s) exited with code %d: %s (traceback: %s)",
                child.name,
                child.identity,
                code,
                error,
                child.error_file,
            )
        now = time.monotonic()
        self._exits = [(t, b) for t, b in self._exits if now - t < _EXITS_KEPT_S][-1000:]
        self._exits.append((now, body))
        self._send(protocol.EXITED, body)

    def _hear(self, child: _Child) -> None:
        """Read what ``child`` said on its channel (at most 1 MiB a call: a child that never
        stops talking must not keep the loop, and the node's heartbeats, here)."""
        for _ in range(16):
            try:
                data = child.channel.recv(65536)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                logger.warning("the channel to %s failed: %s", child.identity, e)
                child.heard_all = True
                return
            if not data:
                child.heard_all = True
                return
            for msg in child.lines.feed(data):
                if msg["type"] == protocol.STOPPED:
                    body = {k: v for k, v in msg.items() if k != "type"}
                    self._stopped[child.identity] = body
                    self.events.write("child_stopped", identity=child.identity, **body)
                elif msg["type"] == protocol.ASSIGNED:
                    self._assigned(child, msg.get("rank"))

    def _assigned(self, child: _Child, rank: object) -> None:
        """``child`` holds ``rank`` now (a spare assigned, ranks renumbered by a resize): its
        console output is named and shown as that rank's."""
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            logger.warning("%s said it took rank %r, which is no rank", child.identity, rank)
            return
        name = self._rank_name(rank)
        self.streams.moved(child.name, name, rank % self.config.nproc_per_node, rank)
        child.name = name

    def _rank_name(self, rank: int) -> str:
        """A rank's folder of log files and console prefix (``--role`` and the rank)."""
        return f"{self.config.output.role}{rank}"

    def _tell(self, child: _Child, type_: str, body: dict[str, Any]) -> None:
        try:
            child.channel.sendall(protocol.encode_local(type_, body))
        except OSError as e:  # it is exiting: its exit is reaped as usual
            logger.info("could not tell %s %s: %s", child.identity, type_, e)

    def _tell_coordinators(self, links: CoordinatorLinks) -> None:
        """Tell every child which coordinators there are and which one is active: a process
        that was started before a standby joined, and was never welcomed by the coordinator it
        was started with, has no other way to find the one that took over."""
        body = {"addresses": list(links.sockets), "active": links.active, "term": links.term}
        for child in self.children.values():
            self._tell(child, protocol.COORDINATORS, body)

    def _kill(self, identity: str, pid: int, reason: str) -> None:
        for child in self.children.values():
            if child.identity == identity and child.proc.pid == pid:
                logger.warning("killing %s (pid %d): %s", identity, pid, reason)
                self.events.write("process_killed", identity=identity, pid=pid, reason=reason)
                child.proc.kill()  # SIGKILL also ends a SIGSTOPped process
                return

    def terminate_all(self) -> None:
        """SIGTERM every child, then SIGKILL whatever is left after a grace period; their
        tee'd output is read meanwhile (a child blocked on a full pipe could not exit)."""
        for child in self.children.values():
            if child.proc.poll() is None:
                child.proc.terminate()
        deadline = time.monotonic() + _TERMINATE_GRACE_S
        running = {pidfd for pidfd, c in self.children.items() if c.proc.poll() is None}
        while running and (left_s := deadline - time.monotonic()) > 0:
            poller = zmq.Poller()
            for fd in running:
                poller.register(fd, zmq.POLLIN)
            consoles = self._watch_streams(poller)
            for fd, _ in poller.poll(int(left_s * 1000) + 1):
                if self._serve_stream(fd, consoles):
                    continue
                if fd in running and self.children[fd].proc.poll() is not None:
                    running.discard(fd)
        for pidfd, child in list(self.children.items()):
            if child.proc.poll() is None:
                child.proc.kill()
                child.proc.wait()
            os.close(pidfd)
            child.channel.close()
        self.children.clear()
        self.streams.close()
        if self.forkserver is not None:
            self.forkserver.close()
            self.forkserver = None

    def _watch_streams(self, poller: zmq.Poller) -> list[int]:
        """Poll the children's pipes, and the consoles that have bytes waiting for them (the
        loop never blocks on a console: it also sends the heartbeats). Returns the latter."""
        for fd in self.streams.fds():
            poller.register(fd, zmq.POLLIN)
        consoles = self.streams.consoles_waiting()
        for fd in consoles:
            poller.register(fd, zmq.POLLOUT)
        return consoles

    def _serve_stream(self, fd: int, consoles: list[int]) -> bool:
        """Read pipe ``fd`` or write console ``fd``; ``False``: it is neither."""
        if fd in self.streams:
            self.streams.read(fd)
        elif fd in consoles:
            self.streams.write_console(fd)
        else:
            return False
        return True

    # -- the loop ------------------------------------------------------------------------------

    def _send(self, type_: str, body: dict[str, Any]) -> None:
        assert self.links is not None
        self.links.send(type_, body)

    def _heartbeat(self) -> None:
        """A sign of life, echoing the active coordinator's last heartbeat: a coordinator that
        lost its quorum counts this node again only on the answer to one it sent since."""
        self._send(protocol.HEARTBEAT, {} if self._beat is None else {"beat": self._beat})

    def run(self) -> int:
        """Start the node's processes and serve until the job ends; returns the exit code."""
        cfg = self.config
        ctx = zmq.Context()
        self.links = links = CoordinatorLinks(ctx, self.identity, self.codec, [cfg.coordinator])
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        old_wakeup = signal.set_wakeup_fd(wake_w)
        old_handlers = {
            s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            if not self._start_forkserver(wake_r):
                return self._interrupted()
            self.events.write("agent_hello", node=cfg.node_rank, coordinator=cfg.coordinator)
            first, early = self._await_welcome(
                links,
                wake_r,
                {
                    "role": "agent",
                    "node": cfg.node_rank,
                    "pid": os.getpid(),
                    "world_size": cfg.nnodes * cfg.nproc_per_node,
                    "nproc_per_node": cfg.nproc_per_node,
                },
            )
            if first is None:
                return self._interrupted()
            if first.type == protocol.SHUTDOWN:
                reason = first.body.get("reason", "")
                raise AgentError(f"the coordinator refused this node: {reason}")
            self.env_store_port = int(first.body.get("env_store_port", 0))
            standbys = [a for a in first.body.get("standbys", [])[:8] if isinstance(a, str)]
            for address in standbys:
                links.add(address)
            if standbys:
                self.events.write("standbys_known", node=cfg.node_rank, addresses=standbys)
            if cfg.node_rank < cfg.nnodes:
                for local in range(cfg.nproc_per_node):
                    self._spawn("rank", cfg.node_rank * cfg.nproc_per_node + local, local)
                for _ in range(cfg.spares):
                    self._spawn_spare()
            else:
                # A node joining an elastic job that already runs: its processes are capacity
                # the coordinator grows into.
                for _ in range(cfg.nproc_per_node + cfg.spares):
                    self._spawn_spare()
            return self._serve(links, wake_r, early)
        finally:
            self.terminate_all()
            signal.set_wakeup_fd(old_wakeup)
            for s, h in old_handlers.items():
                signal.signal(s, h)
            os.close(wake_r)
            os.close(wake_w)
            links.close()
            ctx.term()
            self.events.close()

    def _await_welcome(
        self, links: CoordinatorLinks, wake_r: int, hello: dict[str, Any]
    ) -> tuple[protocol.Message | None, list[protocol.Message]]:
        """Say hello until the coordinator's first answer (welcome or shutdown) comes; what came
        before it is dropped. An unanswered hello goes again every ``_HELLO_RETRY_S`` on a fresh
        connection (a coordinator over its connection cap refused the last one).

        Returns:
            The answer (``None``: a SIGINT or SIGTERM came first, woken through ``wake_r``),
            and what was read with it, after it: a standby that joined meanwhile, say, which
            this node must know to follow it.
        """
        cfg = self.config
        sock = links.active_socket
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(wake_r, zmq.POLLIN)
        deadline = time.monotonic() + cfg.welcome_timeout_s
        next_hello, first = time.monotonic(), True
        while self._signal is None:
            now = time.monotonic()
            if now >= next_hello:
                if not first:
                    links.reconnect(links.active)
                self._send(protocol.HELLO, hello)
                next_hello, first = now + _HELLO_RETRY_S, False
            left_s = deadline - now
            if left_s <= 0:
                raise TimeoutError(
                    f"no answer from the coordinator at {cfg.coordinator} within "
                    f"{cfg.welcome_timeout_s:.0f}s; check --coordinator and that node 0 runs"
                )
            ready = dict(poller.poll(int(min(left_s, next_hello - now) * 1000)))
            if wake_r in ready:
                os.read(wake_r, 4096)
            if sock not in ready:
                continue
            messages = self.codec.drain(sock)
            for i, msg in enumerate(messages):
                if msg.type in (protocol.WELCOME, protocol.SHUTDOWN):
                    return msg, messages[i + 1 :]
        return None, []

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._signal = signum

    def _interrupted(self) -> int:
        """The exit code of a node stopped by ``self._signal`` (its children are terminated on
        the way out of :meth:`run`)."""
        assert self._signal is not None
        self.events.write("agent_interrupted", signal=self._signal)
        return 128 + self._signal

    def _serve(self, links: CoordinatorLinks, wake_r: int, early: list[protocol.Message]) -> int:
        """Serve until the job ends, starting with ``early``: what came with the welcome."""
        next_beat = 0.0
        self._heard = time.monotonic()
        code = self._handle(links, links.active_socket, early)
        if code is not None:
            return code
        while True:
            poller = zmq.Poller()
            for sock in links.sockets.values():
                poller.register(sock, zmq.POLLIN)
            poller.register(wake_r, zmq.POLLIN)
            for fd in self.children:
                poller.register(fd, zmq.POLLIN)
            consoles = self._watch_streams(poller)
            channels = {c.channel.fileno(): c for c in self.children.values() if not c.heard_all}
            for fd in channels:
                poller.register(fd, zmq.POLLIN)
            server = self.forkserver.fileno() if self.forkserver is not None else -1
            if server >= 0:
                poller.register(server, zmq.POLLIN)
            timeout_ms = max(0.0, next_beat - time.monotonic()) * 1000
            ready = poller.poll(int(timeout_ms))
            # What a child said on its channel goes before the output it wrote after saying it
            # (a spare says it took a rank, then prints as that rank).
            ready.sort(key=lambda event: event[0] not in channels)
            for item, _ in ready:
                if item == wake_r:
                    os.read(wake_r, 4096)
                elif item == server and self.forkserver is not None:
                    self.forkserver.drain()  # exit reports, a late answer's process killed
                elif item in self.children:
                    self._reap(item)
                elif self._serve_stream(item, consoles):
                    continue
                elif item in channels:
                    child = channels[item]
                    if self.children.get(child.pidfd) is child:  # not reaped just now
                        self._hear(child)
                else:
                    code = self._receive(links, item)
                    if code is not None:
                        return code
            if self._signal is not None:
                return self._interrupted()
            silent = time.monotonic() - self._heard
            if silent > self.config.coordinator_timeout_s:
                raise self._stop_without_coordinator(list(links.sockets), silent, wake_r)
            if time.monotonic() >= next_beat:
                self._heartbeat()
                next_beat = time.monotonic() + self.config.heartbeat_interval_s

    def _stop_without_coordinator(
        self, addresses: list[str], silent_s: float, wake_r: int
    ) -> AgentError:
        """No coordinator is left: tell every child, give the ranks until
        ``stop_checkpoint_timeout_s`` to stop with a checkpoint, and say where it is.

        Returns:
            The error ending this node (its message is p2p-run's one line).
        """
        self.events.write("coordinator_lost", silent_s=silent_s, addresses=addresses)
        logger.error(
            "no word from any coordinator (%s) for %.0fs: the ranks stop with a checkpoint",
            ", ".join(addresses),
            silent_s,
        )
        body = {"addresses": addresses, "silent_s": round(silent_s, 1)}
        for child in self.children.values():
            self._tell(child, protocol.COORDINATORS_LOST, body)
        deadline = time.monotonic() + self.config.stop_checkpoint_timeout_s
        while self.children and self._signal is None:
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                break
            poller = zmq.Poller()
            poller.register(wake_r, zmq.POLLIN)
            for fd in self.children:
                poller.register(fd, zmq.POLLIN)
            consoles = self._watch_streams(poller)
            for item, _ in poller.poll(int(left_s * 1000)):
                if item == wake_r:
                    os.read(wake_r, 4096)
                elif not self._serve_stream(item, consoles):
                    self._reap(item)
        late = sorted(c.identity for c in self.children.values())
        for child in self.children.values():
            self._hear(child)
        line = stop_line(addresses, silent_s, self._stopped, late, self.config)
        self.events.write("stopped_without_coordinator", reason=line)
        return AgentError(line)

    def _receive(self, links: CoordinatorLinks, sock: zmq.Socket[bytes]) -> int | None:
        received = links.receive(sock)
        if received.takeover:
            self._heard = time.monotonic()
            self.events.write("coordinator_takeover", coordinator=links.active, term=links.term)
            self._beat = None  # the last one was the replaced coordinator's
            self._heartbeat()
            # Processes that said hello after the last mirror are unknown to the new one.
            self._send(
                protocol.CHILDREN, {"identities": [c.routing for c in self.children.values()]}
            )
            self._tell_coordinators(links)
            now = time.monotonic()
            for _, body in [(t, b) for t, b in self._exits if now - t < _EXITS_KEPT_S]:
                self._send(protocol.EXITED, body)
        return self._handle(links, sock, received.messages)

    def _handle(
        self, links: CoordinatorLinks, sock: zmq.Socket[bytes], messages: list[protocol.Message]
    ) -> int | None:
        """Act on the coordinators' ``messages`` read from ``sock``; the exit code of a
        shutdown among them."""
        for msg in messages:
            if msg.type == protocol.VOTE:
                self._vote(links, sock, msg)
                continue
            self._heard = time.monotonic()
            self._generation = max(self._generation, msg.generation)
            if msg.type == protocol.HEARTBEAT and "beat" in msg.body:
                self._beat = int(msg.body["beat"])
            elif msg.type == protocol.KILL:
                body = msg.body
                self._kill(body["identity"], body["pid"], str(body.get("reason", "")))
            elif msg.type == protocol.SPAWN_SPARE:
                self._spawn_spare()
            elif msg.type == protocol.STANDBYS:
                addresses = [a for a in msg.body["addresses"][:8] if isinstance(a, str)]
                for address in addresses:
                    links.add(address)
                self._tell_coordinators(links)
                self.events.write("standbys_known", node=self.config.node_rank, addresses=addresses)
            elif msg.type == protocol.SHUTDOWN:
                self.events.write("agent_shutdown", **msg.body)
                self.end_reason = str(msg.body.get("reason", ""))
                return int(msg.body.get("code", 0))
        return None

    def _vote(
        self, links: CoordinatorLinks, sock: zmq.Socket[bytes], msg: protocol.Message
    ) -> None:
        """A standby asks to take over in a newer term: yes only if this node lost the active
        coordinator too and the standby knows the job as it is now (it mirrored the newest
        generation this node heard of); once granted, no message of an older term counts here
        again.

        A pre-vote (``pre``) asks whether the vote for the next term would be granted, and
        changes nothing here: a standby cut off with a minority of nodes gets no majority of
        pre-votes, so it never starts an election whose term would make this node refuse the
        coordinator that still runs the job once the partition heals (Raft's PreVote).
        """
        address = links.address_of(sock)
        silent = time.monotonic() - self._heard
        granted, binding = decide_vote(
            msg,
            term=links.term,
            silent_s=silent,
            generation=self._generation,
            voted_for=self._voted_for,
        )
        granted = granted and address is not None
        if granted and binding:
            self._voted_for = (msg.term, msg.sender)
            links.adopt(msg.term, None)
            self.events.write(
                "voted", coordinator=msg.sender, term=msg.term, silent_s=round(silent, 3)
            )
        if address is not None:
            body: dict[str, Any] = {"granted": granted}
            if msg.body.get("pre"):
                body["pre"] = True
            if not granted:
                body["active"] = links.active  # a standby left behind follows this one
            links.send_to(address, protocol.VOTED, body)


def decide_vote(
    msg: protocol.Message,
    *,
    term: int,
    silent_s: float,
    generation: int,
    voted_for: tuple[int, str] | None,
) -> tuple[bool, bool]:
    """An agent's answer to a standby's ``vote`` (:meth:`Agent._vote` says why each rule).

    Args:
        msg: The request: its term, and in its body ``pre``, ``silence_s`` (the standby's
            takeover timeout) and ``generation`` (the newest it mirrored).
        term: The term this node obeys.
        silent_s: How long this node has heard nothing from the active coordinator.
        generation: The newest generation this node heard of.
        voted_for: The (term, standby) this node voted for last.

    Returns:
        Whether the vote (or, for a pre-vote, the vote of the next term) is granted, and whether
        it binds: a granted vote, not a pre-vote or the same vote asked again, is recorded and
        its term obeyed from then on.
    """
    pre = bool(msg.body.get("pre", False))
    asked = msg.term + 1 if pre else msg.term
    again = not pre and voted_for == (msg.term, msg.sender)  # its answer may have been lost
    silence = float(msg.body.get("silence_s", 1.0)) / 2
    current = int(msg.body.get("generation", generation)) >= generation
    granted = again or (asked > term and silent_s >= silence and current)
    return granted, granted and not pre and not again


def stop_line(
    addresses: list[str],
    silent_s: float,
    stopped: dict[str, dict[str, Any]],
    late: list[str],
    config: AgentConfig,
) -> str:
    """p2p-run's one line when no coordinator is left.

    Args:
        addresses: The coordinators this node knew.
        silent_s: How long none of them was heard.
        stopped: What each child said about the stop (``step`` and ``root``, or ``reason``).
        late: Children still running when ``stop_checkpoint_timeout_s`` passed.
        config: The node's settings.
    """
    head = f"no word from any coordinator ({', '.join(addresses)}) for {silent_s:.0f}s"
    written = sorted(
        (int(b["step"]), str(b["root"]))
        for b in stopped.values()
        if isinstance(b.get("step"), int) and isinstance(b.get("root"), str)
    )
    if written:
        step, root = written[-1]
        return (
            f"{head}: the ranks stopped at step {step} with a checkpoint in {root}; resume "
            f"with p2p-run --checkpoint-dir {root} --resume (and this job's secret)"
        )
    reasons = [str(b["reason"]) for b in stopped.values() if b.get("reason")]
    if reasons:
        return f"{head}: {reasons[0]}"
    if late:
        return (
            f"{head}: this node's ranks wrote no checkpoint within "
            f"{config.stop_checkpoint_timeout_s:.0f}s "
            "(--stop-checkpoint-timeout) and were stopped; only the periodic checkpoints, if "
            "any, are behind the job"
        )
    return f"{head}: this node's processes had ended; nothing was left to checkpoint here"


def run_agent(config: AgentConfig, on_end: Callable[[int, str], None] | None = None) -> int:
    """Run an agent; its exit code is the job's (or 128 + signal).

    Args:
        config: The node's settings.
        on_end: Called with the job's exit code and the coordinator's reason when it ends.
    """
    agent = Agent(config)
    code = agent.run()
    if on_end is not None and agent.end_reason is not None:
        on_end(code, agent.end_reason)
    return code
