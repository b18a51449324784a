"""Peer fetch: a node that joins with no cache copies it from a peer node, segment by segment.

A :class:`SegmentServer` on any node that has the cache answers two requests over a ZeroMQ
ROUTER socket: the cache header, and segment ``i``. Every reply is ``[tag, meta, data]`` with an
HMAC-SHA256 (the job secret) over meta and data, checked with ``hmac.compare_digest`` before
anything is decoded. :func:`fetch_cache` checks the header's fingerprint against the source it
expects, checks every segment's CRC against the header, asks again for a segment that arrives
corrupted (up to ``retries`` times) and publishes the cache atomically like a local build. The
address of a peer comes from the caller (the control plane knows which nodes hold the cache).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
import zlib
from pathlib import Path

import msgpack
import numpy as np
import zmq

from dataload.cache import (
    HEADER_BYTES,
    CacheConfig,
    CacheHeader,
    FileLock,
    SampleCache,
    write_cache,
)

logger = logging.getLogger(__name__)


class PeerFetchError(RuntimeError):
    """The cache could not be fetched from the peer (after retries, or within the deadline)."""


def pack_reply(secret: bytes, meta: dict, data: bytes = b"") -> list[bytes]:
    """``[tag, meta, data]`` with the tag over meta and data."""
    m = msgpack.packb(meta)
    return [hmac.new(secret, m + data, hashlib.sha256).digest(), m, data]


def unpack_reply(secret: bytes, frames: list[bytes]) -> tuple[dict, bytes]:
    """Verify and split a reply; ``PeerFetchError`` if it is forged or malformed."""
    if len(frames) != 3:
        raise PeerFetchError(f"malformed reply ({len(frames)} frames)")
    tag, m, data = frames
    if not hmac.compare_digest(tag, hmac.new(secret, m + data, hashlib.sha256).digest()):
        raise PeerFetchError("reply failed authentication (wrong secret or tampered)")
    return msgpack.unpackb(m), data


class SegmentServer:
    """Serves one cache's header and segments until closed (a background thread)."""

    def __init__(self, cache: SampleCache, secret: bytes, host: str = "127.0.0.1") -> None:
        self.cache, self.secret = cache, secret
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{self.port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="p2p-segment-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        header = self.cache.header.encode()
        while not self._stop.is_set():
            if not self._sock.poll(100):
                continue
            ident, *frames = self._sock.recv_multipart()
            try:
                req = msgpack.unpackb(frames[-1])
                if req.get("what") == "header":
                    reply = pack_reply(self.secret, {"what": "header"}, header)
                else:
                    i = int(req["segment"])
                    data = bytes(self.cache.segment_bytes(i))
                    reply = pack_reply(self.secret, {"what": "segment", "segment": i}, data)
            except Exception as e:
                logger.warning("bad segment request: %r", e)
                reply = pack_reply(self.secret, {"what": "error", "reason": repr(e)})
            self._sock.send_multipart([ident, b"", *reply])

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
    sock.connect(address)

    def ask(req: dict) -> tuple[dict, bytes]:
        sock.send_multipart([b"", msgpack.packb(req)])
        if not sock.poll(timeout_s * 1000):
            raise PeerFetchError(f"no answer from {address} within {timeout_s:.0f}s")
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
    path.parent.mkdir(parents=True, exist_ok=True)
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
