"""The client side of the authenticated rendezvous store (:mod:`launcher.store`).

A Python subclass of :class:`torch.distributed.Store`, so every process-group constructor takes
it; kept apart from the server so the coordinator never needs torch.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import msgpack
import torch.distributed as dist
import zmq
from torch.distributed.distributed_c10d import Store

from launcher.store import (
    MAX_REQUEST_BYTES,
    STORE_VERSION,
    StoreRejected,
    _sign,
    _store_key,
    _verify,
)

logger = logging.getLogger(__name__)

_SLICE_MS = 50
"""Longest a blocked call goes without checking whether :meth:`SignedStore.close` was called."""


class SignedStore(Store):
    """The client side: a :class:`torch.distributed.Store` for process-group constructors.

    Thread-safe (one request at a time). Blocking calls (``get`` of a missing key, ``wait``)
    poll with a backoff until the store's timeout and then raise
    :class:`torch.distributed.DistStoreError` naming the keys.

    Args:
        host: The server's host.
        port: The server's port.
        secret: The job's secret.
        job_id: The job's id.
        timeout: Deadline of every blocking call (and of every single reply).

    Attributes:
        observer: Called as ``observer(key, value, written=...)`` with every value this client
            writes (``set``) or reads (``get``, ``multi_get``): how the groups made over this
            store learn their members' addresses (:class:`recovery.gloo_pairs.GlooPairs`).
            It must not raise.
    """

    def __init__(
        self, host: str, port: int, secret: bytes, job_id: str, timeout: timedelta
    ) -> None:
        super().__init__()
        self._key = _store_key(secret)
        self._job_id = job_id
        self._timeout = timeout
        self._sid = os.urandom(16)
        self._seq = 0
        self._lock = threading.Lock()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES + 64)
        self._sock.connect(f"tcp://{host}:{port}")
        self._address = f"{host}:{port}"
        self.closed = False
        self._closing = threading.Event()
        self.observer: Callable[..., None] | None = None
        self._written: dict[str, bytes] = {}  # what this client wrote, for a store that moves
        self._known: dict[str, bytes] = {}  # values answered here, without the store (know())
        self._moved_to: tuple[str, int] | None = None

    # -- the wire ------------------------------------------------------------------------------

    def _call(self, op: str, *args: Any) -> Any:
        with self._lock:
            if self._closing.is_set():
                raise dist.DistStoreError("the rendezvous store client is closed")
            self._move_if_asked()
            return self._roundtrip(op, list(args))

    def _roundtrip(self, op: str, args: list[Any]) -> Any:
        """One request and its reply (``_lock`` held)."""
        self._seq += 1
        request = {
            "v": STORE_VERSION,
            "job": self._job_id,
            "sid": self._sid,
            "seq": self._seq,
            "ts": time.time_ns(),
            "op": op,
            "args": args,
        }
        self._sock.send_multipart(_sign(self._key, msgpack.packb(request, use_bin_type=True)))
        deadline = time.monotonic() + self._timeout.total_seconds()
        while True:
            left_ms = int((deadline - time.monotonic()) * 1e3)
            if left_ms <= 0:
                raise dist.DistStoreError(
                    f"no answer from the rendezvous store at {self._address} within "
                    f"{self._timeout.total_seconds():.0f}s (operation {op})"
                )
            # Short slices, so close() from another thread ends a wait promptly.
            if not self._sock.poll(min(left_ms, _SLICE_MS)):
                if self._closing.is_set():
                    raise dist.DistStoreError("the rendezvous store client was closed")
                if self._moved_to is not None:  # ask the store that took over instead
                    self._move_if_asked()
                    return self._roundtrip(op, args)
                continue
            frames = self._sock.recv_multipart()
            try:
                reply = _verify(self._key, frames, MAX_REQUEST_BYTES)
            except StoreRejected as e:
                logger.warning("dropped a reply from the rendezvous store: %s", e)
                continue
            if reply.get("sid") != self._sid or reply.get("seq") != self._seq:
                continue  # not the answer to this request (a late one, or a replay)
            if reply.get("error") is not None:
                raise dist.DistStoreError(f"rendezvous store refused {op}: {reply['error']}")
            return reply.get("result")

    def move_to(self, host: str, port: int) -> None:
        """The store moved (a standby coordinator took over and serves a new, empty one): send
        every request there from now on, once the keys this client wrote are written there
        again, so that peers can still read them (a gloo pair first used later reads its
        peer's address). A request waiting for the old store is sent again to the new one.
        Thread-safe; returns once moved (after the call in progress, if any)."""
        self._moved_to = (host, port)
        with self._lock:
            if not self._closing.is_set():
                self._move_if_asked()

    def _move_if_asked(self) -> None:
        """Move to the store :meth:`move_to` named, if it named one (``_lock`` held)."""
        target, self._moved_to = self._moved_to, None
        if target is None:
            return
        host, port = target
        self._sock.close(linger=0)
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES + 64)
        self._sock.connect(f"tcp://{host}:{port}")
        self._address = f"{host}:{port}"
        for key, value in self._written.items():
            self._roundtrip("set", [key, value])
        logger.info(
            "the rendezvous store moved to %s (%d keys written again)",
            self._address,
            len(self._written),
        )

    def _poll_until(self, what: str, ready: Any, timeout: timedelta | None = None) -> Any:
        budget = (timeout or self._timeout).total_seconds()
        deadline = time.monotonic() + budget
        pause_s = 0.001
        while True:
            result = ready()
            if result is not None and result is not False:
                return result
            if self._closing.is_set():
                raise dist.DistStoreError("the rendezvous store client was closed")
            if time.monotonic() >= deadline:
                raise dist.DistStoreError(
                    f"timed out after {budget:.0f}s waiting for {what} in the rendezvous store "
                    f"at {self._address}"
                )
            self._closing.wait(min(pause_s, max(0.0, deadline - time.monotonic())))
            pause_s = min(pause_s * 2, 0.05)

    def close(self) -> None:
        """Close the socket (idempotent, thread-safe); a call in progress and later ones raise.

        For an abort: a rank blocked in a rendezvous (a ``get`` of a key that a dead member
        would have written) returns within :data:`_SLICE_MS` instead of at the timeout.
        """
        self._closing.set()
        with self._lock:  # the call in progress notices the flag and lets go
            if not self.closed:
                self.closed = True
                self._sock.close(linger=0)
                self._ctx.term()

    # -- torch.distributed.Store ---------------------------------------------------------------

    def know(self, values: dict[str, bytes]) -> None:
        """Answer reads of these keys here from now on, without asking the store: for a store
        that no longer answers (every coordinator is lost), values obtained another way."""
        self._known.update(values)

    def set(self, key: str, value: Any) -> None:
        data = _as_bytes(value)
        self._written[key] = data  # first: a move during the call writes it again
        self._call("set", key, data)
        if self.observer is not None:
            self.observer(key, data, written=True)

    def get(self, key: str) -> bytes:
        value = self._known.get(key)
        if value is None:
            value = self._poll_until(f"key {key!r}", lambda: self._call("get", key))
        if self.observer is not None:
            self.observer(key, value, written=False)
        return value

    def add(self, key: str, amount: int) -> int:
        return int(self._call("add", key, int(amount)))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        value: bytes = self._call("compare_set", key, _as_bytes(expected), _as_bytes(desired))
        return value

    def check(self, keys: list[str]) -> bool:
        if all(k in self._known for k in keys):
            return True
        return bool(self._call("check", list(keys)))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if all(k in self._known for k in keys):
            return
        self._poll_until(f"keys {list(keys)!r}", lambda: self._call("check", list(keys)), timeout)

    def delete_key(self, key: str) -> bool:
        return bool(self._call("delete_key", key))

    def num_keys(self) -> int:
        return int(self._call("num_keys"))

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    # The extended API: gloo reads a whole group's addresses with one ``multi_get`` per 128
    # ranks when the store has it (and ``GLOO_ENABLE_STORE_V2_API`` is set), not one ``get``
    # per rank.

    def has_extended_api(self) -> bool:
        return True

    def append(self, key: str, value: Any) -> None:
        self._call("append", key, _as_bytes(value))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """The values of ``keys``, once every one of them is set (within the store's timeout)."""
        keys = list(keys)
        values: list[bytes] = []
        if all(k in self._known for k in keys):
            values = [self._known[k] for k in keys]
        while len(values) < len(keys):  # more than one reply holds: the rest, page by page
            rest = keys[len(values) :]
            what = f"{len(rest)} keys from {rest[0]!r}"
            values += self._poll_until(what, lambda rest=rest: self._call("multi_get", rest))
        if self.observer is not None:
            for key, value in zip(keys, values, strict=True):
                self.observer(key, value, written=False)
        return values

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"multi_set of {len(keys)} keys with {len(values)} values")
        data = [_as_bytes(v) for v in values]
        self._written.update(zip(keys, data, strict=True))
        self._call("multi_set", list(keys), data)


def _as_bytes(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, list):  # torch passes std::vector<uint8_t> as a list of ints
        return bytes(value)
    raise TypeError(f"store values are bytes or str, not {type(value).__name__}")
