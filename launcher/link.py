"""The connection of an agent, rank or spare to the job's coordinators: the active one and its
standbys, with the term that fences off a coordinator that was replaced.

One DEALER socket per coordinator address. Everything is sent to the *active* coordinator only;
every socket is read. A coordinator stamps its term on what it sends: a message of an older
term than this process's is stale (from a coordinator that was replaced) and is dropped; one of
a newer term makes its sender the active coordinator (a takeover). This process's own term goes
out on everything it sends, so a replaced coordinator that comes back learns it was replaced
from the first message it receives, and stops acting.

ZeroMQ sockets are not thread-safe: a link belongs to the one thread that polls it.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

import zmq

from launcher import protocol

logger = logging.getLogger(__name__)


@dataclass
class Received:
    """What one read of a socket brought: the messages to act on, and whether the active
    coordinator changed (the caller then re-announces itself to the new one)."""

    messages: list[protocol.Message] = field(default_factory=list)
    takeover: bool = False


class CoordinatorLinks:
    """Sockets to every known coordinator; sends go to the active one.

    Args:
        ctx: The ZeroMQ context the sockets belong to.
        identity: This process's control-plane identity (the sockets' routing id).
        codec: Signs what is sent; its ``term`` is kept equal to this link's.
        addresses: ``host:port`` of the coordinator to start with, then any standbys known.
        routing: The routing id every socket connects under (default: a new
            :func:`launcher.protocol.routing_id`); the same on every link, so a standby that
            mirrored the routes reaches this process when it takes over.
    """

    def __init__(
        self,
        ctx: zmq.Context[Any],
        identity: str,
        codec: protocol.Codec,
        addresses: list[str],
        routing: str | None = None,
    ) -> None:
        self.ctx = ctx
        self.identity = identity
        self.routing = routing or protocol.routing_id(identity)
        self.codec = codec
        self.sockets: dict[str, zmq.Socket[Any]] = {}
        self.active = addresses[0]
        for address in addresses:
            self.add(address)

    @property
    def term(self) -> int:
        """The term of the coordinator this process obeys."""
        return self.codec.term

    def add(self, address: str) -> zmq.Socket[Any] | None:
        """Connect to one more coordinator (a standby); returns the new socket, if new."""
        if address in self.sockets:
            return None
        sock: zmq.Socket[Any] = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.routing.encode())
        sock.setsockopt(zmq.LINGER, 500)
        protocol.harden_socket(sock)
        sock.connect(f"tcp://{address}")
        self.sockets[address] = sock
        return sock

    @property
    def active_socket(self) -> zmq.Socket[Any]:
        return self.sockets[self.active]

    def send(self, type_: str, body: dict[str, Any] | None = None, generation: int = 0) -> None:
        """Send to the active coordinator (never blocks: a full queue drops, as a lost link)."""
        try:
            self.active_socket.send_multipart(
                self.codec.encode(type_, body, generation), zmq.NOBLOCK
            )
        except zmq.Again:
            logger.debug("the queue to %s is full; %s not sent", self.active, type_)

    def send_to(self, address: str, type_: str, body: dict[str, Any] | None = None) -> None:
        """Send to one coordinator whatever its term (a vote to a standby)."""
        try:
            self.sockets[address].send_multipart(self.codec.encode(type_, body), zmq.NOBLOCK)
        except zmq.Again:
            logger.debug("the queue to %s is full; %s not sent", address, type_)

    def reconnect(self, address: str) -> None:
        """Connect to ``address`` afresh. A coordinator over its cap of unauthenticated
        connections refuses a new one during its handshake, and ZeroMQ never retries a refused
        handshake by itself; a hello that goes unanswered calls this before it goes again."""
        sock = self.sockets[address]
        with contextlib.suppress(zmq.ZMQError):  # a refused connection may be gone already
            sock.disconnect(f"tcp://{address}")
        sock.connect(f"tcp://{address}")

    def rotate(self) -> str:
        """Make the next known coordinator the active one (a hello nobody answered)."""
        addresses = list(self.sockets)
        self.active = addresses[(addresses.index(self.active) + 1) % len(addresses)]
        return self.active

    def address_of(self, sock: zmq.Socket[Any]) -> str | None:
        return next((a for a, s in self.sockets.items() if s is sock), None)

    def receive(self, sock: zmq.Socket[Any]) -> Received:
        """Every valid message waiting on ``sock``, with the term rule applied."""
        out = Received()
        address = self.address_of(sock)
        for msg in self.codec.drain(sock):
            if msg.type == protocol.VOTE:
                out.messages.append(msg)  # a standby asking: the caller decides on its term
                continue
            if msg.term < self.term:
                self.codec.drops.drop(
                    f"{msg.type} from {msg.sender} of term {msg.term}, older than {self.term}"
                )
                if address is not None:
                    # A replaced coordinator that runs again learns it from this reply's term.
                    self.send_to(address, protocol.HEARTBEAT)
                continue
            if address != self.active and msg.type == protocol.WELCOME and msg.term == self.term:
                self.adopt(msg.term, address)  # the answer to a hello sent before a rotate()
            elif msg.term > self.term or (address != self.active and msg.term > 0):
                # A newer term, or the one coordinator that acts in this process's term (a
                # standby acts only once it won; before that it only asks for votes): after a
                # vote, any message of the winner switches this process even if its
                # ``takeover`` was lost.
                self.adopt(msg.term, address)
                out.takeover = True
            if address != self.active:
                continue  # term 0 is the first coordinator's: a standby's counts for nothing
            out.messages.append(msg)
        return out

    def adopt(self, term: int, address: str | None) -> None:
        """Obey ``term`` from now on, and the coordinator at ``address`` when given."""
        if term > self.codec.term:
            logger.warning("coordinator term %d -> %d", self.codec.term, term)
            self.codec.term = term
        if address is not None and address != self.active:
            logger.warning("the active coordinator is now %s (was %s)", address, self.active)
            self.active = address

    def close(self) -> None:
        for sock in self.sockets.values():
            sock.close(linger=500)
        self.sockets.clear()
