"""Admission to the coordinator's socket: a cap on connections that have not authenticated, and
a message quota per connection.

ZeroMQ has no connection limit of its own, so the cap is built from two of its hooks: the
socket's monitor reports every connection accepted and closed (the count of live ones), and a
ZAP handler (RFC 27, the NULL mechanism with a ZAP domain) is asked about every new connection
once its handshake is done, and may refuse it. A connection is *authenticated* once a signed
hello of this run came on it (:attr:`launcher.coordinator.Coordinator.routes`); the others are
capped. A refused peer's socket reconnects later on its own, so a real process is admitted as
soon as the idle connections close (or it said hello before the flood: it is never refused).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

logger = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
"""Where libzmq sends ZAP requests (RFC 27): one handler per context."""
ZAP_DOMAIN = b"p2p"
_POLL_MS = 100


class RateLimitedLog:
    """A warning logged in full the first time in each window, then only counted.

    Args:
        logger_: Where to log.
        window_s: At most one line per window (plus the count of those not logged).
    """

    def __init__(self, logger_: logging.Logger, window_s: float = 10.0) -> None:
        self._logger = logger_
        self._window_s = window_s
        self._last = -float("inf")
        self._suppressed = 0

    def warning(self, message: str, *args: Any) -> bool:
        """Log ``message`` unless one was logged within the window; returns whether it did."""
        now = time.monotonic()
        if now - self._last < self._window_s:
            self._suppressed += 1
            return False
        if self._suppressed:
            message += f" ({self._suppressed} more like it in the last {self._window_s:.0f}s)"
        self._logger.warning(message, *args)
        self._last, self._suppressed = now, 0
        return True


class ConnectionGate:
    """Refuses a new connection while ``max_unauthenticated`` live ones said no hello.

    Call :meth:`install` on the ROUTER socket before it binds; the gate answers ZAP requests
    in a thread of its own until :meth:`close`.

    Args:
        ctx: The socket's context (ZAP is per context).
        max_unauthenticated: The cap.
        num_authenticated: How many connections have said an accepted hello (read from the
            gate's thread: a length, read atomically).
    """

    def __init__(
        self,
        ctx: zmq.Context[Any],
        max_unauthenticated: int,
        num_authenticated: Callable[[], int],
    ) -> None:
        self.max_unauthenticated = max_unauthenticated
        self._num_authenticated = num_authenticated
        self._zap = ctx.socket(zmq.REP)
        self._zap.setsockopt(zmq.LINGER, 0)
        self._zap.bind(ZAP_ENDPOINT)
        self._monitor: zmq.Socket[Any] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="connection-gate", daemon=True)
        self._log = RateLimitedLog(logger)
        self.live = 0
        """Connections open now."""
        self.refused = 0
        """Connections refused so far."""

    def install(self, sock: zmq.Socket[Any]) -> None:
        """Watch ``sock`` (before it binds) and start answering."""
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        self._monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._thread.start()

    @property
    def unauthenticated(self) -> int:
        """Live connections that have said no accepted hello (never below 0)."""
        return max(0, self.live - self._num_authenticated())

    def _count_events(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        assert self._monitor is not None
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            if event == zmq.EVENT_ACCEPTED:
                self.live += 1
            elif event == zmq.EVENT_DISCONNECTED:
                self.live = max(0, self.live - 1)

    def _answer(self) -> None:
        request = self._zap.recv_multipart()
        version, request_id, address = request[0], request[1], request[3]
        self._count_events()  # this connection's accept is reported before its handshake
        # The connection asking is one of the live ones: it is refused when it would go over.
        over = self.unauthenticated > self.max_unauthenticated
        if over:
            self.refused += 1
            self._log.warning(
                "refused a connection from %s: %d connections are open that said no hello "
                "(the cap, CoordinatorConfig.max_unauthenticated_connections, is %d)",
                address.decode(errors="replace"),
                self.unauthenticated,
                self.max_unauthenticated,
            )
        status = [b"400", b"too many unauthenticated connections"] if over else [b"200", b"OK"]
        self._zap.send_multipart([version, request_id, *status, b"", b""])

    def _run(self) -> None:
        assert self._monitor is not None
        poller = zmq.Poller()
        poller.register(self._zap, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(_POLL_MS))
                if self._monitor in ready:
                    self._count_events()
                if self._zap in ready:
                    self._answer()
        except zmq.ContextTerminated:
            pass
        except Exception:  # the gate must not die silently: every connection would hang
            logger.exception("the connection gate failed; new connections wait for ZAP")
        finally:
            self._zap.close(linger=0)
            self._monitor.close(linger=0)

    def close(self) -> None:
        """Stop answering (before the socket's context ends)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)


class Quota:
    """A message rate quota per connection (a token bucket per routing id).

    Checked before a message's tag is verified, so a connection flooding frames costs one
    dictionary look-up per frame beyond its quota, not an HMAC.

    Args:
        per_s: Messages a connection may send per second, sustained.
        burst: Messages it may send at once.
        max_tracked: Connections tracked at most (full buckets are forgotten beyond it).
    """

    def __init__(self, per_s: float, burst: float, max_tracked: int = 100_000) -> None:
        self.per_s = per_s
        self.burst = burst
        self.max_tracked = max_tracked
        self._buckets: dict[bytes, list[float]] = {}

    def allow(self, routing: bytes, now: float) -> bool:
        """Whether connection ``routing`` may send one more message now (spends a token)."""
        bucket = self._buckets.get(routing)
        if bucket is None:
            if len(self._buckets) >= self.max_tracked:
                self._forget_full(now)
            bucket = self._buckets[routing] = [self.burst, now]
        tokens = min(self.burst, bucket[0] + (now - bucket[1]) * self.per_s)
        bucket[1] = now
        if tokens < 1.0:
            bucket[0] = tokens
            return False
        bucket[0] = tokens - 1.0
        return True

    def _forget_full(self, now: float) -> None:
        refill_s = self.burst / self.per_s
        self._buckets = {r: b for r, b in self._buckets.items() if now - b[1] < refill_s}
        if len(self._buckets) >= self.max_tracked:  # all busy: the oldest half goes
            keep = sorted(self._buckets.items(), key=lambda rb: rb[1][1])[self.max_tracked // 2 :]
            self._buckets = dict(keep)
