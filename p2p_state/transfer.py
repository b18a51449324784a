"""Moving bytes between ranks: chunked, batched point-to-point transfers on a process group.

Everything here works on 1-D ``uint8`` buffers and peer ranks; what the bytes mean is the
layout's business. Transfers are split into chunks of at most ``chunk_bytes`` and every chunk
round is one ``batch_isend_irecv`` of all the sends and receives this rank takes part in, so the
links to all peers are busy at once. Each round waits with a deadline.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

#: Each transfer gets its own tag range so chunks of two transfers between one pair never match
#: (on gloo by tag; on NCCL, which ignores tags, by the posting order, see :func:`posting_order`).
_TAGS_PER_TRANSFER = 1 << 16


class TransferError(RuntimeError):
    """A transfer did not complete: a peer failed, or the deadline passed."""


@dataclass(frozen=True, slots=True)
class SendBuffer:
    """Send ``buf`` to rank ``peer``."""

    peer: int
    buf: torch.Tensor
    tag: int = 0


@dataclass(frozen=True, slots=True)
class RecvBuffer:
    """Receive exactly ``buf.numel()`` bytes from rank ``peer`` into ``buf``."""

    peer: int
    buf: torch.Tensor
    tag: int = 0


def exchange(
    sends: Sequence[SendBuffer],
    recvs: Sequence[RecvBuffer],
    group: dist.ProcessGroup,
    *,
    chunk_bytes: int,
    timeout_s: float,
    on_chunk: Callable[[int, int], None] | None = None,
    on_posted: Callable[[int, int], None] | None = None,
    rounds_in_flight: int = 2,
) -> None:
    """Run a set of sends and receives to completion, chunk round by chunk round.

    Round ``i`` moves bytes ``[i * chunk_bytes, (i + 1) * chunk_bytes)`` of every buffer that is
    that long. Up to ``rounds_in_flight`` rounds are posted at once, so the link never idles
    while one round is being completed and the next posted.

    Both sides of every pair must call this with matching buffers (same sizes, same tags), in
    the same order relative to other exchanges on ``group``.

    Args:
        sends: Buffers this rank sends.
        recvs: Buffers this rank receives into.
        group: The process group (peers are global ranks of its members).
        chunk_bytes: Largest chunk moved by one send/recv.
        timeout_s: Deadline for each chunk round to complete.
        on_chunk: Called as ``on_chunk(round, num_rounds)`` after each completed round.
        on_posted: Called as ``on_posted(round, num_rounds)`` right after a round is posted,
            while it is in flight (work to overlap with the transfer).
        rounds_in_flight: Rounds posted before the oldest is waited for.

    Raises:
        TransferError: a send or receive failed (a peer died or the deadline passed). Bytes
            received so far are incomplete and must not be used.
    """
    transfer = Transfer(sends, recvs, group, chunk_bytes=chunk_bytes)
    n = transfer.num_rounds

    def complete_oldest() -> None:
        done = transfer.wait_oldest(timeout_s)
        if on_chunk is not None:
            on_chunk(done, n)

    while not transfer.all_posted:
        posted = transfer.post_round()
        if on_posted is not None:
            on_posted(posted, n)
        if transfer.rounds_in_flight >= rounds_in_flight:
            complete_oldest()
    while transfer.rounds_in_flight:
        complete_oldest()


class Transfer:
    """The chunk rounds of one set of sends and receives (see :func:`exchange`), posted with
    :meth:`post_round` or :meth:`post_all` and completed oldest first with :meth:`wait_oldest`.

    Posting and completing may happen on different threads (one at a time): the replicator
    posts a round's transfers on the training thread, so that their NCCL kernels are launched
    at the same point of every rank's step, and completes them on its worker thread.
    """

    def __init__(
        self,
        sends: Sequence[SendBuffer],
        recvs: Sequence[RecvBuffer],
        group: dist.ProcessGroup,
        *,
        chunk_bytes: int,
    ) -> None:
        self._items = posting_order(
            [(True, s.peer, s.buf, s.tag) for s in sends]
            + [(False, r.peer, r.buf, r.tag) for r in recvs]
        )
        for _, _, buf, tag in self._items:
            assert buf.dtype == torch.uint8 and buf.dim() == 1 and buf.is_contiguous()
            assert tag % _TAGS_PER_TRANSFER == 0
        self._group = group
        self._chunk_bytes = chunk_bytes
        self.num_rounds = max(
            (-(-b.numel() // chunk_bytes) for _, _, b, _ in self._items), default=0
        )
        assert self.num_rounds < _TAGS_PER_TRANSFER, "chunk_bytes too small for this transfer"
        self.peers = sorted({peer for _, peer, _, _ in self._items})
        self._next = 0
        self._in_flight: collections.deque[tuple[int, list[dist.Work]]] = collections.deque()

    @property
    def all_posted(self) -> bool:
        """Whether every round has been posted."""
        return self._next == self.num_rounds

    @property
    def rounds_in_flight(self) -> int:
        """Rounds posted and not yet waited for."""
        return len(self._in_flight)

    def post_round(self) -> int:
        """Post the next chunk round (one ``batch_isend_irecv``); returns its index."""
        i, c = self._next, self._chunk_bytes
        ops = []
        for is_send, peer, buf, tag in self._items:
            piece = buf[i * c : (i + 1) * c]
            if piece.numel():
                fn = dist.isend if is_send else dist.irecv
                ops.append(dist.P2POp(fn, piece, peer, self._group, tag=tag + i))
        try:
            self._in_flight.append((i, dist.batch_isend_irecv(ops)))
        except Exception as e:
            raise TransferError(
                f"posting chunk round {i + 1} to ranks {self.peers} failed: {e}"
            ) from e
        self._next += 1
        return i

    def post_all(self) -> None:
        """Post every round not posted yet."""
        while not self.all_posted:
            self.post_round()

    def wait_oldest(self, timeout_s: float) -> int:
        """Wait for the oldest round in flight (within ``timeout_s``); returns its index.

        On NCCL a wait orders the caller's current stream after the round, as ``Work.wait``
        does; the host waits with an event recorded after it.

        Raises:
            TransferError: the round failed (a peer died) or timed out.
        """
        i, works = self._in_flight.popleft()
        n = self.num_rounds
        try:
            for work in works:
                if work.wait(timeout=timedelta(seconds=timeout_s)) is False:
                    raise TransferError(
                        f"transfer with ranks {self.peers}: chunk round {i + 1}/{n} timed "
                        f"out after {timeout_s:.0f}s"
                    )
        except TransferError:
            raise
        except Exception as e:
            raise TransferError(
                f"transfer with ranks {self.peers} failed in chunk round {i + 1}/{n} "
                f"(deadline {timeout_s:.0f}s per round): {e}"
            ) from e
        return i


def posting_order(items: list[tuple[bool, int, torch.Tensor, int]]) -> list[Any]:
    """``(is_send, peer, buf, tag)`` items in the order they are posted: by tag.

    NCCL ignores tags: it matches the operations between a pair in the order they are posted.
    Posting every rank's items in tag order makes NCCL's matching the same as gloo's (by tag).
    The sort is stable, so transfers of one pair and direction that share a tag (chunks of one
    buffer) keep the order both sides list them in, which both transports match in order.
    """
    ordered = sorted(items, key=lambda item: item[3])
    return ordered


def transfer_tag(index: int) -> int:
    """The base tag of the ``index``-th transfer of an exchange."""
    return index * _TAGS_PER_TRANSFER


def gather_bytes(
    data: bytes, group: dist.ProcessGroup, device: torch.device, timeout_s: float
) -> list[bytes]:
    """All-gather one byte string per rank of ``group`` (no pickle: raw bytes with lengths)."""
    world = dist.get_world_size(group)
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(world)]
    _wait(dist.all_gather(lengths, length, group=group, async_op=True), timeout_s, "lengths")
    longest = max(int(n) for n in lengths)
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    out = [torch.empty_like(mine) for _ in range(world)]
    _wait(dist.all_gather(out, mine, group=group, async_op=True), timeout_s, "payloads")
    return [bytes(t[: int(n)].cpu().numpy()) for t, n in zip(out, lengths)]


def _wait(work: dist.Work, timeout_s: float, what: str) -> None:
    try:
        ok = work.wait(timeout=timedelta(seconds=timeout_s))
    except Exception as e:
        raise TransferError(f"all-gather of {what} failed: {e}") from e
    if ok is False:
        raise TransferError(f"all-gather of {what} timed out after {timeout_s:.0f}s")
