"""The layout of one rank's training state in a single flat byte buffer.

A layout is plain data: a list of tensor entries (name, dtype, local shape, byte offset) plus one
fixed-size region for the small non-tensor state (scheduler, optimizer hyper-parameters, step
counters, user extras), encoded with msgpack. Snapshots, replicas and transfers all speak in byte
ranges of this buffer, so a snapshot is a handful of large copies and a replica is one array.

Two hashes guard against exchanging bytes between incompatible ranks:

- ``layout_hash`` covers everything, local shapes and offsets included. It differs between ranks of
  one job when FSDP shards a dimension unevenly, and identifies the bytes of one owner's buffer.
- ``structure_hash`` covers only what every rank of a job must agree on: entry names, dtypes and
  *global* shapes. Ranks with different structure hashes run different models or optimizers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import msgpack
import torch

#: Byte alignment of every entry: a GPU-friendly boundary and a multiple of every dtype size.
ALIGN_BYTES = 256

#: Bumped whenever the encoding of a layout changes.
LAYOUT_FORMAT_VERSION = 1


class LayoutMismatchError(ValueError):
    """Two ranks' layouts disagree, so their bytes cannot be exchanged; or a rank's live tensors
    no longer match the layout it was set up with."""


def _align(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`; raises ``ValueError`` for an unknown dtype."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a state layout")
    return dtype


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of the state, as a byte range of the flat buffer."""

    name: str
    """``param/<fqn>``, ``buffer/<fqn>``, ``optim/<fqn>/<key>`` or ``rng/<device>``."""
    dtype: str
    shape: tuple[int, ...]
    """Local shape (the shard this rank owns)."""
    offset: int
    """Byte offset in the flat buffer (a multiple of ``ALIGN_BYTES``)."""
    global_shape: tuple[int, ...]
    """Shape of the unsharded tensor; equals ``shape`` for replicated tensors."""
    dim0_offset: int = 0
    """Where this shard starts along dim 0 of the global tensor (FSDP shards dim 0)."""

    @property
    def nbytes(self) -> int:
        """Size of the tensor's data in bytes."""
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * dtype_from_name(self.dtype).itemsize

    @property
    def end(self) -> int:
        """One past the last byte of the entry."""
        return self.offset + self.nbytes


@dataclass(frozen=True)
class StateLayout:
    """A rank's whole training state as byte ranges of one flat buffer. Build with :meth:`build`."""

    entries: tuple[TensorEntry, ...]
    blob_offset: int
    """Start of the msgpack region for the non-tensor state (a 4-byte length comes first)."""
    blob_capacity: int
    total_bytes: int
    _index: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", {e.name: i for i, e in enumerate(self.entries)})

    @classmethod
    def build(
        cls,
        specs: Iterable[tuple[str, torch.dtype, Sequence[int], Sequence[int], int]],
        blob_capacity: int,
    ) -> StateLayout:
        """Lay out tensors back to back, each aligned, then the blob region.

        Args:
            specs: ``(name, dtype, local_shape, global_shape, dim0_offset)`` per tensor, in the
                order their bytes are laid out.
            blob_capacity: Bytes reserved for the encoded non-tensor state.
        """
        entries, offset, seen = [], 0, set()
        for name, dtype, shape, global_shape, dim0_offset in specs:
            assert name not in seen, f"duplicate state entry {name}"
            seen.add(name)
            entry = TensorEntry(
                name, dtype_name(dtype), tuple(shape), offset, tuple(global_shape), dim0_offset
            )
            entries.append(entry)
            offset = _align(entry.end)
        blob_offset = offset
        total = _align(blob_offset + blob_capacity)
        return cls(tuple(entries), blob_offset, blob_capacity, total)

    def entry(self, name: str) -> TensorEntry:
        """The entry called ``name``; ``KeyError`` if there is none."""
        return self.entries[self._index[name]]

    @property
    def tensor_bytes(self) -> int:
        """Bytes of tensor data, without alignment padding or the blob region."""
        return sum(e.nbytes for e in self.entries)

    def to_bytes(self) -> bytes:
        """A canonical msgpack encoding (what the hashes are computed over)."""
        packed: bytes = msgpack.packb(
            [
                LAYOUT_FORMAT_VERSION,
                [
                    [e.name, e.dtype, list(e.shape), e.offset, list(e.global_shape), e.dim0_offset]
                    for e in self.entries
                ],
                self.blob_offset,
                self.blob_capacity,
                self.total_bytes,
            ],
            use_bin_type=True,
        )
        return packed

    @classmethod
    def from_bytes(cls, data: bytes) -> StateLayout:
        """Decode :meth:`to_bytes`; ``ValueError`` for anything malformed."""
        try:
            version, raw_entries, blob_offset, blob_capacity, total = msgpack.unpackb(
                data, raw=False
            )
            if version != LAYOUT_FORMAT_VERSION:
                raise ValueError(
                    f"layout format version {version}, expected {LAYOUT_FORMAT_VERSION}"
                )
            entries = tuple(
                TensorEntry(name, dtype, tuple(shape), off, tuple(gshape), d0)
                for name, dtype, shape, off, gshape, d0 in raw_entries
            )
        except (ValueError, TypeError, msgpack.UnpackException) as e:
            raise ValueError(f"malformed state layout: {e}") from e
        layout = cls(entries, blob_offset, blob_capacity, total)
        for entry in entries:
            dtype_from_name(entry.dtype)
            if entry.offset % ALIGN_BYTES or entry.end > blob_offset:
                raise ValueError(f"malformed state layout: entry {entry.name} at {entry.offset}")
        return layout

    @property
    def layout_hash(self) -> str:
        """Identifies this exact byte layout (16 hex digits)."""
        return hashlib.sha256(self.to_bytes()).hexdigest()[:16]

    @property
    def structure_hash(self) -> str:
        """Identifies what all ranks of a job share: names, dtypes, global shapes (16 hex)."""
        desc = msgpack.packb(
            [[e.name, e.dtype, list(e.global_shape)] for e in self.entries] + [self.blob_capacity],
            use_bin_type=True,
        )
        return hashlib.sha256(desc).hexdigest()[:16]

    def describe(self) -> str:
        """One line for logs and errors: hash, entry count and size."""
        return (
            f"layout {self.layout_hash} (structure {self.structure_hash}, "
            f"{len(self.entries)} tensors, {self.total_bytes / 2**20:.2f} MiB)"
        )

    def first_difference(self, other: StateLayout) -> str:
        """A human-readable description of the first place two layouts differ."""
        mine = {e.name: e for e in self.entries}
        theirs = {e.name: e for e in other.entries}
        ordered = [e.name for e in self.entries] + [e.name for e in other.entries]
        for name in dict.fromkeys(ordered):
            a, b = mine.get(name), theirs.get(name)
            if a is None or b is None:
                return f"entry {name!r} exists only in the {'second' if a is None else 'first'}"
            if (a.dtype, a.global_shape) != (b.dtype, b.global_shape):
                return (
                    f"entry {name!r}: {a.dtype}{list(a.global_shape)} vs "
                    f"{b.dtype}{list(b.global_shape)}"
                )
            if (a.shape, a.offset) != (b.shape, b.offset):
                return f"entry {name!r}: local shape {list(a.shape)} vs {list(b.shape)}"
        if self.blob_capacity != other.blob_capacity:
            return f"blob capacity {self.blob_capacity} vs {other.blob_capacity}"
        return "no difference"


def check_same_structure(layouts: Sequence[StateLayout]) -> None:
    """Raise :class:`LayoutMismatchError` unless every rank's layout has the same structure.

    Args:
        layouts: ``layouts[rank]`` for every rank of the job.
    """
    ref = layouts[0]
    for rank, layout in enumerate(layouts):
        if layout.structure_hash != ref.structure_hash:
            raise LayoutMismatchError(
                f"rank 0 has {ref.describe()} but rank {rank} has {layout.describe()}: "
                f"{ref.first_difference(layout)}. Every rank must build the same model and "
                "optimizer (same parameter names, dtypes and shapes) before replication starts"
            )
