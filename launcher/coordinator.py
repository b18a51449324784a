"""The coordinator: one per job, a ROUTER socket around the membership state machine.

It is not a training rank and holds no training state, so the death of any rank (rank 0
included) never stops it. It hosts the rendezvous ``TCPStore`` for the ranks' process groups
(torchrun-style ``MASTER_ADDR``/``MASTER_PORT`` point at it, with a fresh key prefix per
generation) and runs a single-threaded event loop: every wait is a poll with a timeout, and
every network input goes through :class:`launcher.protocol.Codec` before it can change anything.

Run as ``python -m launcher.coordinator --config FILE`` (its :class:`CoordinatorConfig` as JSON,
written by p2p-run from its flags): it writes ``coordinator.json`` (its address and the store's)
into the run directory once it is listening.

With ``standby_of`` set (p2p-run's ``--standby-of``) it is a *standby*: it mirrors the active
coordinator's membership (:mod:`launcher.mirror`, pushed by the active one whenever it changes
and before any new generation goes out), and when the active one falls silent for
``takeover_timeout_s`` (``--takeover-timeout``) it asks the agents for their votes in the next
*term*. An agent votes only when it has lost the active coordinator too, and once it votes it
obeys no older term (:mod:`launcher.standby`); with the votes of more than half the job's nodes
the standby takes over: it starts its own rendezvous store, tells every process (``takeover``),
restarts a recovery that was in progress, and acts from then on. Every message carries its
sender's term; a coordinator that receives a newer term than its own was replaced and stops
(docs/launcher.md, "No single point of failure").
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from launcher import config, mirror, protocol
from launcher.admission import ConnectionGate, Quota
from launcher.config import setting
from launcher.decisions import (
    Decision,
    End,
    Event,
    Generation,
    Interrupt,
    Kill,
    Process,
    SendGeneration,
    SpawnSpare,
)
from launcher.events import EventLog
from launcher.membership import Membership, MembershipConfig
from launcher.prepare import SpareMemory, memory_spec
from launcher.standby import StandbyLink
from launcher.store import StoreServer

if sys.version_info >= (3, 11):
    from typing import assert_never
else:  # a dependency of torch
    from typing_extensions import assert_never

logger = logging.getLogger(__name__)

COORDINATOR_FILE = "coordinator.json"
#: How often the coordinator tells each agent (and its standbys) it is alive.
AGENT_HEARTBEAT_S = 0.2
_DRAIN_BATCH = 1000
#: The least :meth:`CoordinatorConfig.connection_cap` is (larger jobs get four per rank).
DEFAULT_CONNECTION_CAP = 4096
COORDINATOR_IDENTITY = protocol.COORDINATOR
#: How often a process declared lost that is heard again is told so, and how many are tracked.
_TELL_LOST_EVERY_S = 1.0
_MAX_TOLD_LOST = 4096
#: The most messages kept while the quorum is lost (:meth:`Coordinator._hold`).
_MAX_HELD = 65536
#: How often the active coordinator mirrors a changed membership between generations.
_MIRROR_EVERY_S = 0.5


@dataclass(frozen=True, slots=True, kw_only=True)
class CoordinatorConfig:
    """Where the coordinator listens and how it decides."""

    host: str = "127.0.0.1"
    port: int = 0
    """0 picks a free port (written to coordinator.json)."""
    job_id: str = "p2p-job"
    secret_file: str
    operator_key_file: str | None = None
    """The operator's key (``<run-dir>/operator.key``): only a ``scale`` signed with it is
    taken. Without one, no resize is accepted."""
    run_dir: str
    membership: MembershipConfig
    tick_s: float = 0.05
    """How often deadlines are checked when no message arrives."""
    host_store: bool = True
    env_store: bool = setting(
        False,
        flag="--env-store",
        help="also host torch's TCPStore at MASTER_ADDR:MASTER_PORT, for scripts that call "
        "dist.init_process_group() themselves (unauthenticated: see docs/security.md); "
        "protected scripts never need it",
    )
    """Also host torch's (unauthenticated) ``TCPStore`` at ``MASTER_PORT``, for scripts that
    call ``dist.init_process_group()`` themselves."""
    standby_of: str | None = setting(
        None, flag="--standby-of", help="host:port of the active coordinator"
    )
    """``host:port`` of the active coordinator: this one is its standby."""
    node: str = "0"
    """Where this coordinator runs: a node rank, or ``head`` (a standby's identity is
    ``coordinator/<node>``)."""
    advertise: str | None = None
    """``host`` others reach this coordinator at (default: ``host``)."""
    takeover_timeout_s: float = setting(
        2.0,
        flag="--takeover-timeout",
        help="silence of the active coordinator after which a standby asks the nodes for "
        "their votes to take over, seconds (default {default})",
    )
    """Silence of the active coordinator after which a standby asks for the agents' votes."""
    max_unauthenticated_connections: int | None = None
    """New connections are refused (one rate-limited log line says so) while this many open
    ones have said no accepted hello; processes that did are never counted. ``None``: 4,096,
    or four per rank of the job's largest size if that is more (:meth:`connection_cap`): every
    process of a job starting at once connects before its hello is accepted, and a refused one
    only comes back on its next hello."""
    max_messages_per_s: float = 1000.0
    """Messages a connection may send per second (twice that at once); the rest are dropped
    before their tag is checked."""

    def connection_cap(self) -> int:
        """The cap on open connections that said no accepted hello."""
        if self.max_unauthenticated_connections is not None:
            return self.max_unauthenticated_connections
        elastic = self.membership.elastic
        largest = max(self.membership.world_size, elastic.max_ranks if elastic else 0)
        return max(DEFAULT_CONNECTION_CAP, 4 * largest)

    def __post_init__(self) -> None:
        if self.max_unauthenticated_connections is not None and (
            self.max_unauthenticated_connections < 1
        ):
            raise ValueError(
                "CoordinatorConfig.max_unauthenticated_connections "
                f"{self.max_unauthenticated_connections}: must be at least 1"
            )
        if not self.max_messages_per_s >= 1:
            raise ValueError(
                f"CoordinatorConfig.max_messages_per_s {self.max_messages_per_s}: must be at "
                "least 1"
            )
        node = self.node
        if not (node.isascii() and node.isalnum() and len(node) <= 16):
            raise ValueError(
                f"CoordinatorConfig.node {node!r}: a node rank or a short name such as head"
            )


class Coordinator:
    """Owns membership, generations, the committed step and the rendezvous store."""

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        secret = protocol.read_secret(config.secret_file)
        self._secret = secret
        standby = config.standby_of is not None
        self.identity = f"{COORDINATOR_IDENTITY}/{config.node}" if standby else COORDINATOR_IDENTITY
        self.codec = protocol.Codec(secret, config.job_id, self.identity)
        self._load_operator_key()
        if not standby:
            # This run's nonce: every message must carry it (a standby learns it from the
            # challenge its hello gets, and keeps it when it takes over).
            self.codec.run = os.urandom(protocol.RUN_NONCE_BYTES)
        self.routes: dict[str, bytes] = {}
        """identity -> the routing id its last accepted hello came on: the only connection
        that identity's messages are taken from and replies go to."""
        self.quota = Quota(config.max_messages_per_s, 2 * config.max_messages_per_s)
        self.over_quota = 0
        """Messages dropped because their connection was over its quota."""
        self.membership = Membership(config.membership)
        self.spare_memory = SpareMemory()
        """The ranks' buffer sizes, and what the idle spares were told to allocate."""
        self.events = EventLog(config.run_dir, self.identity)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 500)
        protocol.harden_socket(self.sock)
        # A connection that claims an identity already held takes it over instead of being
        # refused: an unauthenticated socket that connected first as ``agent/1`` cannot keep
        # the real node 1 unserved (docs/security.md).
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.gate = ConnectionGate(self.ctx, config.connection_cap(), lambda: len(self.routes))
        self.gate.install(self.sock)
        logger.debug("open-file limit %d", protocol.raise_descriptor_limit())
        if config.port:
            self.sock.bind(f"tcp://{config.host}:{config.port}")
            self.port = config.port
        else:
            self.port = self.sock.bind_to_random_port(f"tcp://{config.host}")
        self.store: StoreServer | None = None
        self.store_port = 0
        self.env_store = None
        self.env_store_port = 0
        if config.host_store and not standby:
            self.store = StoreServer(secret, config.job_id, config.host).start()
            self.store_port = self.store.port
        if config.env_store:
            from datetime import timedelta

            import torch.distributed as dist

            # torch's own store, for scripts that call dist.init_process_group() themselves:
            # unauthenticated and listening on every interface (docs/security.md).
            # torch re-exports TCPStore from its C module without marking it public.
            self.env_store = dist.TCPStore(  # type: ignore[attr-defined]
                config.host,
                0,
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=60),
            )
            self.env_store_port = self.env_store.port
        self.dropped = 0
        self._told_lost: dict[str, float] = {}
        """identity -> when a process declared lost was last told so (:meth:`_tell_lost`)."""
        self.exit_code: int | None = None
        self._errors_seen: set[tuple[str, str, str]] = set()
        # Takeover: the standbys the active one mirrors to, and a standby's view of the active.
        self.standbys: dict[str, str] = {}
        """identity -> ``host:port`` of each standby that said hello."""
        self._mirrored = b""
        self._mirrored_at = 0.0
        self.clock_offset = 0.0
        """Added to ``time.monotonic()``: a standby keeps the active coordinator's clock, so
        the deadlines in the state it mirrored go on where they were."""
        self._holding = False
        self._held: collections.deque[tuple[protocol.Message, bytes]] = collections.deque()
        """What came in while the quorum was lost, to act on in order once it is back."""
        self._heard: dict[str, float] = {}
        """agent -> when its last message arrived: what the quorum counts. Unlike the
        membership's signs of life, a stall of this coordinator never excuses it."""
        self._echoed: dict[str, int] = {}
        """agent -> the newest of this coordinator's heartbeats it echoed (:func:`_beat`)."""
        self._lost_at = 0
        """When the quorum was last lost, as a heartbeat's ``beat``."""
        self._quorum_grace = 0.0
        """Until then the quorum is not checked (processes reconnecting after a takeover)."""
        self._last_loop: float | None = None
        """When the active coordinator's loop last reached its deadline checks."""
        self.link: StandbyLink | None = None
        """A standby's link to the active coordinator (None once active)."""
        if config.standby_of is not None:
            self.link = StandbyLink(
                self.ctx,
                self.codec,
                self.membership,
                self.events,
                active=config.standby_of,
                takeover_timeout_s=config.takeover_timeout_s,
                send=self._send,
                drop=self._drop,
            )

    @property
    def standby(self) -> bool:
        """Whether this coordinator is a standby that has not taken over."""
        return self.link is not None

    def _load_operator_key(self) -> None:
        path = self.config.operator_key_file
        if path is None or not os.path.exists(path):
            return
        try:
            self.codec.operator_key = protocol.read_secret(path)
        except ValueError as e:
            logger.warning("%s: no resize will be accepted", e)

    @property
    def address(self) -> str:
        """``host:port`` other processes reach this coordinator at."""
        return f"{self.config.advertise or self.config.host}:{self.port}"

    def now(self) -> float:
        """The job's control-plane clock (the first coordinator's ``time.monotonic()``)."""
        return time.monotonic() + self.clock_offset

    def publish_address(self) -> None:
        """Write coordinator.json atomically so agents and tests can find this job."""
        path = Path(self.config.run_dir) / COORDINATOR_FILE
        tmp = path.with_suffix(".tmp")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            doc = {
                "host": self.config.host,
                "port": self.port,
                "store_port": self.store_port,
                "job_id": self.config.job_id,
                "pid": os.getpid(),
            }
            f.write(json.dumps(doc))
        os.replace(tmp, path)
        self.events.write("coordinator_started", port=self.port, store_port=self.store_port)

    def publish_standby(self) -> None:
        """A standby writes ``coordinator-<node>.json`` (its pid and address) for tools."""
        path = Path(self.config.run_dir) / f"coordinator-{self.config.node}.json"
        tmp = path.with_suffix(".tmp")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps({"address": self.address, "pid": os.getpid()}))
        os.replace(tmp, path)
        self.events.write("standby_started", address=self.address, of=self.config.standby_of)

    # -- the loop ------------------------------------------------------------------------------

    def serve(self, stop_after_s: float | None = None) -> int:
        """Run until the job ends (returns its exit code) or ``stop_after_s`` passes."""
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        if self.link is not None:
            poller.register(self.link.socket, zmq.POLLIN)
        deadline = None if stop_after_s is None else time.monotonic() + stop_after_s
        next_agent_beat = 0.0
        self._last_loop = None
        while self.exit_code is None:
            if deadline is not None and time.monotonic() > deadline:
                break
            ready = dict(poller.poll(int(self.config.tick_s * 1000)))
            if self.link is not None and self.link.socket in ready:
                self._receive_upstream(self.link)
            if self.sock in ready:
                # Drain what is queued, but at most a bounded batch: deadlines are checked
                # between batches even under a flood of messages.
                for _ in range(_DRAIN_BATCH):
                    if self.exit_code is not None:
                        break
                    try:
                        frames = self.sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.handle_frames(frames)
            if self.exit_code is not None:
                break  # fenced, or the job ended: no deadline is checked, nothing more decided
            if self.link is not None:
                self._standby_tick(self.link)
                continue
            now = self.now()
            self._excuse_own_stall(now)
            if now >= next_agent_beat:
                # Agents watch for this: a node whose coordinator is gone cleans up and exits.
                agents = [i for i, p in self.membership.procs.items() if p.role == "agent"]
                beat = {"beat": _beat(now)}  # echoed back: proof of a round trip (_in_quorum)
                self._send_to_all([*agents, *self.standbys], protocol.HEARTBEAT, beat)
                next_agent_beat = now + AGENT_HEARTBEAT_S
            try:
                if self._in_quorum(now):
                    self._release_held(now)
                    self._apply(self.membership.tick(now))
                self._mirror()
            except Exception as e:  # the coordinator must outlive its own bugs: log, go on
                self._internal_error("tick", e)
        return self.exit_code if self.exit_code is not None else 0

    def _excuse_own_stall(self, now: float) -> None:
        """A loop that did not get round for half a heartbeat timeout (this process or its
        host stalled) heard nobody meanwhile, through no fault of theirs: every member counts
        as heard now, as after a takeover, instead of being declared lost for the
        coordinator's own pause (a node so declared could never come back)."""
        last, self._last_loop = self._last_loop, now
        if last is None or now - last <= self.config.membership.heartbeat_timeout_s / 2:
            return
        for identity in self.membership.procs:
            self.membership.heartbeat(identity, now)
        self.events.write("stalled", seconds=round(now - last, 3))
        logger.warning(
            "this coordinator did not run for %.1fs: no member is blamed for the silence",
            now - last,
        )

    def _in_quorum(self, now: float) -> bool:
        """Whether this coordinator hears at least half the job's nodes (so it may decide).

        A coordinator cut off from most nodes cannot tell a partition from their loss; a
        standby on the other side may take over with their votes (more than half), so this
        side holds its decisions rather than shrink the job into a second one. What the
        nodes it hears report meanwhile (an exit, an error, an acknowledgement) is kept and
        acted on once the quorum is back (:meth:`_hold`); a coordinator fenced meanwhile by
        the standby that took over never acts on it.
        """
        agents = [i for i, p in self.membership.procs.items() if p.role == "agent"]
        recent = self.config.membership.heartbeat_timeout_s / 2
        # What each agent really sent: a stall of this coordinator excuses every member from
        # being declared lost (_excuse_own_stall), and must not also make a coordinator cut
        # off from most nodes believe it hears them. A node mirrored from the coordinator this
        # one took over from counts by its membership record until it is heard here.
        last = {a: self._heard.get(a, self.membership.last_seen.get(a, now)) for a in agents}
        # Once the quorum is lost, a node counts again only when it answered a heartbeat sent
        # since: what a healed link delivers first is what the node queued before, some of it
        # sent before it voted for a standby; its answers come after, in the standby's term.
        heard = sum(
            1
            for a in agents
            if now - last[a] <= recent
            and (not self._holding or self._echoed.get(a, -1) > self._lost_at)
        )
        holding = len(agents) >= 2 and 2 * heard < len(agents) and now >= self._quorum_grace

        if holding != self._holding:
            self._holding = holding
            if holding:
                self._lost_at = _beat(now)
            self.events.write(
                "quorum_lost" if holding else "quorum_regained", heard=heard, nodes=len(agents)
            )
            if holding:
                logger.warning(
                    "in contact with %d of %d nodes: holding every decision", heard, len(agents)
                )
        return not holding

    def _hold(self, msg: protocol.Message, routing: bytes) -> None:
        """Keep a message that may lead to a decision (a rank's exit or error on this side of
        a partition, an acknowledgement, a hello) until the quorum is back: acted on now, it
        would start a generation beside the one the other side's coordinator starts."""
        if len(self._held) >= _MAX_HELD:
            self._drop(
                f"{msg.type} from {msg.sender}: {_MAX_HELD} messages are already held "
                "while this coordinator hears under half the nodes"
            )
            return
        self._held.append((msg, routing))

    def _release_held(self, now: float) -> None:
        """Act, in their order, on the messages held while the quorum was lost."""
        while self._held and self.exit_code is None and not self._holding:
            msg, routing = self._held.popleft()
            self._dispatch_guarded(msg, routing, now)

    # -- takeover ------------------------------------------------------------------------------

    def _standby_hello(self) -> dict[str, Any]:
        return {
            "role": "standby",
            "node": int(self.config.node) if self.config.node.isdigit() else -1,
            "pid": os.getpid(),
            "address": self.address,
        }

    def _mirror(self, force: bool = False) -> None:
        """Push the membership to every standby when it changed: at once when ``force`` (a
        generation is about to go out), else at most every ``_MIRROR_EVERY_S``.

        What changes between generations (replication reports, acknowledgements, exits) is
        sent again by its senders to a coordinator that takes over, so the standby may lag
        by that much; a 2,048-rank state takes tens of milliseconds to write.
        """
        if not self.standbys:
            return
        now = self.now()
        if not force and now - self._mirrored_at < _MIRROR_EVERY_S:
            return
        state = mirror.dump(self.membership)
        self._mirrored_at = now
        if state == self._mirrored and not force:
            return  # unchanged: the heartbeats tell the standbys this coordinator lives
        self._mirrored = state
        routes = {identity: routing.decode() for identity, routing in self.routes.items()}
        for identity in self.standbys:
            self._send(identity, protocol.STATE, {"state": state, "now": now, "routes": routes})

    def _receive_upstream(self, link: StandbyLink) -> None:
        """A standby takes what the active coordinator sent: its state and clock, or the end."""
        mirrored, shutdown = link.receive()
        if mirrored is not None:
            self.routes = mirrored.routes
            self.clock_offset = mirrored.now - time.monotonic()
        if shutdown is not None:
            self.events.write("standby_shutdown", **shutdown)
            self.exit_code = 0

    def _standby_tick(self, link: StandbyLink) -> None:
        """A standby's turn of the loop: hello, election, and the takeover once it won."""
        if link.tick(self._standby_hello()):
            self._take_over(link)

    def _take_over(self, link: StandbyLink) -> None:
        """Become the active coordinator with the mirrored state."""
        link.close()
        self.link = None
        if self.config.host_store:
            self.store = StoreServer(self._secret, self.config.job_id, self.config.host).start()
            self.store_port = self.store.port
        if self.codec.operator_key is None:
            self._load_operator_key()
        now = self.now()
        # Every live process answers the takeover at once (its link sends a heartbeat): one
        # that has not within half the heartbeat timeout is lost, so a node lost with the old
        # coordinator is found about as fast as one lost on its own.
        timeout = self.config.membership.heartbeat_timeout_s
        seen = now - timeout / 2
        for identity in self.membership.procs:
            self.membership.heartbeat(identity, seen)
        self._quorum_grace = now + timeout / 2
        self.events.write(
            "takeover",
            term=self.codec.term,
            votes=sorted(link.votes),
            generation=self.membership.generation,
        )
        logger.warning("took over as the active coordinator (term %d)", self.codec.term)
        for identity in list(self.membership.procs):
            self._send(identity, protocol.TAKEOVER, {"store_port": self.store_port})
        self._apply(self.membership.took_over(now))

    def _internal_error(self, where: str, e: Exception) -> None:
        key = (where, type(e).__name__, str(e))
        if key not in self._errors_seen:
            self._errors_seen.add(key)
            logger.exception("internal error in %s (the coordinator goes on)", where)
            self.events.write("coordinator_error", where=where, error=repr(e))

    def handle_frames(self, frames: list[bytes]) -> None:
        """Authenticate, decode and act on one message; drop anything invalid with a reason."""
        now = self.now()
        if frames and not self.quota.allow(frames[0], time.monotonic()):
            self.over_quota += 1
            self._drop(
                f"connection {frames[0][:80]!r} is over its quota of "
                f"{self.config.max_messages_per_s:.0f} messages/s "
                "(CoordinatorConfig.max_messages_per_s)"
            )
            return
        try:
            if len(frames) < 1:
                raise protocol.Rejected("empty message")
            routing = frames[0].decode("utf-8", errors="replace")
            msg = self.codec.decode(frames[1:], routing_id=routing)
        except protocol.WrongRun as e:
            if e.run:
                self._drop(e.reason)  # a frame of another run: dropped, and logged
            # else a process's first hello or scale (it has not learned the nonce yet), or what
            # it sent before its welcome: the challenge teaches it, nothing to log.
            if e.type in (protocol.HELLO, protocol.SCALE):
                self._challenge(frames[0], e.operator)
            return
        except protocol.Rejected as e:
            self._drop(e.reason)
            return
        except Exception as e:  # no frame of any shape may end the coordinator
            self._internal_error("decode", e)
            return
        self._dispatch_guarded(msg, frames[0], now)

    def _dispatch_guarded(self, msg: protocol.Message, routing: bytes, now: float) -> None:
        try:
            self._dispatch(msg, routing, now)
        except Unbound as e:
            self._drop(str(e))
            self._challenge(routing, False)
        except (KeyError, TypeError, ValueError) as e:
            self._drop(f"malformed {msg.type} from {msg.sender}: {e!r}")
        except Exception as e:
            self._internal_error(msg.type, e)

    def _drop(self, reason: str) -> None:
        self.dropped += 1
        # Rate-limited, in the log and in the event log alike: a flood cannot fill the disk.
        if self.codec.drops.drop(reason):
            self.events.write("message_dropped", reason=reason)

    def _challenge(self, routing: bytes, operator: bool) -> None:
        """Ask the process on connection ``routing`` to say hello (again) with this run's
        nonce: the answer to a hello or scale of the wrong run, or to a message on a
        connection its sender has not authenticated."""
        if not self.codec.run:
            return  # a standby that has not learned the run yet: nothing to tell
        key = self.codec.operator_key if operator else None
        frames = self.codec.encode(protocol.CHALLENGE, {}, key=key)
        try:
            self.sock.send_multipart([routing, *frames], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            logger.debug("could not send a challenge: %s", e)

    def _check_route(self, msg: protocol.Message, routing: bytes) -> None:
        """A message counts only from the connection its sender's accepted hello came on."""
        if self.routes.get(msg.sender) != routing:
            raise Unbound(f"{msg.type} from {msg.sender} on a connection it has not said hello on")

    def _dispatch(self, msg: protocol.Message, routing: bytes, now: float) -> None:
        body = msg.body
        if self.link is not None:
            # Before a takeover a standby acts on nothing but the answers to its (pre-)votes,
            # whatever their term: one of a newer term says which standby won it.
            if msg.type != protocol.VOTED or not msg.sender.startswith("agent/"):
                raise ValueError(f"a standby takes no {msg.type} (from {msg.sender})")
            self._check_route(msg, routing)
            self.link.voted(msg, self.address)
            return
        if msg.term > self.codec.term:
            self._fenced(msg)
            return
        if msg.type == protocol.VOTED:
            return  # an answer that came after this coordinator had won its election
        if msg.type == protocol.HELLO and body.get("role") == "standby":
            self._standby_joined(msg, routing)
            return
        if msg.type == protocol.SCALE:
            # Only the operator key resizes (the job's secret alone does not); the schema
            # already made ``size`` an integer (not a bool).
            if not msg.operator:
                raise ValueError(
                    f"{msg.sender} may not resize the job: a scale must be signed with the "
                    "operator key (p2p-run scale reads <run-dir>/operator.key)"
                )
        elif msg.sender.startswith("operator/"):
            raise ValueError(f"an operator may only send scale, not {msg.type}")
        elif msg.type != protocol.HELLO and msg.sender not in self.membership.procs:
            if msg.sender in self.membership.gone:
                self._check_route(msg, routing)
                self._tell_lost(msg.sender)
                return
            raise ValueError(f"{msg.sender} sent {msg.type} before its hello")
        elif msg.type != protocol.HELLO:
            self._check_route(msg, routing)
        self.membership.heartbeat(msg.sender, now)
        if msg.sender.startswith("agent/"):
            self._heard[msg.sender] = now
            if msg.type == protocol.HEARTBEAT and "beat" in body:
                self._echoed[msg.sender] = int(body["beat"])
        if self._holding and msg.type != protocol.HEARTBEAT:
            self._hold(msg, routing)
            return
        if msg.type == protocol.HELLO:
            proc = Process(msg.sender, str(body["role"]), int(body["node"]), int(body["pid"]))
            if proc.role not in ("rank", "spare", "agent"):
                raise ValueError(f"unknown role {proc.role!r}")
            # A fresh, signed hello of this run binds the identity to its connection.
            self.routes[msg.sender] = routing
            if self.membership.procs.get(msg.sender) == proc:
                # The same process again (its first hello went unanswered): welcome it again.
                self._send(msg.sender, protocol.WELCOME, self._welcome_body())
                return
            rank = body.get("rank")
            world = self.config.membership.world_size
            if proc.role == "agent" and int(body.get("world_size", world)) != world:
                reason = (
                    f"node {proc.node} was started for a world of {body.get('world_size')} "
                    f"ranks but the job has {world} (--nnodes x --nproc-per-node must match "
                    "on every node)"
                )
                self.events.write("node_refused", node=proc.node, reason=reason)
                self._send(msg.sender, protocol.SHUTDOWN, {"code": 2, "reason": reason})
                return
            self._send(msg.sender, protocol.WELCOME, self._welcome_body())
            self.events.write("hello", identity=msg.sender, role=proc.role, node=proc.node)
            told = self.spare_memory.told
            if told is not None and proc.role == "spare":
                # Before the hello's decisions: a vacancy waiting for a spare gives it a rank
                # at once, and its buffers should be on their way first.
                self._send(msg.sender, protocol.PREPARE, {"kind": told[0], "buffers": told[1]})
            self._apply(self.membership.hello(proc, None if rank is None else int(rank), now))
        elif msg.type == protocol.HEARTBEAT:
            pass
        elif msg.type == protocol.CHILDREN:
            self._children_after_takeover(msg.sender, body["identities"])
        elif msg.type == protocol.DONE:
            step = body.get("checkpoint_step")
            self._apply(
                self.membership.report_done(msg.sender, None if step is None else int(step))
            )
        elif msg.type == protocol.REPLICATED:
            generation = body.get("generation")
            self._apply(
                self.membership.report_replicated(
                    msg.sender, int(body["step"]), None if generation is None else int(generation)
                )
            )
        elif msg.type == protocol.MEMORY:
            kind, buffers = memory_spec(body)
            if self.membership.rank_of(msg.sender) is None:
                raise ValueError(f"{msg.sender} holds no rank and has no buffers to report")
            self.spare_memory.report(msg.sender, int(body["generation"]), kind, buffers)
            self._prepare_spares()
        elif msg.type == protocol.SCALE:
            size = int(body["size"])
            if not 1 <= size <= 1_000_000:
                raise ValueError(f"world size {size} out of range")
            self.events.write("scale_request", sender=msg.sender, size=size)
            self._apply(self.membership.request_size(size, now))
        elif msg.type == protocol.ERROR:
            failed = self.membership.procs.get(msg.sender)
            reason = str(body.get("reason"))
            self.events.write(
                "rank_error", identity=msg.sender, reason=reason, fatal=bool(body.get("fatal"))
            )
            if body.get("fatal"):
                # The rank cannot be replaced into a working job (e.g. no copy of some state
                # survives and there is no checkpoint): end the job with its reason.
                self._apply(self.membership.end(1, f"{msg.sender}: {reason}"))
                return
            if failed is not None:
                self._apply([Kill(failed.node, msg.sender, failed.pid, "reported an error")])
            self._apply(self.membership.fault(msg.sender, f"reported: {body.get('reason')}", now))
        elif msg.type == protocol.ACK:
            self._apply(self.membership.ack(msg.sender, int(body["generation"]), now))
        elif msg.type == protocol.ARRIVED:
            self._apply(self.membership.arrive(msg.sender, int(body["generation"])))
        elif msg.type == protocol.EXITED:
            identity = str(body["identity"])
            self._check_reporter(msg.sender, identity)
            self.events.write("process_exited", identity=identity, code=int(body["code"]))
            self.codec.forget(identity)
            self.routes.pop(identity, None)
            rank = body.get("rank")
            error = str(body.get("error", ""))[: protocol.MAX_ERROR_CHARS]
            self._apply(
                self.membership.exited(
                    identity, int(body["code"]), now, None if rank is None else int(rank), error
                )
            )
        else:
            raise ValueError(f"{msg.type} is not a message the coordinator accepts")

    def _tell_lost(self, identity: str) -> None:
        """A process this coordinator declared lost is heard again (a partition healed, a
        pause ended): the job went on without it, and it is told so, at most once a second,
        rather than left to wait for ``--coordinator-timeout``."""
        now = time.monotonic()
        if now - self._told_lost.get(identity, -1.0) < _TELL_LOST_EVERY_S:
            return
        if len(self._told_lost) >= _MAX_TOLD_LOST:
            self._told_lost.clear()
        self._told_lost[identity] = now
        reason = f"{identity} was declared lost; the job went on without it"
        self.events.write("lost_process_heard", identity=identity)
        self._send(identity, protocol.SHUTDOWN, {"code": 0, "reason": reason})

    def _prepare_spares(self) -> None:
        """Once every rank of the generation reported its buffers, tell the idle spares what
        to allocate if that changed (:mod:`launcher.prepare`)."""
        spec = self.spare_memory.changed(
            list(self.membership.ranks.values()), self.membership.generation
        )
        if spec is None:
            return
        kind, buffers = spec
        self.events.write(
            "spares_prepared", kind=kind, nbytes=sum(buffers), spares=list(self.membership.spares)
        )
        self._send_to_all(
            list(self.membership.spares), protocol.PREPARE, {"kind": kind, "buffers": buffers}
        )

    def _welcome_body(self) -> dict[str, Any]:
        return {
            "store_port": self.store_port,
            "env_store_port": self.env_store_port,
            "generation": self.membership.generation,
            "standbys": sorted(self.standbys.values()),
        }

    def _fenced(self, msg: protocol.Message) -> None:
        """A process obeys a newer term: another coordinator took over; this one stops."""
        reason = (
            f"{msg.sender} obeys term {msg.term}, newer than this coordinator's {self.codec.term}"
        )
        self.events.write("fenced", reason=reason)
        logger.warning("replaced by a newer coordinator (%s): stopping", reason)
        self.exit_code = 0

    def _standby_joined(self, msg: protocol.Message, routing: bytes) -> None:
        """A standby coordinator said hello: mirror to it, and tell everyone where it is."""
        identity, address = msg.sender, str(msg.body.get("address", ""))
        host, _, port = address.rpartition(":")
        if not protocol.is_coordinator(identity) or not host or not port.isdigit():
            raise ValueError(f"{identity} is not a standby coordinator at host:port ({address!r})")
        if len(self.standbys) >= 8 and identity not in self.standbys:
            raise ValueError(f"{identity}: a job has at most 8 standby coordinators")
        self.routes[identity] = routing
        if self.standbys.get(identity) == address:
            self._mirror(force=True)  # its hello again (sent until answered): answer it
            return
        self.standbys[identity] = address
        self.events.write("standby_joined", identity=identity, address=address)
        addresses = sorted(self.standbys.values())
        for other in list(self.membership.procs):
            self._send(other, protocol.STANDBYS, {"addresses": addresses})
        self._mirror(force=True)

    def _children_after_takeover(self, sender: str, identities: list[object]) -> None:
        """An agent names its processes (their routing ids) after a takeover: those this
        coordinator does not know (they said hello after the last mirror) are told of it too,
        and say hello again."""
        agent = self.membership.procs.get(sender)
        if agent is None or agent.role != "agent":
            raise ValueError(f"{sender} is not an agent and may not name processes")
        for routing in identities[:256]:
            if not isinstance(routing, str) or len(routing) > 2 * protocol.MAX_IDENTITY_CHARS:
                continue
            identity = protocol.identity_of(routing)
            if identity not in self.membership.procs and identity.split("/")[1:2] == [
                str(agent.node)
            ]:
                frames = self.codec.encode(protocol.TAKEOVER, {"store_port": self.store_port})
                with contextlib.suppress(zmq.ZMQError):
                    self.sock.send_multipart([routing.encode(), *frames], zmq.NOBLOCK)

    def _check_reporter(self, sender: str, identity: str) -> None:
        """Only an agent reports an exit, and only of a process of its own node."""
        agent = self.membership.procs.get(sender)
        if agent is None or agent.role != "agent":
            raise ValueError(f"{sender} is not an agent and may not report exits")
        proc = self.membership.procs.get(identity)
        node = proc.node if proc is not None else identity.split("/")[1:2]
        if node not in (agent.node, [str(agent.node)]):
            raise ValueError(f"the agent of node {agent.node} reported {identity} of another node")

    def _apply(self, actions: list[Decision]) -> None:
        for action in actions:
            if isinstance(action, Event):
                self.events.write(action.name, **action.fields)
                if action.name == "slow_formation":
                    f = action.fields
                    logger.warning(
                        "generation %d took %.1fs to form, more than a quarter of --ack-timeout "
                        "(%.0fs): a recovery at this size may miss its deadline and have healthy "
                        "members replaced; use --ack-timeout %d or more",
                        f["generation"],
                        f["formed_s"],
                        f["ack_timeout_s"],
                        f["advised_ack_timeout_s"],
                    )
            elif isinstance(action, SendGeneration):
                self._mirror(force=True)  # the standbys know a generation before any member
                self._broadcast(action.generation, action.to)
            elif isinstance(action, Kill):
                self.events.write(
                    "kill_requested",
                    identity=action.identity,
                    pid=action.pid,
                    reason=action.reason,
                )
                self._send(
                    f"agent/{action.node}",
                    protocol.KILL,
                    {"identity": action.identity, "pid": action.pid, "reason": action.reason},
                )
            elif isinstance(action, Interrupt):
                self.events.write(
                    "interrupt_sent", generation=action.generation, lost=list(action.lost)
                )
                body = {
                    "generation": action.generation,
                    "lost": list(action.lost),
                    "wait_s": action.wait_s,
                }
                for identity in action.to:
                    self._send(identity, protocol.INTERRUPT, body, action.generation)
            elif isinstance(action, SpawnSpare):
                self.events.write("spare_requested", node=action.node)
                self._send(f"agent/{action.node}", protocol.SPAWN_SPARE, {})
            elif isinstance(action, End):
                for identity in [*self.membership.procs, *self.standbys]:
                    self._send(
                        identity, protocol.SHUTDOWN, {"code": action.code, "reason": action.reason}
                    )
                self.exit_code = action.code
            else:
                assert_never(action)

    def _broadcast(self, gen: Generation, to: tuple[str, ...]) -> None:
        """One generation to all its members, each payload encoded and signed once.

        Every receiver sees the coordinator's sequence numbers increase, so sharing one
        encoding between receivers keeps the replay guard intact.
        """
        newcomers = {new for _, new in gen.replaced.values()}
        first = gen.generation == 1
        frames_full = self.codec.encode(protocol.GENERATION, gen.to_body(full=True), gen.generation)
        frames_delta = (
            frames_full
            if first
            else self.codec.encode(protocol.GENERATION, gen.to_body(full=False), gen.generation)
        )
        for identity in to:
            frames = frames_full if first or identity in newcomers else frames_delta
            routing = self.routes.get(identity)
            if routing is None:
                logger.warning("generation %d: %s never said hello here", gen.generation, identity)
                continue
            try:
                self.sock.send_multipart([routing, *frames], zmq.NOBLOCK)
            except zmq.ZMQError as e:
                logger.warning(
                    "could not send generation %d to %s: %s", gen.generation, identity, e
                )

    def _send_to_all(self, identities: list[str], type_: str, body: dict[str, Any]) -> None:
        """One message to many, encoded and signed once (as :meth:`_broadcast`): 2,048 agents'
        heartbeats five times a second must not cost 10,000 signatures a second."""
        frames = self.codec.encode(type_, body, self.membership.generation)
        for identity in identities:
            routing = self.routes.get(identity)
            if routing is None:
                continue
            try:
                self.sock.send_multipart([routing, *frames], zmq.NOBLOCK)
            except zmq.ZMQError as e:
                logger.warning("could not send %s to %s: %s", type_, identity, e)

    def _send(self, identity: str, type_: str, body: dict[str, Any], generation: int = 0) -> None:
        """Send to ``identity`` on the connection its accepted hello came on (none: dropped)."""
        routing = self.routes.get(identity)
        if routing is None:
            logger.debug("%s not sent: %s never said hello here", type_, identity)
            return
        frames = self.codec.encode(type_, body, generation or self.membership.generation)
        try:
            self.sock.send_multipart([routing, *frames], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            logger.warning("could not send %s to %s: %s", type_, identity, e)

    def close(self) -> None:
        """Close the sockets (bounded linger), the store and the event log."""
        self.gate.close()
        self.sock.close(linger=500)
        if self.link is not None:  # a standby that never took over
            self.link.close()
            self.link = None
        self.ctx.term()
        self.events.close()
        if self.store is not None:
            self.store.close()
            self.store = None
        self.env_store = None


def _beat(now: float) -> int:
    """A heartbeat's ``beat``: the coordinator's clock in ms, which a standby that takes over
    carries on (``clock_offset``), so a node's echo says when what it answered was sent."""
    return int(now * 1000)


class Unbound(ValueError):
    """A valid message on a connection its sender has not said hello on: challenged."""


def config_file(run_dir: str | Path, node: str) -> Path:
    """Where p2p-run writes the configuration of the coordinator it starts on ``node``."""
    return Path(run_dir) / f"coordinator-{node}.config.json"


def run(config: CoordinatorConfig) -> int:
    """Run a coordinator (or a standby) in this process until the job ends; its exit code."""
    logging.basicConfig(level=logging.WARNING, format="coordinator: %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    coordinator = Coordinator(config)
    try:
        if coordinator.standby:
            coordinator.publish_standby()
        else:
            coordinator.publish_address()
        return coordinator.serve()
    except KeyboardInterrupt:
        return 130
    finally:
        coordinator.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m launcher.coordinator --config FILE``: the coordinator process of a job.

    ``FILE`` holds its :class:`CoordinatorConfig` as JSON (:func:`launcher.config.dump`; p2p-run
    writes it into the run directory, mode 0600, from its own flags).
    """
    p = argparse.ArgumentParser(prog="p2p-coordinator", description=main.__doc__)
    p.add_argument(
        "--config", required=True, help="the coordinator's configuration (JSON, see above)"
    )
    args = p.parse_args(argv)
    try:
        coordinator_config = config.load(CoordinatorConfig, Path(args.config).read_text())
    except (OSError, ValueError) as e:
        p.error(f"--config {args.config}: {e}")
    return run(coordinator_config)


if __name__ == "__main__":
    sys.exit(main())
