"""The control-plane wire format: one module owns it.

Every message is two ZeroMQ frames: an HMAC-SHA256 tag, then a msgpack map
``{v, type, job, run, sender, gen, seq, epoch, term, body}``. The tag is checked
(``hmac.compare_digest``) before a byte of the payload is decoded; then the version, the job
id, the type, the sender (it must match the identity part of the ZeroMQ routing id it came
from) and the sequence number (strictly increasing per
sender and process incarnation: a replayed or reordered message is dropped) are checked, then
the body against the type's schema (:data:`BODY_SCHEMA`). A message failing any check is dropped
with its reason; nothing here raises on network input except :class:`Rejected`.

Replay state is kept per sender *and incarnation*: every process stamps an ``epoch`` (its start
time in nanoseconds) on what it sends. A sender's newer incarnation resets its sequence numbers
(a restarted agent rejoins); a frame of an older incarnation never counts again, even after the
process it came from has exited. ``hello`` and ``scale`` must also be fresh (their epoch within
:data:`FRESHNESS_S` of the receiver's clock), so a frame captured in an earlier run that reused
the secret file is refused. See docs/security.md.

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
import json
import logging
import os
import stat
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 4
MAX_MESSAGE_BYTES = 256 * 1024
MAX_FRAME_BYTES = MAX_MESSAGE_BYTES + 64
"""ZMQ_MAXMSGSIZE of every control-plane socket: libzmq drops the connection of a peer announcing
a bigger frame before buffering it (the signature frame and the payload both fit)."""
RECEIVE_HWM = 10_000
"""Receive high-water mark (messages) of every control-plane socket: a bounded queue."""
FRESHNESS_S = 600.0
"""How far (either way) the epoch of a ``hello`` or ``scale`` may be from the receiver's clock."""
MAX_IDENTITY_CHARS = 64
RUN_NONCE_BYTES = 16
"""Length of a run nonce (``os.urandom``): one per job, drawn by its first coordinator."""

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
ENV_ROUTING_ID = "P2P_ROUTING_ID"
"""The routing id the process connects under (:func:`routing_id`; its agent draws it, so it
can name the process to a coordinator that took over)."""
ENV_NODE_RANK = "P2P_NODE_RANK"
ENV_HEARTBEAT_INTERVAL = "P2P_HEARTBEAT_INTERVAL"
ENV_RUN_DIR = "P2P_RUN_DIR"
ENV_AGENT_PID = "P2P_AGENT_PID"
"""Pid of the node's agent (the parent of every rank and spare it starts)."""
ENV_AGENT_FD = "P2P_AGENT_FD"
"""The process's end of its local channel to the node's agent (a file descriptor; see
:class:`LocalLines`)."""

# The engine settings p2p-run passes to ranks (``p2p_state.protect``'s defaults).
ENV_REPLICAS = "P2P_REPLICAS"
"""Replication factor k of the data plane (``--replicas``)."""
ENV_REPLICATE_EVERY = "P2P_REPLICATE_EVERY"
"""Steps between the states replicated to the buddies (``--replicate-every``)."""
ENV_CHECKPOINT_DIR = "P2P_CHECKPOINT_DIR"
"""Directory or fsspec URL of the cold DCP checkpoints (``--checkpoint-dir``)."""
ENV_CHECKPOINT_EVERY = "P2P_CHECKPOINT_EVERY"
"""Steps between cold checkpoints (``--checkpoint-every``)."""
ENV_RESUME = "P2P_RESUME"
"""``1``: start from the latest complete checkpoint (``--resume``)."""
ENV_LAZY_GLOO = "P2P_LAZY_GLOO"
"""``1``: gloo groups connect a pair on first use (``--lazy-gloo``, :mod:`recovery.gloo_pairs`);
``0``: every pair when made (``--eager-gloo``); unset: on first use from
:data:`recovery.gloo_pairs.LAZY_FROM_RANKS` ranks."""
ENV_JOB_HOOKS = "P2P_JOB_HOOKS"
"""Hooks attached to every protected job of the process: comma-separated ``module:function``
names (:mod:`recovery.hooks`)."""

# Set by p2p-bench for the jobs it runs (and read by the bench's job hooks and examples).
ENV_INJECT = "P2P_INJECT"
"""The faults a rank arms, as JSON (:mod:`bench.faults`)."""
ENV_PROBE_DIR = "P2P_PROBE_DIR"
"""Where a rank records its run for the bitwise check (:mod:`bench.probe`)."""
ENV_BENCH_STEP_S = "P2P_BENCH_STEP_S"
"""Minimum seconds per step of the resize bench's paced run (:mod:`bench.resize_bench`)."""
ENV_TIMELINE = "P2P_TIMELINE"
"""File a plain (unprotected) example script appends its milestones to (the baseline)."""

# Message types.
HELLO = "hello"  # any process -> coordinator: identity, role, node, pid
HEARTBEAT = "heartbeat"  # a coordinator's {"beat"}; an agent's echoes the last beat it heard
REPLICATED = "replicated"  # rank: {"step", "generation"}
MEMORY = "memory"  # rank: {"generation", "kind", "buffers"}: the sizes of the snapshot and
# replica buffers it holds in this generation (memory kind "gpu", "pinned" or "host")
ERROR = "error"  # rank: {"reason"} (a collective failed or timed out)
ACK = "ack"  # rank/spare: {"generation"}
ARRIVED = "arrived"  # rank/spare: {"generation"}: it left its old generation's groups and is
# still forming this one's a while later (at the acknowledgement deadline, the members that
# neither arrived nor acknowledged are the stragglers)
DONE = "done"  # rank: it completed its training and exits (no heartbeat deadline from now);
# {"checkpoint_step"} when it leaves a stopping job after writing the stop checkpoint
SCALE = "scale"  # operator (p2p-run scale): {"size"}: the world size the job should have
EXITED = "exited"  # agent: {"identity", "pid", "code", "rank", "error"}: "error" is the
# exception the process recorded in torchrun's error file, if any
GENERATION = "generation"  # coordinator -> ranks and assigned spares (see launcher.client)
KILL = "kill"  # coordinator -> agent: {"identity", "pid", "reason"}
SPAWN_SPARE = "spawn_spare"  # coordinator -> agent
PREPARE = "prepare"  # coordinator -> idle spares: {"kind", "buffers"}: buffers to allocate now,
# enough to hold any rank's snapshots and replicas when the spare takes its place
SHUTDOWN = "shutdown"  # coordinator -> everyone: {"reason", "code"}
INTERRUPT = "interrupt"  # coordinator -> ranks: {"generation", "lost", "wait_s"}: a fault, and
# the next generation comes within wait_s (a spare is awaited): stop, and wait for it
WELCOME = "welcome"  # coordinator -> any process after HELLO: {"generation", "store"}
# Coordinator takeover (docs/launcher.md, "No single point of failure"):
STANDBYS = "standbys"  # active coordinator -> everyone: {"addresses"}: the standbys to connect to
STATE = "state"  # active -> standby coordinator: {"state", "now"}: membership, zlib'd msgpack
VOTE = "vote"  # standby -> agent: may I take over with the term in my envelope (or, with "pre",
# the next one)? {"silence_s", "pre", "generation": the newest generation it mirrored}
VOTED = "voted"  # agent -> standby: {"granted", "pre", "active"}
TAKEOVER = "takeover"  # new active -> everyone: {"store_port"}: talk to me from now on
CHILDREN = "children"  # agent -> a coordinator that took over: {"identities"} of its processes
# (their routing ids)
CHALLENGE = "challenge"  # coordinator -> a process whose hello/scale carried another run's
# nonce, or whose message came on a connection it has not said hello on: say hello again, with
# the run nonce of this message's envelope

# The local channel between a node's agent and each process it starts (a Unix socket pair the
# agent creates per child, never a network socket): JSON lines ``{"type", **body}``.
COORDINATORS = "coordinators"  # agent -> child: {"addresses", "active", "term"}: every
# coordinator the node knows now, and the one it obeys (after a standby joined or took over); a
# process the old coordinator never welcomed learns there where to say hello
COORDINATORS_LOST = "coordinators_lost"  # agent -> child: {"addresses", "silent_s"}: no
# coordinator is left; the ranks stop at a step they agree on, with a checkpoint
ASSIGNED = "assigned"  # child -> agent: {"rank"}: this process holds rank ``rank`` now (a
# spare assigned, ranks renumbered by a resize): its output is shown as that rank's
STOPPED = "stopped"  # child -> agent: {"step", "root"}: it wrote its part of the checkpoint of
# the step the job stopped at; or {"reason"}: it could not (the reason names the last checkpoint)

TYPES = frozenset(
    {
        HELLO,
        HEARTBEAT,
        REPLICATED,
        MEMORY,
        ERROR,
        ACK,
        ARRIVED,
        DONE,
        SCALE,
        EXITED,
        GENERATION,
        KILL,
        SPAWN_SPARE,
        PREPARE,
        SHUTDOWN,
        INTERRUPT,
        WELCOME,
        STANDBYS,
        STATE,
        VOTE,
        VOTED,
        TAKEOVER,
        CHILDREN,
        CHALLENGE,
    }
)


_INT = (int,)
_OPT_INT = (int, type(None))
_STR = (str,)
_LIST = (list,)
BODY_SCHEMA: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = {
    # type -> field -> (accepted types, required). Integers never accept bool; fields not named
    # here are ignored by every receiver.
    HELLO: {
        "role": (_STR, True),
        "node": (_INT, True),
        "pid": (_INT, True),
        "rank": (_OPT_INT, False),
        "world_size": (_INT, False),
        "address": (_STR, False),
    },
    HEARTBEAT: {"beat": (_INT, False)},
    REPLICATED: {"step": (_INT, True), "generation": (_OPT_INT, False)},
    MEMORY: {"generation": (_INT, True), "kind": (_STR, True), "buffers": (_LIST, True)},
    ERROR: {"reason": (_STR, False), "fatal": ((bool,), False)},
    ACK: {"generation": (_INT, True)},
    ARRIVED: {"generation": (_INT, True)},
    DONE: {"checkpoint_step": (_OPT_INT, False)},
    SCALE: {"size": (_INT, True)},
    EXITED: {
        "identity": (_STR, True),
        "pid": (_INT, False),
        "code": (_INT, True),
        "rank": (_OPT_INT, False),
        "error": (_STR, False),
    },
    GENERATION: {},
    KILL: {"identity": (_STR, True), "pid": (_INT, True), "reason": (_STR, False)},
    SPAWN_SPARE: {},
    PREPARE: {"kind": (_STR, True), "buffers": (_LIST, True)},
    SHUTDOWN: {"reason": (_STR, False), "code": (_INT, False)},
    INTERRUPT: {},
    WELCOME: {
        "generation": (_INT, False),
        "store_port": (_INT, False),
        "env_store_port": (_INT, False),
        "standbys": (_LIST, False),
    },
    STANDBYS: {"addresses": (_LIST, True)},
    STATE: {"state": ((bytes,), True), "now": ((float,), True), "routes": ((dict,), False)},
    VOTE: {"silence_s": ((float,), False), "pre": ((bool,), False), "generation": (_INT, False)},
    VOTED: {"granted": ((bool,), True), "active": (_STR, False), "pre": ((bool,), False)},
    TAKEOVER: {"store_port": (_INT, True)},
    CHILDREN: {"identities": (_LIST, True)},
    CHALLENGE: {},
}
_MAX_ABS_INT = 2**62


def _wire_int(name: str, value: object) -> int:
    """``value`` when it is a wire integer (not a bool, in 0..2**62), else :class:`Rejected`."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= _MAX_ABS_INT:
        raise Rejected(f"malformed {name}")
    return value


def _check_body(type_: str, body: dict[Any, Any]) -> None:
    for key in body:
        if not isinstance(key, str):
            raise Rejected(f"{type_} body has a non-string key")
    for name, (types, required) in BODY_SCHEMA[type_].items():
        if name not in body:
            if required:
                raise Rejected(f"{type_} body lacks {name!r}")
            continue
        value = body[name]
        if isinstance(value, bool) and bool not in types:
            raise Rejected(f"{type_} field {name!r} is a bool, expected {types[0].__name__}")
        if not isinstance(value, types):
            raise Rejected(
                f"{type_} field {name!r} is a {type(value).__name__}, expected {types[0].__name__}"
            )
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > _MAX_ABS_INT:
            raise Rejected(f"{type_} field {name!r} is out of range")


class DropLog:
    """Rate-limited logging of dropped messages: the first few in full, then a count per window.

    A flood of forged frames must not fill the disk with log lines (each drop is still counted).

    Args:
        logger_: Where to log.
        per_window: Lines logged in full per window.
        window_s: The window.
    """

    def __init__(self, logger_: logging.Logger, per_window: int = 10, window_s: float = 10.0):
        self._logger = logger_
        self._per_window = per_window
        self._window_s = window_s
        self._window_start = 0.0
        self._in_window = 0
        self._suppressed = 0
        self.total = 0

    def drop(self, reason: str) -> bool:
        """Count a drop; log it unless the window's quota is spent. Returns whether it logged."""
        import time

        self.total += 1
        now = time.monotonic()
        if now - self._window_start >= self._window_s:
            if self._suppressed:
                self._logger.warning(
                    "%d more control messages dropped in the last %.0fs (not logged one by one)",
                    self._suppressed,
                    self._window_s,
                )
            self._window_start, self._in_window, self._suppressed = now, 0, 0
        if self._in_window < self._per_window:
            self._in_window += 1
            self._logger.warning("dropped a control message: %s", reason)
            return True
        self._suppressed += 1
        return False


HANDSHAKE_MS = 5_000
"""A connection that has not finished the ZMTP handshake by then is closed (libzmq: 30 s)."""


def harden_socket(sock: Any) -> None:
    """Bound what a peer can make ``sock`` hold: frame size, queue length, half-open connections.

    A connection that never completes its handshake (a raw TCP socket, a half-sent greeting) is
    closed after :data:`HANDSHAKE_MS`, so idle attackers do not hold descriptors for long.
    """
    import zmq

    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    sock.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)


def raise_descriptor_limit() -> int:
    """Raise this process's open-file soft limit to its hard limit; returns the new soft limit.

    A listener's connections each hold a descriptor: the higher the limit, the larger the flood
    of idle connections it takes before a new, legitimate peer cannot connect.
    """
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            logger.warning("could not raise the open-file limit from %d: %s", soft, e)
    return soft


COORDINATOR = "coordinator"
"""The identity of the coordinator a job starts with; a standby on node N is ``coordinator/N``."""


def is_coordinator(identity: str) -> bool:
    """Whether ``identity`` names a coordinator (the first one or a standby)."""
    return identity == COORDINATOR or identity.startswith(COORDINATOR + "/")


def routing_id(identity: str) -> str:
    """The ZeroMQ routing id a process connects under: its identity and a random token.

    The token is drawn once per process, so nobody can predict the routing id a peer uses: a
    socket that connects under a guessed one (``agent/1``) takes over nothing the coordinator
    sends, since replies go to the routing id the identity's accepted hello came on.
    """
    return f"{identity}#{os.urandom(8).hex()}"


def identity_of(routing: str) -> str:
    """The identity part of a routing id (the routing id itself when it has no token)."""
    return routing.split("#", 1)[0]


class Rejected(ValueError):
    """A received message failed a check; ``reason`` says which."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class WrongRun(Rejected):
    """A valid, signed message that does not carry this run's nonce (a sender that has not
    learned it yet, or a frame captured in another run): answered with a challenge."""

    def __init__(self, reason: str, type_: str, operator: bool, run: bytes) -> None:
        super().__init__(reason)
        self.type = type_
        self.operator = operator
        self.run = run
        """The nonce the message carried (empty: its sender has not learned one yet)."""


@dataclass(frozen=True, slots=True)
class Message:
    """A decoded, authenticated message."""

    type: str
    sender: str
    generation: int
    seq: int
    body: dict[str, Any] = field(default_factory=dict)
    epoch: int = 0
    term: int = 0
    """The sender's coordinator term: which coordinator it obeys (or, from a coordinator, the
    term it acts in). A coordinator's message of an older term than the receiver's is stale."""
    run: bytes = b""
    """The run nonce the sender stamped."""
    operator: bool = False
    """Signed with the operator key rather than the job secret."""


def read_secret(path: str) -> bytes:
    """Read a job secret, refusing a file others could have written or can read.

    The file is opened without following a symlink, and must be a regular file owned by this
    user with no group/other permission bits.

    Raises:
        ValueError: missing, a symlink, not a regular file, owned by another user, empty, or
            readable by group/others (the message says the fix).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ValueError(f"secret file {path} does not exist") from None
    except OSError as e:
        if os.path.islink(path):
            raise ValueError(
                f"secret file {path} is a symlink; refusing it (point --secret-file at the file)"
            ) from None
        raise ValueError(f"cannot open secret file {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"secret file {path} is not a regular file")
        if st.st_uid != os.getuid():
            raise ValueError(
                f"secret file {path} is owned by uid {st.st_uid}, not by this user "
                f"({os.getuid()}); use a secret file of your own"
            )
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ValueError(
                f"secret file {path} is readable by others (mode {stat.S_IMODE(st.st_mode):o}); "
                f"run: chmod 600 {path}"
            )
        secret = os.read(fd, 4096).strip()
    finally:
        os.close(fd)
    if not secret:
        raise ValueError(f"secret file {path} is empty")
    return secret


def write_secret(path: str) -> bytes:
    """Create a new random job secret at ``path`` with mode 0600 and return it.

    The file is created exclusively and never through a symlink: an existing file or a planted
    link at ``path`` raises ``FileExistsError`` rather than being written through.
    """
    secret = os.urandom(32).hex().encode()
    fd = os.open(
        path,
        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
        0o600,
    )
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.write(fd, secret)
    finally:
        os.close(fd)
    return secret


class Codec:
    """Signs outgoing and verifies incoming messages of one job, with a replay guard.

    Args:
        secret: The per-job secret (an operator's codec: the operator key).
        job_id: Messages of other jobs are rejected.
        sender: This process's identity (stamped on everything it sends).
        operator_key: A coordinator's: frames signed with it are accepted too, as the
            operator's (only ``scale``, only from ``operator/...``).
    """

    def __init__(
        self, secret: bytes, job_id: str, sender: str, operator_key: bytes | None = None
    ) -> None:
        self._secret = secret
        self.operator_key = operator_key
        self.job_id = job_id
        self.sender = sender
        self.run = b""
        """The run nonce stamped on everything sent and required of everything received
        (a ``challenge`` excepted): drawn by the first coordinator, learned by the others."""
        self._opening: tuple[str, dict[str, Any], int] | None = None
        self._seq = 0
        self.term = 0
        """Stamped on everything sent: the coordinator term this process acts in or obeys."""
        # This incarnation's epoch: strictly newer than any earlier process's of this sender.
        self.epoch = time.time_ns()
        # sender -> (epoch, last seq) of the newest incarnation seen.
        self._last_seen: dict[str, tuple[int, int]] = {}
        self.drops = DropLog(logger)

    def encode(
        self,
        type_: str,
        body: dict[str, Any] | None = None,
        generation: int = 0,
        key: bytes | None = None,
    ) -> list[bytes]:
        """The frames of a message (signed with ``key`` when given, else the secret).

        A ``hello`` or ``scale`` is remembered: :meth:`drain` sends it again, with the run
        nonce, when a coordinator answers it with a ``challenge``.
        """
        assert type_ in TYPES, type_
        if type_ in (HELLO, SCALE):
            self._opening = (type_, dict(body or {}), generation)
        self._seq += 1
        payload = msgpack.packb(
            {
                "v": PROTOCOL_VERSION,
                "type": type_,
                "job": self.job_id,
                "run": self.run,
                "sender": self.sender,
                "gen": generation,
                "seq": self._seq,
                "epoch": self.epoch,
                "term": self.term,
                "body": body or {},
            },
            use_bin_type=True,
        )
        return [hmac.new(key or self._secret, payload, hashlib.sha256).digest(), payload]

    def decode(self, frames: list[bytes], routing_id: str | None = None) -> Message:
        """Verify and decode ``[tag, payload]``.

        Args:
            frames: The two frames after any routing identity.
            routing_id: The ZeroMQ routing id the message arrived from, when known (ROUTER
                side); the sender field must equal its identity part (:func:`identity_of`).

        Raises:
            WrongRun: a valid message of another run (or of a sender that has not learned
                this run's nonce yet); the replay state is left as it was.
            Rejected: with the reason, for anything else that is not a valid, fresh message.
        """
        if len(frames) != 2:
            raise Rejected(f"expected 2 frames, got {len(frames)}")
        tag, payload = frames
        if len(payload) > MAX_MESSAGE_BYTES:
            raise Rejected(f"oversized message ({len(payload)} bytes > {MAX_MESSAGE_BYTES})")
        operator = False
        expected = hmac.new(self._secret, payload, hashlib.sha256).digest()
        if not hmac.compare_digest(tag, expected):
            operator_tag = (
                b""
                if self.operator_key is None
                else hmac.new(self.operator_key, payload, hashlib.sha256).digest()
            )
            if not operator_tag or not hmac.compare_digest(tag, operator_tag):
                raise Rejected("bad authentication tag")
            operator = True
        try:
            doc = msgpack.unpackb(payload, raw=False, strict_map_key=True)
        except Exception as e:
            raise Rejected(f"undecodable payload: {type(e).__name__}: {e}") from None
        if not isinstance(doc, dict):
            raise Rejected("payload is not a map")
        if doc.get("v") != PROTOCOL_VERSION:
            raise Rejected(f"unknown protocol version {str(doc.get('v'))[:20]!r}")
        if doc.get("job") != self.job_id:
            raise Rejected(f"message of another job {str(doc.get('job'))[:40]!r}")
        type_, run, sender, gen, seq, epoch, term, body = (
            doc.get("type"),
            doc.get("run"),
            doc.get("sender"),
            doc.get("gen"),
            doc.get("seq"),
            doc.get("epoch"),
            doc.get("term"),
            doc.get("body"),
        )
        # A type that is a list or a map is not hashable: check it is a string before the set.
        if not isinstance(type_, str) or type_ not in TYPES:
            raise Rejected(f"unknown message type {str(type_)[:40]!r}")
        if not isinstance(sender, str) or not 0 < len(sender) <= MAX_IDENTITY_CHARS:
            raise Rejected("malformed sender")
        if not isinstance(body, dict):
            raise Rejected("malformed body")
        if not isinstance(run, bytes) or len(run) > 2 * RUN_NONCE_BYTES:
            raise Rejected("malformed run nonce")
        gen, seq, epoch, term = (
            _wire_int("generation", gen),
            _wire_int("sequence number", seq),
            _wire_int("epoch", epoch),
            _wire_int("term", term),
        )
        _check_body(type_, body)
        if routing_id is not None and sender != identity_of(routing_id):
            raise Rejected(f"sender {sender!r} does not match its connection {routing_id!r}")
        if operator and (type_ != SCALE or not sender.startswith("operator/")):
            raise Rejected(f"{type_} from {sender} signed with the operator key (only scale is)")
        if type_ in (HELLO, SCALE) and abs(epoch - time.time_ns()) > FRESHNESS_S * 1e9:
            raise Rejected(f"stale {type_} from {sender} (an old run's frame, or a clock off)")
        if type_ != CHALLENGE and run != self.run:
            raise WrongRun(f"{type_} from {sender} of another run", type_, operator, run)
        last_epoch, last_seq = self._last_seen.get(sender, (-1, 0))
        if epoch < last_epoch:
            raise Rejected(f"message of an earlier incarnation of {sender}")
        if epoch == last_epoch and seq <= last_seq:
            raise Rejected(f"replayed or reordered message from {sender} (seq {seq})")
        self._last_seen[sender] = (epoch, seq)
        return Message(type_, sender, gen, seq, body, epoch, term, run, operator)

    def drain(self, sock: Any, expect_sender: str = COORDINATOR) -> list[Message]:
        """Every message waiting on ``sock`` that authenticates and comes from ``expect_sender``
        (for the default, any coordinator: the active one or a standby).

        Never blocks; anything rejected or from someone else is dropped and logged. A
        coordinator's ``challenge`` is answered here: its run nonce is learned and the last
        ``hello`` or ``scale`` goes out again on ``sock``, with it.
        """
        import zmq

        out: list[Message] = []
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            try:
                msg = self.decode(frames)
            except Rejected as e:
                self.drops.drop(e.reason)
                continue
            if msg.sender != expect_sender and not (
                expect_sender == COORDINATOR and is_coordinator(msg.sender)
            ):
                self.drops.drop(f"a message from {msg.sender} (expected {expect_sender})")
                continue
            if msg.type == CHALLENGE:
                self.answer(sock, msg)
                continue
            out.append(msg)

    def answer(self, sock: Any, challenge: Message) -> None:
        """Learn the run nonce of a coordinator's ``challenge`` and say hello again on ``sock``
        (an operator: send its ``scale`` again)."""
        import zmq

        if len(challenge.run) != RUN_NONCE_BYTES:
            self.drops.drop(f"a challenge from {challenge.sender} without a run nonce")
            return
        if challenge.run != self.run:
            logger.debug("run nonce %s from %s", challenge.run.hex(), challenge.sender)
            self.run = challenge.run
        if self._opening is not None:
            type_, body, generation = self._opening
            try:
                sock.send_multipart(self.encode(type_, body, generation), zmq.NOBLOCK)
            except zmq.Again:
                logger.debug("the queue is full; %s not sent again", type_)

    def forget(self, sender: str) -> None:
        """A sender's process is gone: its next incarnation may start again at sequence 1.

        The incarnation's epoch is kept, so none of the gone process's frames counts again.
        """
        if sender in self._last_seen:
            epoch, _ = self._last_seen[sender]
            self._last_seen[sender] = (epoch + 1, 0)


#: The most of an exited process's recorded error an exit report carries (and a reason keeps).
MAX_ERROR_CHARS = 500

#: Longest line accepted on the local channel (a longer one is dropped).
MAX_LOCAL_LINE_BYTES = 64 * 1024


def encode_local(type_: str, body: dict[str, Any]) -> bytes:
    """One message of the local channel between an agent and its process."""
    return json.dumps({**body, "type": type_}).encode() + b"\n"


class LocalLines:
    """Splits what the local channel brings into messages; malformed lines are dropped."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        """The complete messages ``data`` ends (a partial line waits for the rest)."""
        *lines, self._buf = (self._buf + data).split(b"\n")
        if len(self._buf) > MAX_LOCAL_LINE_BYTES:
            logger.warning("dropped a local message of over %d bytes", MAX_LOCAL_LINE_BYTES)
            self._buf = b""
        out = []
        for line in lines:
            try:
                msg = json.loads(line)
            except ValueError:
                msg = None
            if isinstance(msg, dict) and isinstance(msg.get("type"), str):
                out.append(msg)
            elif line.strip():
                logger.warning("dropped a malformed local message: %r", line[:200])
        return out
