"""An authenticated rendezvous store: what ``torch.distributed`` needs, over a signed channel.

torch's ``TCPStore`` has no authentication: anyone who reaches its port can read and write the
job's rendezvous keys (a forged gloo address or NCCL unique id takes over a pair's connection).
This store keeps the same semantics (``set``/``get``/``add``/``wait``/``check``/
``compare_set``/``delete_key``/``num_keys``, and the extended ``append``/``multi_get``/
``multi_set``) and is accepted by every process-group constructor
(a Python subclass of :class:`torch.distributed.Store`), but every request and every reply is a
msgpack payload under an HMAC-SHA256 tag keyed by the job's secret, checked with
:func:`hmac.compare_digest` before a byte is decoded.

Replays: a client opens a *session* (16 random bytes) and numbers its requests; the server
keeps, per session, the last number it answered and refuses anything not newer, and every
request carries its send time, refused when more than :data:`FRESHNESS_S` from the server's
clock. A session idle for twice that long is forgotten: any frame of it that could still be
replayed is stale by then. Replies carry the session and number they answer, so a client
never takes a reply to someone else's request (or an old one) for its own.

Bounds: keys up to :data:`MAX_KEY_BYTES`, values up to :data:`MAX_VALUE_BYTES`, all values
together up to ``max_total_bytes``, at most ``max_sessions`` live sessions; frames above the
size limit are refused by libzmq before they are buffered (``MAXMSGSIZE``); a ``multi_get``
whose values would not fit in one reply returns the longest prefix that does, and the client
asks again for the rest. Waiting is done by
the client (``check`` with a backoff, under the store's timeout), so the server never holds a
request open and one thread serves every rank.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import threading
import time
from typing import Any

import msgpack
import zmq

from launcher.protocol import DropLog, harden_socket

logger = logging.getLogger(__name__)

STORE_VERSION = 1
MAX_KEY_BYTES = 1024
MAX_VALUE_BYTES = 1 << 20
MAX_REQUEST_BYTES = MAX_VALUE_BYTES + 2 * MAX_KEY_BYTES + 256
"""The largest payload a request can have (a ``compare_set`` of two full values and a key)."""
FRESHNESS_S = 600.0
"""How far a request's send time may be from the server's clock."""
MAX_KEYS_PER_REQUEST = 1 << 16
"""The most keys one ``check``, ``multi_get`` or ``multi_set`` names."""
DEFAULT_MAX_TOTAL_BYTES = 256 << 20
DEFAULT_MAX_SESSIONS = 1 << 16
_DOMAIN = b"p2p-rendezvous-store/1"

_OPS = frozenset(
    {
        "set",
        "get",
        "add",
        "check",
        "compare_set",
        "delete_key",
        "num_keys",
        "append",
        "multi_get",
        "multi_set",
    }
)
_ITEM_OVERHEAD = 8
"""Reply bytes counted per value of a ``multi_get`` besides the value (msgpack's header)."""


class StoreRejected(ValueError):
    """A store request or reply failed a check; the message says which."""


def _store_key(secret: bytes) -> bytes:
    # A key of its own, so no store frame is ever a valid control-plane frame or the reverse.
    return hmac.new(secret, _DOMAIN, hashlib.sha256).digest()


def _sign(key: bytes, payload: bytes) -> list[bytes]:
    return [hmac.new(key, payload, hashlib.sha256).digest(), payload]


def _verify(key: bytes, frames: list[bytes], limit: int) -> dict[str, Any]:
    if len(frames) != 2:
        raise StoreRejected(f"expected 2 frames, got {len(frames)}")
    tag, payload = frames
    if len(payload) > limit:
        raise StoreRejected(f"oversized payload ({len(payload)} bytes)")
    if not hmac.compare_digest(tag, hmac.new(key, payload, hashlib.sha256).digest()):
        raise StoreRejected("bad authentication tag")
    try:
        doc = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as e:
        raise StoreRejected(f"undecodable payload: {type(e).__name__}") from None
    if not isinstance(doc, dict) or doc.get("v") != STORE_VERSION:
        raise StoreRejected("not a store message of this version")
    return doc


def _int(doc: dict[str, Any], name: str) -> int:
    value = doc.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or abs(value) > 2**62:
        raise StoreRejected(f"malformed {name}")
    return value


def _key(value: Any) -> str:
    if not isinstance(value, str) or not 0 < len(value.encode()) <= MAX_KEY_BYTES:
        raise StoreRejected("malformed key")
    return value


def _keys(value: Any) -> list[str]:
    if not isinstance(value, list) or len(value) > MAX_KEYS_PER_REQUEST:
        raise StoreRejected("malformed key list")
    # A gloo rendezvous sends 128 short keys a request: no key of at most a quarter of the
    # limit in characters can be over it in bytes, so only longer ones are encoded to check.
    if value and set(map(type, value)) == {str}:
        lengths = list(map(len, value))
        if min(lengths) > 0 and max(lengths) <= MAX_KEY_BYTES // 4:
            return value
    return [_key(k) for k in value]


def _value(value: Any) -> bytes:
    if not isinstance(value, bytes) or len(value) > MAX_VALUE_BYTES:
        raise StoreRejected("malformed value")
    return value


class _Data:
    """The key-value data and its size accounting (the server thread's alone)."""

    def __init__(self, max_total_bytes: int) -> None:
        self.values: dict[str, bytes] = {}
        self.total_bytes = 0
        self.max_total_bytes = max_total_bytes

    def put(self, key: str, value: bytes) -> None:
        old = self.values.get(key)
        grown = len(key) + len(value) - (len(key) + len(old) if old is not None else 0)
        if self.total_bytes + grown > self.max_total_bytes:
            raise StoreRejected(
                f"the rendezvous store is full ({self.total_bytes} of {self.max_total_bytes} bytes)"
            )
        self.values[key] = value
        self.total_bytes += grown

    def delete(self, key: str) -> bool:
        old = self.values.pop(key, None)
        if old is None:
            return False
        self.total_bytes -= len(key) + len(old)
        return True

    def apply(self, op: str, args: list[Any]) -> Any:
        """Run one operation; returns its result (``None`` for a ``get`` of a missing key)."""
        if op == "set":
            self.put(_key(args[0]), _value(args[1]))
            return None
        if op == "get":
            return self.values.get(_key(args[0]))
        if op == "add":
            key = _key(args[0])
            amount = _int({"amount": args[1]}, "amount")
            current = self.values.get(key, b"0")
            try:
                value = int(current) + amount
            except ValueError:
                raise StoreRejected(f"add on key {key!r} that does not hold an integer") from None
            self.put(key, str(value).encode())
            return value
        if op == "check":
            return all(k in self.values for k in _keys(args[0]))
        if op == "append":
            key, more = _key(args[0]), _value(args[1])
            joined = self.values.get(key, b"") + more
            if len(joined) > MAX_VALUE_BYTES:
                raise StoreRejected(f"append would make key {key!r} longer than a value may be")
            self.put(key, joined)
            return None
        if op == "multi_get":
            return self._multi_get(_keys(args[0]))
        if op == "multi_set":
            keys, values = _keys(args[0]), args[1]
            if not isinstance(values, list) or len(values) != len(keys):
                raise StoreRejected("multi_set needs one value per key")
            pairs = dict(zip(keys, map(_value, values)))  # a key named twice: the last value
            # All or nothing: refused before anything is written if they do not fit together.
            grown = sum(
                len(v) - len(self.values[k]) if k in self.values else len(k) + len(v)
                for k, v in pairs.items()
            )
            if self.total_bytes + grown > self.max_total_bytes:
                raise StoreRejected(
                    f"the rendezvous store is full ({self.total_bytes} of "
                    f"{self.max_total_bytes} bytes)"
                )
            for k, v in pairs.items():
                self.put(k, v)
            return None
        if op == "compare_set":
            key, expected, desired = _key(args[0]), _value(args[1]), _value(args[2])
            held = self.values.get(key)
            # torch's semantics: a missing key counts as equal to an empty expected value.
            if (held is None and expected == b"") or held == expected:
                self.put(key, desired)
                return desired
            return held if held is not None else expected
        if op == "delete_key":
            return self.delete(_key(args[0]))
        if op == "num_keys":
            return len(self.values)
        raise StoreRejected(f"unknown operation {op[:20]!r}")

    def _multi_get(self, keys: list[str]) -> list[bytes] | None:
        """The values of ``keys`` (``None`` while one is missing): as many, from the first,
        as one reply holds; the client asks again for the rest."""
        try:
            found = list(map(self.values.__getitem__, keys))
        except KeyError:
            return None
        if sum(map(len, found)) + _ITEM_OVERHEAD * len(found) <= MAX_VALUE_BYTES:
            return found
        size = 0
        for i, value in enumerate(found):
            size += len(value) + _ITEM_OVERHEAD
            if i and size > MAX_VALUE_BYTES:
                return found[:i]
        return found


class StoreServer:
    """Serve an authenticated rendezvous store from a thread of its own.

    Args:
        secret: The job's secret.
        job_id: Requests for other jobs are refused.
        host: Interface to listen on (the coordinator's: never every interface by default).
        port: 0 for a port the OS picks.
        max_total_bytes: Bound on all values together.
        max_sessions: Bound on live client sessions.
    """

    def __init__(
        self,
        secret: bytes,
        job_id: str,
        host: str,
        port: int = 0,
        *,
        max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
    ) -> None:
        self._key = _store_key(secret)
        self.job_id = job_id
        self._data = _Data(max_total_bytes)
        self._lock = threading.Lock()
        self._sessions: dict[bytes, tuple[int, float]] = {}
        self._max_sessions = max_sessions
        self.drops = DropLog(logger)
        self.served = 0
        self.served_ops: collections.Counter[str] = collections.Counter()
        """Requests answered, by operation."""
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        harden_socket(self._sock)
        # A request may carry a full value, which is above the control plane's frame limit.
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES + 64)
        self._sock.setsockopt(zmq.LINGER, 0)
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.host = host
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="p2p-store", daemon=True)

    def start(self) -> StoreServer:
        """Start serving; returns ``self``."""
        self._thread.start()
        return self

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread and close the socket (idempotent)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning("the rendezvous store thread did not stop within %.0fs", timeout_s)
                return
        if not self._sock.closed:
            self._sock.close(linger=0)
            self._ctx.term()

    def __enter__(self) -> StoreServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def delete_prefix(self, prefix: str) -> int:
        """Drop every key under ``prefix`` (a finished generation's); returns how many."""
        with self._lock:
            keys = [k for k in self._data.values if k.startswith(prefix)]
            for k in keys:
                self._data.delete(k)
        return len(keys)

    @property
    def total_bytes(self) -> int:
        """Bytes held by keys and values."""
        return self._data.total_bytes

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        last_sweep = time.monotonic()
        try:
            while not self._stop.is_set():
                if not poller.poll(100):
                    continue
                while True:
                    try:
                        frames = self._sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._handle(frames)
                if time.monotonic() - last_sweep > FRESHNESS_S / 10:
                    self._forget_idle_sessions()
                    last_sweep = time.monotonic()
        except Exception:
            # Nothing a peer sends reaches here (every request is checked in _handle); a bug
            # must not pass silently.
            logger.exception("the rendezvous store thread failed")
            raise

    def _forget_idle_sessions(self) -> None:
        cutoff = time.monotonic() - 2 * FRESHNESS_S
        for sid in [s for s, (_, used) in self._sessions.items() if used < cutoff]:
            del self._sessions[sid]

    def _handle(self, frames: list[bytes]) -> None:
        if len(frames) < 2:
            self.drops.drop("store request without a routing identity")
            return
        routing, body = frames[0], frames[1:]
        try:
            doc = _verify(self._key, body, MAX_REQUEST_BYTES)
            sid, seq = self._admit(doc)
            op, args = doc.get("op"), doc.get("args")
            if not isinstance(op, str) or op not in _OPS or not isinstance(args, list):
                raise StoreRejected("malformed operation")
        except StoreRejected as e:
            self.drops.drop(f"rendezvous store: {e}")
            return
        try:
            with self._lock:
                result, error = self._data.apply(op, args), None
        except (StoreRejected, IndexError) as e:
            result, error = None, str(e) or "malformed arguments"
        self.served += 1
        self.served_ops[op] += 1
        reply = {"v": STORE_VERSION, "sid": sid, "seq": seq, "result": result, "error": error}
        payload = msgpack.packb(reply, use_bin_type=True)
        try:
            self._sock.send_multipart([routing, *_sign(self._key, payload)], zmq.NOBLOCK)
        except zmq.Again:
            self.drops.drop("rendezvous store: a client is not reading its replies")

    def _admit(self, doc: dict[str, Any]) -> tuple[bytes, int]:
        if doc.get("job") != self.job_id:
            raise StoreRejected("request of another job")
        sid, seq, sent_ns = doc.get("sid"), _int(doc, "seq"), _int(doc, "ts")
        if not isinstance(sid, bytes) or len(sid) != 16:
            raise StoreRejected("malformed session")
        if abs(sent_ns - time.time_ns()) > FRESHNESS_S * 1e9:
            raise StoreRejected("stale request (an old run's frame, or a clock off)")
        last = self._sessions.get(sid)
        if last is None and len(self._sessions) >= self._max_sessions:
            raise StoreRejected(f"too many sessions ({self._max_sessions}); refusing a new one")
        if last is not None and seq <= last[0]:
            raise StoreRejected(f"replayed or reordered request (seq {seq})")
        self._sessions[sid] = (seq, time.monotonic())
        return sid, seq
