"""A standby coordinator's side of a takeover: its link to the active coordinator, the state it
mirrors from it, and the election it runs when the active one falls silent.

The standby says hello to the active coordinator until it is answered, then loads every state
the active one pushes (:mod:`launcher.mirror`) into its own :class:`Membership`. When nothing has
come for ``takeover_timeout_s`` it asks the job's agents whether they would vote for it in the
next *term* (a pre-vote, which changes no term: Raft's PreVote), and with more than half of them
saying yes it asks for their votes in that term. An agent votes only when it has lost the active
coordinator too and the standby mirrored the newest generation it heard of; once it votes it
obeys no older term. With the votes of more than half the nodes the standby has won
(:meth:`StandbyLink.tick` says so, and the coordinator takes over); a round that wins no
majority in time goes again after a random pause, as in Raft.

The pre-vote is what keeps a partition from splitting the job: a standby cut off with a minority
of nodes never gets a majority of pre-votes, so it never raises the term of the nodes on its
side, which would make them refuse the coordinator that still runs the job once the partition
heals. An agent that refuses its vote because another standby already won says where that one
is, and this standby then follows it instead (:meth:`StandbyLink.voted`).
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from launcher import mirror, protocol
from launcher.events import EventLog
from launcher.membership import Membership

logger = logging.getLogger(__name__)

#: How often a standby that lost the active coordinator asks the agents again for their vote.
VOTE_RETRY_S = 0.2
#: A standby's unanswered hellos after which it connects to the active coordinator afresh.
RECONNECT_EVERY = 10


@dataclass(frozen=True, slots=True)
class Mirrored:
    """A state the active coordinator pushed, loaded into the standby's membership."""

    routes: dict[str, bytes]
    """identity -> routing id of each process's accepted hello, as the active one has them."""
    now: float
    """The active coordinator's clock when it sent the state."""


class StandbyLink:
    """The standby's connection to the active coordinator and its election.

    Args:
        ctx: The coordinator's ZeroMQ context.
        codec: The coordinator's codec (its ``term`` is the standby's term).
        membership: Where mirrored states are loaded.
        events: The coordinator's event log.
        active: ``host:port`` of the active coordinator.
        takeover_timeout_s: The active one's silence after which an election starts.
        send: Sends a message to an identity over the coordinator's own socket (the votes).
        drop: Drops a message with a reason, as the coordinator drops any invalid one.
    """

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        codec: protocol.Codec,
        membership: Membership,
        events: EventLog,
        *,
        active: str,
        takeover_timeout_s: float,
        send: Callable[[str, str, dict[str, Any]], None],
        drop: Callable[[str], None],
    ) -> None:
        self.codec = codec
        self.membership = membership
        self.events = events
        self.takeover_timeout_s = takeover_timeout_s
        self._send = send
        self._drop = drop
        self.socket: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, protocol.routing_id(codec.sender).encode())
        self.socket.setsockopt(zmq.LINGER, 0)
        protocol.harden_socket(self.socket)
        self.socket.setsockopt(zmq.IMMEDIATE, 1)  # only a live coordinator gets sends
        self.socket.connect(f"tcp://{active}")
        self.active = active
        """``host:port`` of the coordinator this standby mirrors."""
        self.heard_active = time.monotonic()
        self.has_state = False
        """Whether a state was mirrored: without one there is nothing to take over with."""
        self.mirrored_term = 0
        self.votes: set[str] = set()
        self.pre_votes: set[str] = set()
        self.electing = False
        """Whether an election is on (its pre-vote won); else a pre-vote is, once silent."""
        self.votes_asked_at = 0.0
        self._next_vote = 0.0
        self._heard = False
        self._next_hello = 0.0
        self._hellos_unanswered = 0

    def receive(self) -> tuple[Mirrored | None, dict[str, Any] | None]:
        """Read what the active coordinator sent: the newest state loaded (if any came), and
        the body of a shutdown (if it ended the job)."""
        loaded = None
        for msg in self.codec.drain(self.socket, expect_sender=protocol.COORDINATOR):
            if msg.term < self.codec.term:
                continue  # the coordinator this standby is replacing: too late
            self.heard_active = time.monotonic()
            self._heard = True
            self._stand_down()
            if msg.type == protocol.STATE:
                try:
                    routes = _routes(msg.body.get("routes", {}))
                    mirror.load(self.membership, msg.body["state"], float(msg.body["now"]))
                except ValueError as e:
                    self._drop(f"state from {msg.sender}: {e}")
                    continue
                loaded = Mirrored(routes, float(msg.body["now"]))
                self.has_state = True
                self.mirrored_term = msg.term
            elif msg.type == protocol.SHUTDOWN:
                return loaded, msg.body
        return loaded, None

    def tick(self, hello: dict[str, Any]) -> bool:
        """Say ``hello`` until the active coordinator answers; once it has been silent too long,
        ask the agents for their votes. True when more than half the nodes voted for this one."""
        if not self._heard and time.monotonic() >= self._next_hello:
            # Sent only over a completed connection (ZMQ_IMMEDIATE): again until answered, on
            # a fresh connection now and then (one the active coordinator refused, over its
            # cap of unauthenticated connections, is never retried by ZeroMQ itself).
            self._hellos_unanswered += 1
            if self._hellos_unanswered % RECONNECT_EVERY == 0:
                with contextlib.suppress(zmq.ZMQError):
                    self.socket.disconnect(f"tcp://{self.active}")
                self.socket.connect(f"tcp://{self.active}")
            with contextlib.suppress(zmq.Again):
                self.socket.send_multipart(self.codec.encode(protocol.HELLO, hello), zmq.NOBLOCK)
            self._next_hello = time.monotonic() + VOTE_RETRY_S
        silent = time.monotonic() - self.heard_active
        if silent <= self.takeover_timeout_s or not self.has_state:
            return False
        agents = sorted(i for i, p in self.membership.procs.items() if p.role == "agent")
        now = time.monotonic()
        if not self.votes_asked_at or now - self.votes_asked_at > self.takeover_timeout_s:
            # A pre-vote, first or again: the last round won no majority in time (nodes still
            # hear the active one, or two standbys split them), so after a random pause, as in
            # Raft, it asks again whether they would vote for the next term.
            if self.votes_asked_at:
                self._next_vote = now + random.uniform(0, self.takeover_timeout_s / 2)
            self.electing = False
            self.pre_votes.clear()
            self.votes.clear()
            self.votes_asked_at = now
            self.events.write("pre_vote", term=self.codec.term + 1, silent_s=round(silent, 3))
        majority = len(agents) // 2 + 1
        if not self.electing and len(self.pre_votes & set(agents)) >= majority:
            self.electing = True
            self.codec.term = max(self.codec.term, self.mirrored_term) + 1
            self.votes_asked_at = now
            self._next_vote = now
            self.events.write("election", term=self.codec.term, silent_s=round(silent, 3))
            logger.warning(
                "the active coordinator has been silent for %.1fs: asking %d nodes for term %d",
                silent,
                len(agents),
                self.codec.term,
            )
        if time.monotonic() >= self._next_vote:
            answered = self.votes if self.electing else self.pre_votes
            body = {
                "silence_s": self.takeover_timeout_s,
                "generation": self.membership.generation,
                "pre": not self.electing,
            }
            for identity in agents:
                if identity not in answered:
                    self._send(identity, protocol.VOTE, body)
            self._next_vote = time.monotonic() + VOTE_RETRY_S
        return self.electing and bool(agents) and len(self.votes & set(agents)) >= majority

    def voted(self, msg: protocol.Message, own_address: str) -> None:
        """An agent's answer (``voted``, its sender and route checked) to a (pre-)vote request."""
        granted = msg.body["granted"]
        if granted and msg.body.get("pre"):
            # Its term is the agent's own, at most this standby's (else it would not say yes).
            if not self.electing and msg.term <= self.codec.term:
                self.pre_votes.add(msg.sender)
        elif granted:
            if self.electing and msg.term == self.codec.term:
                self.votes.add(msg.sender)
                self.events.write("vote", identity=msg.sender, term=msg.term)
        elif msg.body.get("active", self.active) not in (self.active, own_address):
            self.follow(str(msg.body["active"]), msg.term)

    def follow(self, address: str, term: int) -> None:
        """Another standby took over (an agent refusing a vote says where): mirror that one."""
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            return
        with contextlib.suppress(zmq.ZMQError):  # not connected there any more
            self.socket.disconnect(f"tcp://{self.active}")
        self.socket.connect(f"tcp://{address}")
        self.events.write("standby_follows", coordinator=address, term=term)
        logger.warning("coordinator %s took over (term %d): standing by for it", address, term)
        self.active = address
        self.codec.term = self.mirrored_term = term
        self.heard_active = time.monotonic()
        self._stand_down()
        self._heard = False  # the hello goes out (again) from the next tick

    def _stand_down(self) -> None:
        """No (pre-)election: an active coordinator is heard, or followed."""
        self.electing = False
        self.votes.clear()
        self.pre_votes.clear()
        self.votes_asked_at = 0.0

    def close(self) -> None:
        """Close the link (a standby that takes over, or ends)."""
        self.socket.close(linger=0)


def _routes(doc: Any) -> dict[str, bytes]:
    """The routes an active coordinator mirrored (each identity's routing id), checked."""
    if not isinstance(doc, dict) or len(doc) > 1 << 20:
        raise ValueError("routes: not a map of at most 2**20 entries")
    routes = {}
    for identity, routing in doc.items():
        if not isinstance(routing, str) or protocol.identity_of(routing) != identity:
            raise ValueError(f"routes: {str(routing)[:80]!r} is not a routing id of {identity!r}")
        routes[identity] = routing.encode()
    return routes
