"""Double-buffered snapshot slots and the header every snapshot or replica carries.

A :class:`DoubleBuffer` holds two slots. A new snapshot is always written into the slot that
does *not* hold the latest complete one, and only becomes visible (gets a header) once it is
whole, so a failure half-way through a copy or a transfer never destroys the last good copy.
The same structure holds a rank's own snapshots and each replica it keeps for a buddy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from p2p_state.checksum import checksum
from p2p_state.memory import BufferPool, MemoryKind, allocate

logger = logging.getLogger(__name__)

_MAGIC = 0x5032505354415445  # "P2PSTATE"
_HEADER_VERSION = 1
HEADER_WORDS = 8


def _to_i64(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


def _to_u64(i: int) -> int:
    return i + (1 << 64) if i < 0 else i


class Copy(NamedTuple):
    """A complete copy of one rank's state held here, as recovery plans with it.

    A copy of ``owner``'s state at ``step`` in a world of ``world_size`` ranks is the same bytes
    whichever generation made it."""

    world_size: int
    owner: int
    """The rank (in that world) whose state it is."""
    step: int
    is_own: bool
    """This rank's own snapshot, not a replica of another rank's."""


@dataclass(frozen=True, slots=True)
class SnapshotHeader:
    """What a complete snapshot or replica is: which step, of which layout, with which checksum."""

    step: int
    generation: int
    layout_hash: str
    """16 hex digits (see :attr:`StateLayout.layout_hash`)."""
    nbytes: int
    checksum: int
    algo: int
    """Checksum algorithm (:data:`p2p_state.checksum.XXH64_BLOCKS`)."""

    def to_tensor(self) -> torch.Tensor:
        """Encode as ``HEADER_WORDS`` int64 values (sent ahead of the bytes)."""
        return torch.tensor(
            [
                _to_i64(_MAGIC),
                _HEADER_VERSION,
                self.step,
                self.generation,
                _to_i64(int(self.layout_hash, 16)),
                self.nbytes,
                _to_i64(self.checksum),
                self.algo,
            ],
            dtype=torch.int64,
        )

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> SnapshotHeader:
        """Decode :meth:`to_tensor`; ``ValueError`` if it is not a header of this version."""
        words = [int(x) for x in t.cpu().tolist()]
        if len(words) != HEADER_WORDS or _to_u64(words[0]) != _MAGIC:
            raise ValueError("not a snapshot header (bad magic)")
        if words[1] != _HEADER_VERSION:
            raise ValueError(f"snapshot header version {words[1]}, expected {_HEADER_VERSION}")
        return cls(
            step=words[2],
            generation=words[3],
            layout_hash=f"{_to_u64(words[4]):016x}",
            nbytes=words[5],
            checksum=_to_u64(words[6]),
            algo=words[7],
        )


class Slot:
    """One buffer and, once it holds a complete snapshot, that snapshot's header.

    The buffer is ``None`` until the slot is first written when its :class:`DoubleBuffer` draws
    from a pool, and again once it has been given back.
    """

    def __init__(self, buffer: torch.Tensor | None) -> None:
        self.buffer = buffer
        self.header: SnapshotHeader | None = None
        self.corrupt = False
        """Set when a checksum check failed: this slot is never restored from."""

    def verify(self) -> bool:
        """Recompute the checksum; on a mismatch mark the slot corrupt and log it."""
        if self.header is None:
            return False
        assert self.buffer is not None  # a slot with a header has been written
        actual = checksum(self.buffer[: self.header.nbytes])
        if actual != self.header.checksum:
            self.corrupt = True
            logger.error(
                "snapshot of step %d (layout %s) failed its checksum (%#x, expected %#x); "
                "it will not be restored from",
                self.header.step,
                self.header.layout_hash,
                actual,
                self.header.checksum,
            )
            return False
        return True


class DoubleBuffer:
    """Two slots of ``nbytes`` bytes; the latest complete slot is never handed out for writing.

    Both buffers are allocated now, or, with a ``pool``, each is taken from it when its slot is
    first written (a recovering replicator's slots reuse what the previous generation's stores
    give back by then).

    Not thread-safe by itself: the replicator writes slots from its worker thread only, and readers
    go through its lock.
    """

    def __init__(
        self,
        nbytes: int,
        kind: MemoryKind,
        device: torch.device,
        prefault: bool = True,
        pool: BufferPool | None = None,
    ) -> None:
        self.nbytes = nbytes
        self.kind = kind
        self.device = device
        self._pool = pool
        if pool is None:
            self.slots = (
                Slot(allocate(nbytes, kind, device, prefault)),
                Slot(allocate(nbytes, kind, device, prefault)),
            )
        else:
            self.slots = (Slot(None), Slot(None))
        self._latest: Slot | None = None

    @property
    def allocated(self) -> bool:
        """Whether both slots have their buffers."""
        return all(slot.buffer is not None for slot in self.slots)

    def writable(self) -> Slot:
        """The slot to write the next snapshot into; it is marked incomplete."""
        slot = self.slots[1] if self._latest is self.slots[0] else self.slots[0]
        slot.header = None
        slot.corrupt = False
        if slot.buffer is None:
            if self._pool is not None:
                slot.buffer = self._pool.take(self.nbytes, self.kind, self.device)
            else:
                slot.buffer = allocate(self.nbytes, self.kind, self.device, prefault=False)
            if self.allocated:
                self._pool = None  # what is left in it is not kept alive by this buffer
        return slot

    def give_back(self, pool: BufferPool, keep: Collection[int] = ()) -> int:
        """Move the buffers of the slots not holding a step of ``keep`` into ``pool``.

        Those slots are empty afterwards (never found, never the latest); a slot holding a kept
        step stays as it is. Only for a buffer nothing writes any more (a stopped replicator's).
        Returns the bytes given back.
        """
        given = 0
        for slot in self.slots:
            if slot.buffer is None or (slot.header is not None and slot.header.step in keep):
                continue
            pool.put(self.kind, slot.buffer)
            given += slot.buffer.numel()
            slot.buffer, slot.header = None, None
            if self._latest is slot:
                self._latest = None
        return given

    def publish(self, slot: Slot, header: SnapshotHeader) -> None:
        """Mark ``slot`` complete with ``header``; it becomes the latest."""
        assert slot in self.slots
        assert header.nbytes <= self.nbytes
        slot.header = header
        self._latest = slot

    def latest(self) -> Slot | None:
        """The most recent complete slot, or ``None``."""
        return self._latest

    def find(self, step: int) -> Slot | None:
        """The complete, not-known-corrupt slot holding ``step``, or ``None``."""
        for slot in self.slots:
            if slot.header is not None and slot.header.step == step and not slot.corrupt:
                return slot
        return None

    def complete_steps(self) -> list[int]:
        """Steps held complete (and not known corrupt), ascending."""
        return sorted(s.header.step for s in self.slots if s.header is not None and not s.corrupt)


class HostStaging:
    """Carries the host-resident pieces of a snapshot into a GPU slot without blocking the host.

    A snapshot of GPU-resident state still has pieces that live on the host: the RNG states, the
    non-tensor blob, and the ``step`` counters of a non-capturable AdamW (one 0-dim CPU tensor
    per parameter). Copied one by one from pageable memory, each is a synchronous copy that first
    waits for the side stream, which itself waits for the optimizer step: the training thread
    would sit out the whole step. Here they are packed on the host into one pinned buffer (one
    ``torch.cat``), moved by one non-blocking host-to-device copy into a device staging buffer,
    and scattered into the slot by one batched device-side copy: three enqueues, whatever the
    number of pieces.

    The pinned buffer is written by the host and read by a copy still queued on the stream: it
    is rewritten (or either buffer reallocated) only once the event recorded after the scatter
    has completed, normally long before, as a new snapshot waits for the previous round, which
    waited for its copy.

    Args:
        device: The GPU of the slots.
        capacity: Bytes to reserve now (before they are needed); it grows if a snapshot needs
            more.
        pin: Allocate the host buffer pinned (only a CPU stand-in in tests passes ``False``).
        new_event: Makes the event recorded after each host-to-device copy.
    """

    def __init__(
        self,
        device: torch.device,
        capacity: int,
        *,
        pin: bool = True,
        new_event: Callable[[], Any] | None = None,
    ) -> None:
        self.device = device
        self._pin = pin
        self._new_event = new_event or torch.cuda.Event
        self._host = torch.empty(0, dtype=torch.uint8)
        self._dev = torch.empty(0, dtype=torch.uint8, device=device)
        self._read: Any = None  # event after the last copy out of the staging buffers
        self.reserve(capacity)

    @property
    def capacity(self) -> int:
        """Bytes the staging buffers hold."""
        return self._host.numel()

    def reserve(self, nbytes: int) -> None:
        """Make room for ``nbytes`` (allocating now, off the training step's path)."""
        if nbytes <= self._host.numel():
            return
        self._wait_read()
        self._host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pin)
        self._dev = torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def _wait_read(self) -> None:
        if self._read is not None:
            self._read.synchronize()
            self._read = None

    def stage(self, buffer: torch.Tensor, pieces: list[tuple[int, torch.Tensor]]) -> None:
        """Enqueue, on the current stream, the writes of ``pieces`` into ``buffer``.

        Args:
            buffer: The slot (1-D ``uint8`` on ``device``).
            pieces: ``(byte offset in buffer, 1-D uint8 host tensor)``; the host tensors may be
                reused as soon as this returns.
        """
        pieces = [(o, b) for o, b in pieces if b.numel()]
        if not pieces:
            return
        total = sum(b.numel() for _, b in pieces)
        self.reserve(total)
        self._wait_read()  # the previous copy out of the host buffer has read it
        torch.cat([b for _, b in pieces], out=self._host[:total])
        self._dev[:total].copy_(self._host[:total], non_blocking=True)
        dst, src, at = [], [], 0
        for offset, b in pieces:
            n = b.numel()
            dst.append(buffer[offset : offset + n])
            src.append(self._dev[at : at + n])
            at += n
        torch._foreach_copy_(dst, src, non_blocking=True)
        # After the scatter, so a completed event also frees the device staging for reuse or
        # reallocation (it is used on this stream, not the one it was allocated on).
        read = self._new_event()
        read.record()
        self._read = read
