"""The node-local sample cache: fixed-size samples in one memory-mapped file.

File layout: a 64 KiB header (magic, a 4-byte length, then msgpack: format version, dtype, sample
shape, sample count, source fingerprint, segment size and one CRC-32 per segment), then the
samples back to back. One rank of a node builds it under a file lock while the others wait; the
file is written under a temporary name, fsynced and renamed into place, so a reader never sees a
torn file. Opening checks the header, the size (truncation), the fingerprint (another source or
tokenizer) and every segment's CRC; a cache failing any check is rebuilt, with a log line that
says why, and never read. The cache lives in ``/dev/shm`` by default, so it outlives the process
that built it: a replacement rank maps it in milliseconds.

``/dev/shm`` is writable by every local user, so the cache directory is private (0700, owned by
this user, not a symlink; anything else is refused with the fix) and every file in it is created
with ``O_EXCL | O_NOFOLLOW`` under an unpredictable name: a planted symlink is never written
through.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import stat
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import msgpack
import numpy as np

logger = logging.getLogger(__name__)

MAGIC = b"P2PCACHE"
FORMAT_VERSION = 1
HEADER_BYTES = 64 * 1024


class CacheInvalid(ValueError):
    """A cache file that must not be read; ``reason`` says why."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheConfig:
    """Where the node's cache lives and how it is built."""

    directory: str = field(default_factory=lambda: f"/dev/shm/p2p-cache-{os.getuid()}")
    """Node-local storage (``/dev/shm`` survives process replacement, not a reboot); a private
    directory of this user (created 0700 if missing)."""
    name: str = "dataset"
    segment_samples: int = 4096
    """Samples per checksummed segment (also the unit a peer fetch moves)."""
    lock_timeout_s: float = 600.0
    """How long a rank waits for another rank of its node to finish building."""

    def __post_init__(self) -> None:
        if self.segment_samples < 1:
            raise ValueError(
                f"CacheConfig.segment_samples must be >= 1, got {self.segment_samples}"
            )
        if not self.name or "/" in self.name:
            raise ValueError(f"CacheConfig.name={self.name!r} must be a plain file name")

    @property
    def path(self) -> Path:
        """The cache file."""
        return Path(self.directory) / f"{self.name}.p2pcache"


@dataclass(frozen=True, slots=True)
class CacheHeader:
    """What a cache file holds."""

    dtype: str
    shape: tuple[int, ...]
    count: int
    fingerprint: str
    segment_samples: int
    segment_crcs: tuple[int, ...] = field(default=())

    @property
    def sample_bytes(self) -> int:
        """Bytes per sample."""
        return int(np.dtype(self.dtype).itemsize * np.prod(self.shape, dtype=np.int64))

    @property
    def num_segments(self) -> int:
        """Number of segments."""
        return -(-self.count // self.segment_samples)

    def segment_range(self, i: int) -> tuple[int, int]:
        """Byte range ``[start, end)`` of segment ``i`` within the data region."""
        start = i * self.segment_samples * self.sample_bytes
        end = min(self.count, (i + 1) * self.segment_samples) * self.sample_bytes
        return start, end

    def encode(self) -> bytes:
        """The header region (``HEADER_BYTES`` long)."""
        body = msgpack.packb(
            [
                FORMAT_VERSION,
                self.dtype,
                list(self.shape),
                self.count,
                self.fingerprint,
                self.segment_samples,
                list(self.segment_crcs),
            ]
        )
        if len(body) + len(MAGIC) + 4 > HEADER_BYTES:
            raise ValueError(
                f"cache header of {len(body)} bytes does not fit in {HEADER_BYTES}; raise "
                "CacheConfig.segment_samples (fewer, larger segments)"
            )
        raw: bytes = MAGIC + len(body).to_bytes(4, "little") + body
        return raw + b"\0" * (HEADER_BYTES - len(raw))

    @classmethod
    def decode(cls, raw: bytes) -> CacheHeader:
        """Parse a header region; :class:`CacheInvalid` for anything off."""
        if len(raw) < HEADER_BYTES or raw[: len(MAGIC)] != MAGIC:
            raise CacheInvalid("not a cache file (bad magic or short header)")
        n = int.from_bytes(raw[len(MAGIC) : len(MAGIC) + 4], "little")
        try:
            version, dtype, shape, count, fp, seg, crcs = msgpack.unpackb(
                raw[len(MAGIC) + 4 : len(MAGIC) + 4 + n]
            )
        except Exception as e:
            raise CacheInvalid(f"unreadable header: {e}") from None
        if version != FORMAT_VERSION:
            raise CacheInvalid(f"format version {version}, expected {FORMAT_VERSION}")
        return cls(dtype, tuple(shape), count, fp, seg, tuple(crcs))


class SampleCache:
    """A validated, read-only memory map of a cache file."""

    def __init__(self, path: Path, header: CacheHeader) -> None:
        self.path = path
        self.header = header
        self._mm = np.memmap(
            path,
            dtype=np.uint8,
            mode="r",
            offset=HEADER_BYTES,
            shape=(header.count * header.sample_bytes,),
        )
        self.samples = self._mm.view(header.dtype).reshape(header.count, *header.shape)

    def __len__(self) -> int:
        return self.header.count

    def __getitem__(self, i: int) -> np.ndarray:
        sample: np.ndarray = self.samples[i]
        return sample

    def segment_bytes(self, i: int) -> memoryview:
        """The bytes of segment ``i`` (what a peer fetch serves)."""
        start, end = self.header.segment_range(i)
        return memoryview(self._mm[start:end].data)


_NOFOLLOW = os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def private_dir(directory: Path) -> None:
    """Create ``directory`` (0700) or check an existing one is this user's private directory.

    Raises:
        ValueError: it is a symlink, not a directory, owned by another user, or open to others
            (one line with the fix).
    """
    directory.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(directory)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise ValueError(
            f"cache directory {directory} is a symlink or not a directory; remove it or set "
            "CacheConfig.directory to a directory of your own"
        )
    if st.st_uid != os.getuid():
        raise ValueError(
            f"cache directory {directory} belongs to uid {st.st_uid}, not to this user; set "
            "CacheConfig.directory to a directory of your own"
        )
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(directory, 0o700)  # ours: close it (a directory made by an earlier version)


def _open_new(path: Path) -> int:
    """Create ``path`` exclusively (0600), never through a symlink."""
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)


def _crc_segments(data: np.ndarray, header: CacheHeader) -> list[int]:
    segments = (data[slice(*header.segment_range(i))] for i in range(header.num_segments))
    return [zlib.crc32(segment.data) for segment in segments]


def validate(path: Path, fingerprint: str) -> CacheHeader:
    """Check a cache file completely (header, size, fingerprint, every segment's CRC).

    Raises:
        CacheInvalid: with the reason it must not be used.
    """
    if not path.exists() and not path.is_symlink():
        raise CacheInvalid("no cache file")
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    except OSError as e:
        raise CacheInvalid(f"cannot open it without following links: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise CacheInvalid("not a regular file")
        header = CacheHeader.decode(f.read(HEADER_BYTES))
    expected = HEADER_BYTES + header.count * header.sample_bytes
    if path.stat().st_size != expected:
        raise CacheInvalid(f"truncated or padded: {path.stat().st_size} bytes, expected {expected}")
    if header.fingerprint != fingerprint:
        raise CacheInvalid(
            f"built from another source (fingerprint {header.fingerprint[:12]}, expected "
            f"{fingerprint[:12]})"
        )
    data = np.memmap(
        path, dtype=np.uint8, mode="r", offset=HEADER_BYTES, shape=(expected - HEADER_BYTES,)
    )
    crcs = _crc_segments(data, header)
    bad = [i for i, (a, b) in enumerate(zip(crcs, header.segment_crcs)) if a != b]
    if bad or len(crcs) != len(header.segment_crcs):
        raise CacheInvalid(f"checksum mismatch in segments {bad[:5]}")
    return header


def write_cache(
    path: Path,
    fingerprint: str,
    dtype: str,
    shape: tuple[int, ...],
    count: int,
    fill: Callable[[np.ndarray], None],
    segment_samples: int,
) -> CacheHeader:
    """Write a cache atomically: fill a temporary file, checksum it, fsync, rename into place.

    ``fill(samples)`` writes all ``count`` samples into the given ``(count, *shape)`` array.
    """
    header = CacheHeader(dtype, tuple(shape), count, fingerprint, segment_samples)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    size = HEADER_BYTES + count * header.sample_bytes
    with os.fdopen(_open_new(tmp), "wb") as f:
        f.truncate(size)
    try:
        mm = np.memmap(
            tmp, dtype=np.uint8, mode="r+", offset=HEADER_BYTES, shape=(size - HEADER_BYTES,)
        )
        fill(mm.view(dtype).reshape(count, *shape))
        header = CacheHeader(
            dtype,
            tuple(shape),
            count,
            fingerprint,
            segment_samples,
            tuple(_crc_segments(mm, header)),
        )
        mm.flush()
        del mm
        with os.fdopen(os.open(tmp, os.O_RDWR | _NOFOLLOW), "r+b") as f:
            f.write(header.encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    finally:
        tmp.unlink(missing_ok=True)
    return header


class FileLock:
    """An exclusive ``flock`` with a deadline (the lock dies with its holder's process)."""

    def __init__(self, path: Path, timeout_s: float) -> None:
        self.path, self.timeout_s = path, timeout_s

    def __enter__(self) -> FileLock:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o600)
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            if time.monotonic() > deadline:
                os.close(self.fd)
                raise TimeoutError(
                    f"waited {self.timeout_s:.0f}s for another rank to build {self.path.stem} "
                    "(CacheConfig.lock_timeout_s)"
                )
            time.sleep(0.01)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


Build = Callable[[], tuple[str, tuple[int, ...], int, Callable[[np.ndarray], None]]]
"""What builds a cache: ``() -> (dtype, sample shape, count, fill)``."""


class Source(Protocol):
    """A data source the cache is built from (:mod:`dataload.sources`)."""

    @property
    def fingerprint(self) -> str:
        """A hash of everything that determines the samples."""
        ...

    def build(self) -> tuple[str, tuple[int, ...], int, Callable[[np.ndarray], None]]:
        """``(dtype, sample shape, count, fill)``: what :func:`open_or_build` calls."""
        ...


def open_or_build(
    config: CacheConfig,
    fingerprint: str,
    make: Build,
) -> SampleCache:
    """Map the node's cache, building it first if it is missing or fails validation.

    Every rank of a node may call this at once: one builds (under the lock), the others wait
    for it and then map the result.

    Args:
        config: Location and segment size.
        fingerprint: Identifies the source and its processing (see :mod:`dataload.sources`).
        make: Returns ``(dtype, sample shape, count, fill)``; called only when building, so
            reading and tokenising the source happen on one rank of the node, once.
    """
    path = config.path
    private_dir(path.parent)
    with FileLock(path.with_name(path.name + ".lock"), config.lock_timeout_s):
        try:
            header = validate(path, fingerprint)
        except CacheInvalid as e:
            if path.exists():
                logger.warning("rebuilding the data cache %s: %s", path, e)
            dtype, shape, count, fill = make()
            header = write_cache(
                path, fingerprint, dtype, shape, count, fill, config.segment_samples
            )
            logger.info("built the data cache %s (%d samples)", path, count)
    return SampleCache(path, header)


def open_source(config: CacheConfig, source: Source) -> SampleCache:
    """:func:`open_or_build` for a source of :mod:`dataload.sources`."""
    return open_or_build(config, source.fingerprint, source.build)
