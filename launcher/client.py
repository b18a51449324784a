"""The rank-side control-plane client: what a training process (or a spare) talks through.

One DEALER socket per coordinator (the active one and its standbys, :mod:`launcher.link`),
owned by one background thread: it sends a heartbeat every
interval, sends what the training thread queues (replication reports, errors, acknowledgements),
and delivers what arrives (generations, shutdown) to a thread-safe queue and an optional
callback. ZeroMQ sockets are not thread-safe, so the training thread never touches the socket:
it queues a message and wakes the thread through a pipe.

A new generation arrives as one message with everything recovery needs (see
:class:`launcher.membership.Generation`): ``generation``, ``world_size``, ``ranks`` (rank ->
identity), ``nodes`` (rank -> node), ``replaced`` (rank -> [old, new] identity), ``lost``,
``committed_step`` and ``store_prefix``; :meth:`ControlClient.store_address` gives the store.
With ``full`` false (members that already know the previous generation) ``ranks`` and ``nodes``
list only the ranks that changed; processes new to the job get the full maps.

Rank-side events (recovery phases, steps) go to the job's event log through :meth:`event`.

Under p2p-run the process also has a local channel to its node's agent (``P2P_AGENT_FD``): the
agent says there which coordinators there are (``coordinators``: a process started before a
standby joined learns of it there) and when none is left (``coordinators_lost``, delivered like
a shutdown: to :meth:`next_event` and a callback), and hears where the checkpoint the job
stopped with is.

It imports from ``launcher`` only the wire (:mod:`launcher.protocol`, :mod:`launcher.link`,
what a generation and a prepare message say) and the event log: no coordinator code.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import stat
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from launcher import protocol
from launcher.decisions import body_maps
from launcher.events import EventLog
from launcher.link import CoordinatorLinks
from launcher.prepare import memory_spec

logger = logging.getLogger(__name__)

#: How long a hello may go unanswered before it is sent again (to the next coordinator known).
HELLO_RETRY_S = 2.0


class ControlPlaneTimeout(TimeoutError):
    """A wait on the control plane passed its deadline."""


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """How a process reaches the coordinator (normally read from ``P2P_*`` variables)."""

    coordinator: str
    """``host:port`` of the coordinator to start with (a comma-separated list: then its
    standbys)."""
    job_id: str
    secret_file: str
    identity: str
    role: str
    node: int
    heartbeat_interval_s: float = 0.5
    run_dir: str | None = None
    """Where the job's event log lives (``None``: events are not written)."""
    routing_id: str | None = None
    """The routing id to connect under (``None``: a new one)."""
    agent_fd: int | None = None
    """This process's end of the local channel to its node's agent (``None``: no agent)."""

    def __post_init__(self) -> None:
        if self.routing_id is not None and protocol.identity_of(self.routing_id) != self.identity:
            raise ValueError(
                f"{protocol.ENV_ROUTING_ID} {self.routing_id!r} is not a routing id of "
                f"{protocol.ENV_IDENTITY} {self.identity!r}; unset it (a new one is drawn)"
            )

    @property
    def coordinators(self) -> list[str]:
        """Every coordinator address given, the first one first."""
        return [a.strip() for a in self.coordinator.split(",") if a.strip()]

    @classmethod
    def from_env(cls) -> ClientConfig:
        """Build from the environment ``p2p-run`` sets; ``ValueError`` names what is missing."""
        missing = [
            v
            for v in (
                protocol.ENV_COORDINATOR,
                protocol.ENV_JOB_ID,
                protocol.ENV_SECRET_FILE,
                protocol.ENV_IDENTITY,
                protocol.ENV_ROLE,
            )
            if not os.environ.get(v)
        ]
        if missing:
            raise ValueError(
                f"{', '.join(missing)} not set: start this script with p2p-run to use the "
                "control plane"
            )
        return cls(
            coordinator=os.environ[protocol.ENV_COORDINATOR],
            job_id=os.environ[protocol.ENV_JOB_ID],
            secret_file=os.environ[protocol.ENV_SECRET_FILE],
            identity=os.environ[protocol.ENV_IDENTITY],
            role=os.environ[protocol.ENV_ROLE],
            node=int(os.environ.get(protocol.ENV_NODE_RANK, "0")),
            heartbeat_interval_s=float(os.environ.get(protocol.ENV_HEARTBEAT_INTERVAL, "0.5")),
            run_dir=os.environ.get(protocol.ENV_RUN_DIR) or None,
            routing_id=os.environ.get(protocol.ENV_ROUTING_ID) or None,
            agent_fd=_agent_fd(os.environ.get(protocol.ENV_AGENT_FD, "")),
        )


def _agent_fd(value: str) -> int | None:
    """The descriptor ``P2P_AGENT_FD`` names, if it is a socket this process holds (a process
    started by a rank inherits the variable, not always the descriptor)."""
    if not value.isdigit():
        return None
    try:
        return int(value) if stat.S_ISSOCK(os.fstat(int(value)).st_mode) else None
    except OSError:
        return None


class PendingArrival:
    """An ``arrived`` to send at a time unless the generation is acknowledged first (thread-safe:
    scheduled and cancelled by the training thread, sent by the client's)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._generation: int | None = None
        self.due_t = math.inf
        """When the pending one is due (``inf``: none)."""

    def schedule(self, generation: int, due_t: float) -> None:
        with self._lock:
            self._generation, self.due_t = generation, due_t

    def acknowledged(self, generation: int) -> None:
        """``generation`` is acknowledged: an arrival at it or an older one goes unsaid."""
        with self._lock:
            if self._generation is not None and self._generation <= generation:
                self._generation, self.due_t = None, math.inf

    def take_due(self, now: float) -> int | None:
        """The generation to say ``arrived`` at now, if one is due (it is then no longer
        pending)."""
        with self._lock:
            if self._generation is None or now < self.due_t:
                return None
            generation, self._generation, self.due_t = self._generation, None, math.inf
            return generation


class ControlClient:
    """Connects, heartbeats, reports and receives generations in a background thread.

    Args:
        config: Address, identity and heartbeat interval.
        rank: The rank this process starts as (``None`` for a spare).
        on_generation: Called from the background thread with each generation's body (e.g. to
            interrupt a blocked step). Keep it short; the body also goes to :meth:`next_event`.
        on_shutdown: Called from the background thread when the job ends (with the body:
            ``code`` and ``reason``).
        on_interrupt: Called from the background thread when the coordinator announces a fault
            whose new generation will come later (a spare is awaited): ``generation``, ``lost``,
            ``wait_s``.
        on_coordinators_lost: Called from the background thread when the node's agent says no
            coordinator is left (``addresses``, ``silent_s``).
        on_store_moved: Called from the background thread with ``(host, port)`` of the
            rendezvous store when a standby that took over serves a new one.
        on_prepare: For a spare: called from the background thread with ``(kind, buffers)``,
            the buffers to allocate while it waits (:mod:`launcher.prepare`).
    """

    def __init__(
        self,
        config: ClientConfig,
        rank: int | None = None,
        on_generation: Callable[[dict[str, Any]], None] | None = None,
        on_shutdown: Callable[[dict[str, Any]], None] | None = None,
        on_interrupt: Callable[[dict[str, Any]], None] | None = None,
        on_coordinators_lost: Callable[[dict[str, Any]], None] | None = None,
        on_store_moved: Callable[[str, int], None] | None = None,
        on_prepare: Callable[[str, tuple[int, ...]], None] | None = None,
    ) -> None:
        self.config = config
        self._on_store_moved = on_store_moved
        self._on_prepare = on_prepare
        self.rank = rank
        self._on_generation = on_generation
        self._on_shutdown = on_shutdown
        self._on_interrupt = on_interrupt
        self._on_coordinators_lost = on_coordinators_lost
        self._agent_fd = config.agent_fd
        self._agent_lines = protocol.LocalLines()
        self._agent_lock = threading.Lock()
        self.events = EventLog(config.run_dir, config.identity)
        self.secret = protocol.read_secret(config.secret_file)
        """The job's secret: it also signs this process's requests to the rendezvous store."""
        self._codec = protocol.Codec(self.secret, config.job_id, config.identity)
        self._outbox: queue.Queue[tuple[str, dict[str, Any], int]] = queue.Queue()
        self.inbox: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
        self._welcome = threading.Event()
        self.store_port = 0
        self.store_host = config.coordinators[0].rsplit(":", 1)[0]
        self._last_ack: tuple[dict[str, Any], int] | None = None
        self._last_arrived: tuple[dict[str, Any], int] | None = None
        self._arrival = PendingArrival()
        self._last_replicated: dict[str, Any] | None = None
        self._last_memory: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name="p2p-control-client", daemon=True)
        self._thread.start()

    # -- training-thread API -------------------------------------------------------------------

    def report_replicated(self, step: int, generation: int = 0) -> None:
        """Tell the coordinator this rank has replicated ``step`` in ``generation``."""
        self._post(protocol.REPLICATED, {"step": int(step), "generation": int(generation)})

    def report_memory(self, kind: str, buffers: Sequence[int], generation: int) -> None:
        """Tell the coordinator the sizes of the snapshot and replica buffers this rank holds
        in ``generation`` (of memory ``kind``), so idle spares can allocate theirs early."""
        body = {"generation": int(generation), "kind": kind, "buffers": [int(n) for n in buffers]}
        self._post(protocol.MEMORY, body)

    def report_error(self, reason: str, *, fatal: bool = False) -> None:
        """Report a failure of this rank.

        Args:
            reason: What failed (logged by the coordinator).
            fatal: ``False``: this rank is lost and is replaced (a failed or timed-out
                collective it cannot attribute, a broken device). ``True``: the job cannot go
                on at all (no copy of some state survives and there is no checkpoint); the
                coordinator ends it with ``reason``.
        """
        self._post(protocol.ERROR, {"reason": reason[:1000], "fatal": bool(fatal)})

    def event(self, name: str, **fields: Any) -> None:
        """Append an event to the job's event log (source: this process's identity)."""
        self.events.write(name, **fields)

    def report_done(
        self, checkpoint_step: int | None = None, checkpoint_root: str | None = None
    ) -> None:
        """Tell the coordinator this rank completed its training and is about to exit.

        Args:
            checkpoint_step: It is leaving a stopping job, having written its part of the
                checkpoint of that step (the node's agent is told too, with
                ``checkpoint_root``: where the checkpoint is).
            checkpoint_root: Where that checkpoint is.
        """
        body = {} if checkpoint_step is None else {"checkpoint_step": int(checkpoint_step)}
        self._post(protocol.DONE, body)
        if checkpoint_step is not None:
            self.tell_agent(
                protocol.STOPPED, {"step": int(checkpoint_step), "root": str(checkpoint_root)}
            )

    def report_no_checkpoint(self, reason: str) -> None:
        """Tell the node's agent this rank leaves a stopping job without a checkpoint, and why
        (the reason names the last complete one)."""
        self.tell_agent(protocol.STOPPED, {"reason": reason[:1000]})

    def tell_agent(self, type_: str, body: dict[str, Any]) -> None:
        """Send one message to the node's agent (nothing without one; a gone agent is
        logged)."""
        if self._agent_fd is None:
            return
        data = protocol.encode_local(type_, body)
        try:
            with self._agent_lock:
                while data:
                    data = data[os.write(self._agent_fd, data) :]
        except OSError as e:
            logger.warning("could not tell the node's agent %s: %s", type_, e)

    def ack(self, generation: int) -> None:
        """Acknowledge a generation (after this rank has joined it)."""
        self._arrival.acknowledged(int(generation))
        self._post(protocol.ACK, {"generation": int(generation)}, generation)

    def arrived(self, generation: int, after_s: float = 0.0) -> None:
        """Say this process has left its old generation's groups and is forming ``generation``'s:
        if the generation does not form in time, the coordinator replaces only those that never
        arrived. Said after ``after_s``, and not at all if this process acknowledges the
        generation first: a generation that forms at once costs the coordinator its
        acknowledgements alone."""
        self._arrival.schedule(int(generation), time.monotonic() + after_s)
        os.write(self._wake_w, b"x")

    def store_address(self, timeout_s: float = 30.0) -> tuple[str, int]:
        """``(host, port)`` of the rendezvous store, once the coordinator has welcomed us."""
        if not self._welcome.wait(timeout_s):
            raise ControlPlaneTimeout(
                f"no answer from the coordinator at {self.config.coordinator} within "
                f"{timeout_s:.0f}s; is p2p-run's coordinator running?"
            )
        return self.store_host, self.store_port

    def next_event(self, timeout_s: float) -> tuple[str, dict[str, Any]]:
        """The next ``(type, body)`` from the coordinator (``generation`` or ``shutdown``), or
        ``coordinators_lost`` from the node's agent.

        Raises:
            ControlPlaneTimeout: nothing arrived within ``timeout_s``.
        """
        try:
            return self.inbox.get(timeout=timeout_s)
        except queue.Empty:
            raise ControlPlaneTimeout(
                f"{self.config.identity}: no message from the coordinator within {timeout_s:.0f}s"
            ) from None

    def wait_for_assignment(self, timeout_s: float) -> dict[str, Any]:
        """For a spare: block until a generation gives this process a rank.

        Returns:
            The generation body; its maps (:func:`launcher.decisions.body_maps`) give this
            process its rank (also in :attr:`rank`).

        Raises:
            ControlPlaneTimeout: not assigned within ``timeout_s``.
            RuntimeError: the job shut down first.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ControlPlaneTimeout(
                    f"spare {self.config.identity} was not assigned a rank within {timeout_s:.0f}s"
                )
            kind, body = self.next_event(remaining)
            if kind == protocol.SHUTDOWN:
                raise RuntimeError(f"the job ended before this spare was needed: {body}")
            if kind == protocol.COORDINATORS_LOST:
                raise RuntimeError(f"no coordinator is left before this spare was needed: {body}")
            if kind != protocol.GENERATION:
                continue
            try:
                ranks, _ = body_maps(body)
            except ValueError as e:
                logger.warning("a generation this spare cannot read: %s", e)
                continue
            mine = [r for r, identity in ranks.items() if identity == self.config.identity]
            if mine:
                self.took_rank(mine[0])
                return body

    def took_rank(self, rank: int) -> None:
        """This process holds ``rank`` now (a spare assigned, or a resize renumbered the
        ranks): its agent names and shows its output as that rank's from here on."""
        if rank != self.rank:
            self.rank = rank
            self.tell_agent(protocol.ASSIGNED, {"rank": rank})

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the background thread and close the socket (bounded linger)."""
        self._stop.set()
        os.write(self._wake_w, b"x")
        self._thread.join(timeout_s)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self.events.close()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- background thread ---------------------------------------------------------------------

    @staticmethod
    def _connect_standbys(
        links: CoordinatorLinks, poller: zmq.Poller, addresses: list[object]
    ) -> None:
        for address in addresses[:8]:
            if isinstance(address, str) and (sock := links.add(address)) is not None:
                poller.register(sock, zmq.POLLIN)

    def _post(self, type_: str, body: dict[str, Any], generation: int = 0) -> None:
        self._outbox.put((type_, body, generation))
        os.write(self._wake_w, b"x")

    def _run(self) -> None:
        ctx = zmq.Context()
        links = CoordinatorLinks(
            ctx,
            self.config.identity,
            self._codec,
            self.config.coordinators,
            routing=self.config.routing_id,
        )
        poller = zmq.Poller()
        for sock in links.sockets.values():
            poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        if self._agent_fd is not None:
            poller.register(self._agent_fd, zmq.POLLIN)
        hello = {"role": self.config.role, "node": self.config.node, "pid": os.getpid()}
        if self.rank is not None:
            hello["rank"] = self.rank
        self._hello = hello
        links.send(protocol.HELLO, hello)
        next_hello = time.monotonic() + HELLO_RETRY_S
        next_beat = time.monotonic() + self.config.heartbeat_interval_s
        try:
            while not self._stop.is_set():
                if not self._welcome.is_set() and time.monotonic() >= next_hello:
                    # Unanswered: the coordinator may have died before it heard us. Say hello
                    # to the next one known (a standby that took over answers).
                    links.reconnect(links.rotate())
                    links.send(protocol.HELLO, hello)
                    next_hello = time.monotonic() + HELLO_RETRY_S
                wait_s = next_beat if self._welcome.is_set() else min(next_beat, next_hello)
                wait_s = min(wait_s, self._arrival.due_t)
                timeout_ms = max(0.0, wait_s - time.monotonic()) * 1000
                for item, _ in poller.poll(int(timeout_ms)):
                    if item == self._wake_r:
                        os.read(self._wake_r, 4096)
                    elif item == self._agent_fd:
                        self._from_agent(links, poller)
                    else:
                        self._receive(links, item, poller)
                self._flush(links)
                arrived = self._arrival.take_due(time.monotonic())
                if arrived is not None:
                    body = {"generation": arrived}
                    self._last_arrived = (body, arrived)
                    links.send(protocol.ARRIVED, body, arrived)
                if time.monotonic() >= next_beat:
                    links.send(protocol.HEARTBEAT)
                    next_beat = time.monotonic() + self.config.heartbeat_interval_s
            self._flush(links)  # what was queued before close() still goes out
        finally:
            links.close()
            ctx.term()

    def _from_agent(self, links: CoordinatorLinks, poller: zmq.Poller) -> None:
        # Only called for the agent channel's fd, which the poller holds only when there is one.
        assert self._agent_fd is not None
        try:
            data = os.read(self._agent_fd, 65536)
        except OSError as e:
            data = b""
            logger.warning("the channel to the node's agent failed: %s", e)
        if not data:  # the agent is gone (this process dies with it: PR_SET_PDEATHSIG)
            poller.unregister(self._agent_fd)
            return
        for msg in self._agent_lines.feed(data):
            if msg["type"] == protocol.COORDINATORS:
                self._follow_agent(links, poller, msg)
                continue
            if msg["type"] != protocol.COORDINATORS_LOST:
                continue
            body = {k: v for k, v in msg.items() if k != "type"}
            self.events.write("coordinators_lost", **body)
            self.inbox.put((protocol.COORDINATORS_LOST, body))
            if self._on_coordinators_lost is not None:
                try:
                    self._on_coordinators_lost(body)
                except Exception:
                    logger.exception("coordinators_lost callback failed")

    def _follow_agent(
        self, links: CoordinatorLinks, poller: zmq.Poller, msg: dict[str, Any]
    ) -> None:
        """The node's agent says which coordinators there are and which one it obeys. Every one
        is connected to; a process not yet welcomed says hello to the agent's active one at
        once (the coordinator it was started with may have died before it answered). A welcomed
        process hears of a takeover from the new coordinator itself."""
        addresses = msg.get("addresses")
        self._connect_standbys(links, poller, addresses if isinstance(addresses, list) else [])
        active, term = msg.get("active"), msg.get("term")
        if self._welcome.is_set() or active not in links.sockets or not isinstance(term, int):
            return
        if active != links.active or term > links.term:
            links.adopt(term, active)
            links.send(protocol.HELLO, self._hello)

    def _flush(self, links: CoordinatorLinks) -> None:
        while True:
            try:
                type_, body, gen = self._outbox.get_nowait()
            except queue.Empty:
                return
            if type_ == protocol.ACK:
                self._last_ack = (body, gen)
            elif type_ == protocol.REPLICATED:
                self._last_replicated = body
            elif type_ == protocol.MEMORY:
                self._last_memory = body
            links.send(type_, body, gen)

    def _receive(
        self, links: CoordinatorLinks, sock: zmq.Socket[bytes], poller: zmq.Poller
    ) -> None:
        received = links.receive(sock)
        if received.takeover:
            # A standby took over: it knows this process from the state it mirrored (or, if
            # it said hello after the last mirror, from this hello); what the old coordinator
            # may have missed goes again (duplicates change nothing there).
            links.send(protocol.HELLO, self._hello)  # answered at once if it knows us
            if self._last_arrived is not None:
                links.send(protocol.ARRIVED, *self._last_arrived)
            if self._last_ack is not None:
                links.send(protocol.ACK, *self._last_ack)
            if self._last_replicated is not None:
                links.send(protocol.REPLICATED, self._last_replicated)
            if self._last_memory is not None:
                links.send(protocol.MEMORY, self._last_memory)
        for msg in received.messages:
            if msg.type == protocol.WELCOME:
                # The store is the welcoming coordinator's: not the first one's where that one
                # died before it answered and a standby that took over welcomed this process.
                self.store_host = links.active.rsplit(":", 1)[0]
                self.store_port = int(msg.body.get("store_port", 0))
                self._connect_standbys(links, poller, msg.body.get("standbys", []))
                self._welcome.set()
            elif msg.type == protocol.STANDBYS:
                self._connect_standbys(links, poller, msg.body["addresses"])
            elif msg.type == protocol.PREPARE and self._on_prepare is not None:
                try:
                    kind, buffers = memory_spec(msg.body)
                except ValueError as e:
                    logger.warning("ignored a prepare message: %s", e)
                    continue
                self._on_prepare(kind, buffers)
            elif msg.type == protocol.TAKEOVER:
                # Later generations rendezvous through the new coordinator's store.
                self.store_host = links.active.rsplit(":", 1)[0]
                self.store_port = int(msg.body["store_port"])
                self.events.write("coordinator_takeover", coordinator=msg.sender, term=msg.term)
                if self._on_store_moved is not None:
                    self._on_store_moved(self.store_host, self.store_port)
            elif msg.type in (protocol.GENERATION, protocol.SHUTDOWN, protocol.INTERRUPT):
                self.inbox.put((msg.type, msg.body))
                callback = {
                    protocol.GENERATION: self._on_generation,
                    protocol.SHUTDOWN: self._on_shutdown,
                    protocol.INTERRUPT: self._on_interrupt,
                }[msg.type]
                if callback is not None:
                    try:
                        callback(msg.body)
                    except Exception:
                        logger.exception("%s callback failed", msg.type)
