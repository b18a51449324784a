"""Peer fetch: a node that joins with no cache copies it from a peer node, segment by segment.

A :class:`SegmentServer` on any node that has the cache answers two requests over a ZeroMQ
ROUTER socket: the cache header, and segment ``i``. Every request is ``[tag, req]`` and every
reply ``[tag, meta, data]``, each with an HMAC-SHA256 (the job secret, domain-separated so a
reply can never pass as a request) checked with ``hmac.compare_digest`` before anything is
decoded: a party without the secret gets nothing. A request carries its send time and is
refused outside :data:`REQUEST_FRESHNESS_S`; the segment index must be an integer in range (no
negative wrap-around); the server's sockets take frames of at most :data:`MAX_REQUEST_BYTES`
and the client's at most :data:`MAX_REPLY_BYTES`. :func:`fetch_cache` checks the header's
fingerprint against the source it expects, checks every segment's CRC against the header, asks
again for a segment that arrives corrupted (up to ``retries`` times) and publishes the cache
atomically like a local build. The address of a peer comes from the caller (the control plane
knows which nodes hold the cache).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq

from dataload.cache import (
    HEADER_BYTES,
    CacheConfig,
    CacheHeader,
    FileLock,
    SampleCache,
    private_dir,
    write_cache,
)

logger = logging.getLogger(__name__)


MAX_REQUEST_BYTES = 1024
"""A request is a tiny map; a peer announcing a bigger frame is disconnected by libzmq."""
MAX_REPLY_BYTES = 1 << 30
"""Largest reply frame a fetching node accepts (one segment; see CacheConfig.segment_samples)."""
REQUEST_FRESHNESS_S = 120.0
"""How far a request's send time may be from the server's clock (a captured one goes stale)."""
_REQUEST_DOMAIN = b"p2p-peer-fetch-request\0"
_REPLY_DOMAIN = b"p2p-peer-fetch-reply\0"


class PeerFetchError(RuntimeError):
    """The cache could not be fetched from the peer (after retries, or within the deadline)."""


def _tag(secret: bytes, domain: bytes, m: bytes, data: bytes = b"") -> bytes:
    mac = hmac.new(secret, domain, hashlib.sha256)
    mac.update(len(m).to_bytes(8, "little"))
    mac.update(m)
    mac.update(data)
    return mac.digest()


def pack_reply(secret: bytes, meta: dict[str, Any], data: bytes = b"") -> list[bytes]:
    """``[tag, meta, data]`` with the tag over meta and data."""
    m = msgpack.packb(meta)
    return [_tag(secret, _REPLY_DOMAIN, m, data), m, data]


def unpack_reply(secret: bytes, frames: list[bytes]) -> tuple[dict[str, Any], bytes]:
    """Verify and split a reply; ``PeerFetchError`` if it is forged or malformed."""
    if len(frames) != 3:
        raise PeerFetchError(f"malformed reply ({len(frames)} frames)")
    tag, m, data = frames
    if not hmac.compare_digest(tag, _tag(secret, _REPLY_DOMAIN, m, data)):
        raise PeerFetchError("reply failed authentication (wrong secret or tampered)")
    try:
        meta = msgpack.unpackb(m)
    except Exception as e:
        raise PeerFetchError(f"undecodable reply: {type(e).__name__}") from None
    if not isinstance(meta, dict):
        raise PeerFetchError("malformed reply (meta is not a map)")
    return meta, data


def pack_request(secret: bytes, req: dict[str, Any]) -> list[bytes]:
    """``[tag, req]``: a signed request, stamped with its send time."""
    m = msgpack.packb({**req, "t": time.time()})
    return [_tag(secret, _REQUEST_DOMAIN, m), m]


def unpack_request(secret: bytes, frames: list[bytes], num_segments: int) -> dict[str, Any]:
    """Verify and check a request; ``ValueError`` naming what is wrong.

    Returns:
        ``{"what": "header"}`` or ``{"what": "segment", "segment": i}`` with ``0 <= i <
        num_segments``.
    """
    if len(frames) != 2:
        raise ValueError(f"malformed request ({len(frames)} frames)")
    tag, m = frames
    if not hmac.compare_digest(tag, _tag(secret, _REQUEST_DOMAIN, m)):
        raise ValueError("request failed authentication")
    try:
        req = msgpack.unpackb(m)
    except Exception as e:
        raise ValueError(f"undecodable request: {type(e).__name__}") from None
    if not isinstance(req, dict):
        raise ValueError("request is not a map")
    sent = req.get("t")
    if isinstance(sent, bool) or not isinstance(sent, (int, float)):
        raise ValueError("request has no send time")
    if not abs(time.time() - sent) <= REQUEST_FRESHNESS_S:
        raise ValueError("stale request (replayed, or a clock far off)")
    if req.get("what") == "header":
        return {"what": "header"}
    i = req.get("segment")
    if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_segments:
        raise ValueError(f"segment index {str(i)[:20]} out of range [0, {num_segments})")
    return {"what": "segment", "segment": i}


class SegmentServer:
    """Serves one cache's header and segments until closed (a background thread)."""

    def __init__(self, cache: SampleCache, secret: bytes, host: str = "127.0.0.1") -> None:
        self.cache, self.secret = cache, secret
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        self._sock.setsockopt(zmq.RCVHWM, 1000)
        self._sock.setsockopt(zmq.HANDSHAKE_IVL, 5_000)  # half-open connections do not linger
        # Replies to a peer that does not read are dropped, not queued without bound.
        self._sock.setsockopt(zmq.SNDHWM, 4)
        self.dropped = 0
        self.port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{self.port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="p2p-segment-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        header = self.cache.header.encode()
        while not self._stop.is_set():
            try:
                if not self._sock.poll(100):
                    continue
                self._answer(self._sock.recv_multipart(), header)
            except Exception:  # the server outlives any request: log (rate-limited), go on
                self._drop("internal error answering a request", exc_info=True)

    def _answer(self, frames: list[bytes], header: bytes) -> None:
        if len(frames) < 2 or frames[1] != b"":
            self._drop(f"malformed request envelope ({len(frames)} frames)")
            return
        ident, _, *body = frames
        try:
            req = unpack_request(self.secret, body, self.cache.header.num_segments)
        except ValueError as e:
            # Nothing is sent back to an unauthenticated or malformed request.
            self._drop(f"refused a segment request: {e}")
            return
        if req["what"] == "header":
            reply = pack_reply(self.secret, {"what": "header"}, header)
        else:
            i = req["segment"]
            data = bytes(self.cache.segment_bytes(i))
            reply = pack_reply(self.secret, {"what": "segment", "segment": i}, data)
        try:
            self._sock.send_multipart([ident, b"", *reply], zmq.NOBLOCK)
        except zmq.Again:
            self._drop("a peer is not reading its replies; dropped one")

    def _drop(self, reason: str, exc_info: bool = False) -> None:
        self.dropped += 1
        # The first few in full, then one line in a thousand: a flood cannot fill the disk.
        if self.dropped <= 10 or self.dropped % 1000 == 0:
            logger.warning("%s (%d dropped so far)", reason, self.dropped, exc_info=exc_info)

    def close(self) -> None:
        """Stop serving and close the socket."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(linger=0)
        self._ctx.term()


def fetch_cache(
    config: CacheConfig,
    address: str,
    secret: bytes,
    fingerprint: str,
    *,
    timeout_s: float = 30.0,
    retries: int = 3,
) -> SampleCache:
    """Copy a peer's cache into this node's cache location, verified, and map it.

    Raises:
        PeerFetchError: the peer has another dataset, does not answer within ``timeout_s`` per
            request, or a segment stays corrupt after ``retries`` attempts.
    """
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
    sock.connect(address)

    def ask(req: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
        sock.send_multipart([b"", *pack_request(secret, req)])
        if not sock.poll(math.ceil(timeout_s * 1000)):
            raise PeerFetchError(
                f"no answer from {address} within {timeout_s:.0f}s (a peer does not answer a "
                "request signed with another job's secret)"
            )
        return unpack_reply(secret, sock.recv_multipart()[1:])

    try:
        _, raw = ask({"what": "header"})
        header = CacheHeader.decode(raw + b"\0" * max(0, HEADER_BYTES - len(raw)))
        if header.fingerprint != fingerprint:
            raise PeerFetchError(
                f"the peer at {address} caches another dataset (fingerprint "
                f"{header.fingerprint[:12]}, expected {fingerprint[:12]})"
            )
        segments: list[bytes] = []
        for i in range(header.num_segments):
            for attempt in range(1, retries + 1):
                meta, data = ask({"segment": i})
                if meta.get("segment") == i and zlib.crc32(data) == header.segment_crcs[i]:
                    segments.append(data)
                    break
                logger.warning(
                    "segment %d from %s arrived corrupt (attempt %d of %d)",
                    i,
                    address,
                    attempt,
                    retries,
                )
            else:
                raise PeerFetchError(f"segment {i} from {address} corrupt after {retries} tries")
    finally:
        sock.close(linger=0)
        ctx.term()

    def fill(out: np.ndarray) -> None:
        flat = out.reshape(-1).view(np.uint8)
        pos = 0
        for data in segments:
            flat[pos : pos + len(data)] = np.frombuffer(data, dtype=np.uint8)
            pos += len(data)

    path: Path = config.path
    private_dir(path.parent)
    with FileLock(path.with_name(path.name + ".lock"), config.lock_timeout_s):
        written = write_cache(
            path,
            fingerprint,
            header.dtype,
            header.shape,
            header.count,
            fill,
            header.segment_samples,
        )
    if written.segment_crcs != header.segment_crcs:
        raise PeerFetchError("the fetched cache does not match the peer's checksums")
    return SampleCache(path, written)
