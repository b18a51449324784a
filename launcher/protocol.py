"""The control-plane wire format: one module owns it.

Every message is two ZeroMQ frames: an HMAC-SHA256 tag, then a msgpack map
``{v, type, job, sender, gen, seq, body}``. The tag is checked (``hmac.compare_digest``) before a
byte of the payload is decoded; then the version, the job id, the type, the sender (it must match
the ZeroMQ routing identity it came from) and the sequence number (strictly increasing per
sender: a replayed or reordered message is dropped) are checked. A message failing any check is
dropped with its reason; nothing here raises on network input except :class:`Rejected`.

Why HMAC with a per-job secret rather than ZeroMQ CURVE: the threat is a stray or malicious
process on the cluster network injecting membership changes, not eavesdropping on membership
data. An HMAC is cheap enough to check on every heartbeat of 2,048 ranks, needs one secret file
rather than a key pair per process, and lets the coordinator drop forgeries before decoding.

This module and :mod:`launcher.client` are the only parts of ``launcher`` that rank-side code
(the recovery engine) imports; it imports nothing else from ``launcher``.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat
from dataclasses import dataclass, field
from typing import Any

import msgpack

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 256 * 1024

# Environment variables p2p-run sets for every rank and spare (torchrun's own are set too).
ENV_COORDINATOR = "P2P_COORDINATOR"
"""``host:port`` of the coordinator's ROUTER socket."""
ENV_JOB_ID = "P2P_JOB_ID"
ENV_SECRET_FILE = "P2P_SECRET_FILE"
"""Path of the per-job secret (mode 0600)."""
ENV_ROLE = "P2P_ROLE"
"""``rank`` or ``spare``."""
ENV_IDENTITY = "P2P_IDENTITY"
"""The process's control-plane identity, e.g. ``rank/3`` or ``spare/1/0`` (node 1, spare 0)."""
ENV_NODE_RANK = "P2P_NODE_RANK"
ENV_HEARTBEAT_INTERVAL = "P2P_HEARTBEAT_INTERVAL"
ENV_RUN_DIR = "P2P_RUN_DIR"
ENV_AGENT_PID = "P2P_AGENT_PID"
"""Pid of the node's agent (the parent of every rank and spare it starts)."""

# Message types.
HELLO = "hello"  # any process -> coordinator: identity, role, node, pid
HEARTBEAT = "heartbeat"
REPLICATED = "replicated"  # rank: {"step", "generation"}
ERROR = "error"  # rank: {"reason"} (a collective failed or timed out)
ACK = "ack"  # rank/spare: {"generation"}
DONE = "done"  # rank: it completed its training and exits (no heartbeat deadline from now);
# {"checkpoint_step"} when it leaves a stopping job after writing the stop checkpoint
SCALE = "scale"  # operator (p2p-run scale): {"size"}: the world size the job should have
EXITED = "exited"  # agent: {"identity", "pid", "code"}
GENERATION = "generation"  # coordinator -> ranks and assigned spares (see launcher.client)
KILL = "kill"  # coordinator -> agent: {"identity", "pid", "reason"}
SPAWN_SPARE = "spawn_spare"  # coordinator -> agent
SHUTDOWN = "shutdown"  # coordinator -> everyone: {"reason", "code"}
INTERRUPT = "interrupt"  # coordinator -> ranks: {"generation", "lost", "wait_s"}: a fault, and
# the next generation comes within wait_s (a spare is awaited): stop, and wait for it
WELCOME = "welcome"  # coordinator -> any process after HELLO: {"generation", "store"}

TYPES = frozenset(
    {
        HELLO,
        HEARTBEAT,
        REPLICATED,
        ERROR,
        ACK,
        DONE,
        SCALE,
        EXITED,
        GENERATION,
        KILL,
        SPAWN_SPARE,
        SHUTDOWN,
        INTERRUPT,
        WELCOME,
    }
)


class Rejected(ValueError):
    """A received message failed a check; ``reason`` says which."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Message:
    """A decoded, authenticated message."""

    type: str
    sender: str
    generation: int
    seq: int
    body: dict[str, Any] = field(default_factory=dict)


def read_secret(path: str) -> bytes:
    """Read a job secret, refusing a file others can read.

    Raises:
        ValueError: missing, empty, or readable by group/others (the message says the fix).
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ValueError(f"secret file {path} does not exist") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(
            f"secret file {path} is readable by others (mode {stat.S_IMODE(st.st_mode):o}); "
            f"run: chmod 600 {path}"
        )
    with open(path, "rb") as f:
        secret = f.read().strip()
    if not secret:
        raise ValueError(f"secret file {path} is empty")
    return secret


def write_secret(path: str) -> bytes:
    """Create a new random job secret at ``path`` with mode 0600 and return it."""
    secret = os.urandom(32).hex().encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, secret)
    finally:
        os.close(fd)
    return secret


class Codec:
    """Signs outgoing and verifies incoming messages of one job, with a replay guard.

    Args:
        secret: The per-job secret.
        job_id: Messages of other jobs are rejected.
        sender: This process's identity (stamped on everything it sends).
    """

    def __init__(self, secret: bytes, job_id: str, sender: str) -> None:
        self._secret = secret
        self.job_id = job_id
        self.sender = sender
        self._seq = 0
        self._last_seen: dict[str, int] = {}

    def encode(self, type_: str, body: dict[str, Any] | None = None, generation: int = 0) -> list:
        """The frames of a message."""
        assert type_ in TYPES, type_
        self._seq += 1
        payload = msgpack.packb(
            {
                "v": PROTOCOL_VERSION,
                "type": type_,
                "job": self.job_id,
                "sender": self.sender,
                "gen": generation,
                "seq": self._seq,
                "body": body or {},
            },
            use_bin_type=True,
        )
        return [hmac.new(self._secret, payload, hashlib.sha256).digest(), payload]

    def decode(self, frames: list[bytes], routing_id: str | None = None) -> Message:
        """Verify and decode ``[tag, payload]``.

        Args:
            frames: The two frames after any routing identity.
            routing_id: The ZeroMQ identity the message arrived from, when known (ROUTER side);
                the sender field must equal it.

        Raises:
            Rejected: with the reason, for anything that is not a valid, fresh message.
        """
        if len(frames) != 2:
            raise Rejected(f"expected 2 frames, got {len(frames)}")
        tag, payload = frames
        if len(payload) > MAX_MESSAGE_BYTES:
            raise Rejected(f"oversized message ({len(payload)} bytes > {MAX_MESSAGE_BYTES})")
        expected = hmac.new(self._secret, payload, hashlib.sha256).digest()
        if not hmac.compare_digest(tag, expected):
            raise Rejected("bad authentication tag")
        try:
            doc = msgpack.unpackb(payload, raw=False, strict_map_key=True)
        except Exception as e:
            raise Rejected(f"undecodable payload: {type(e).__name__}: {e}") from None
        if not isinstance(doc, dict):
            raise Rejected("payload is not a map")
        if doc.get("v") != PROTOCOL_VERSION:
            raise Rejected(f"unknown protocol version {doc.get('v')!r}")
        if doc.get("job") != self.job_id:
            raise Rejected(f"message of another job {doc.get('job')!r}")
        type_, sender, gen, seq, body = (
            doc.get("type"),
            doc.get("sender"),
            doc.get("gen"),
            doc.get("seq"),
            doc.get("body"),
        )
        if type_ not in TYPES:
            raise Rejected(f"unknown message type {type_!r}")
        if not isinstance(sender, str) or not isinstance(body, dict):
            raise Rejected("malformed sender or body")
        if not isinstance(gen, int) or not isinstance(seq, int) or isinstance(seq, bool):
            raise Rejected("malformed generation or sequence number")
        if routing_id is not None and sender != routing_id:
            raise Rejected(f"sender {sender!r} does not match its connection {routing_id!r}")
        if seq <= self._last_seen.get(sender, 0):
            raise Rejected(f"replayed or reordered message from {sender} (seq {seq})")
        self._last_seen[sender] = seq
        return Message(type_, sender, gen, seq, body)

    def drain(self, sock: Any, expect_sender: str = "coordinator") -> list[Message]:
        """Every message waiting on ``sock`` that authenticates and comes from ``expect_sender``.

        Never blocks; anything rejected or from someone else is dropped and logged.
        """
        import zmq

        out = []
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            try:
                msg = self.decode(frames)
            except Rejected as e:
                logger.warning("dropped a control message: %s", e.reason)
                continue
            if msg.sender != expect_sender:
                logger.warning("dropped a message from %s (expected %s)", msg.sender, expect_sender)
                continue
            out.append(msg)

    def forget(self, sender: str) -> None:
        """Drop the replay state of a sender whose process is gone (a new one starts at 1)."""
        self._last_seen.pop(sender, None)
