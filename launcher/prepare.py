"""What an idle spare allocates before it is needed: the buffers of any rank's copies.

A rank's replicator holds two slots of its own snapshot and two of every replica it keeps
(:class:`p2p_state.replicator.Replicator`). A spare that takes a lost rank's place needs the
same; allocated then, they land on the recovery's critical path: pinning host memory costs
about 0.4 s a GiB, and fresh host pages fault during the first snapshots. So every rank reports
the sizes of its buffers once a generation (``memory``); once every rank of the generation has,
the coordinator tells the idle spares (``prepare``) sizes that cover any of them, and tells a
spare that connects later too. A spare allocates them while it waits, and its replicator takes
its slots from them when it takes a rank.

Any rank's buffers fit the cover: sorted largest first, the cover's ``i``-th buffer is the
largest ``i``-th buffer of any report, so each of a rank's buffers, in that order, finds one at
least as large that no larger one of its buffers took (the pool hands out the smallest that
fits: :meth:`p2p_state.memory.BufferPool.take`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Any

MEMORY_KINDS = ("gpu", "pinned", "host")
MAX_BUFFERS = 64
"""Buffers in one report: two own slots and two per replica held (``k`` copies of ``k``
owners' shards and more after an uneven placement: 31 owners)."""
MAX_BUFFER_BYTES = 2**44
"""The largest buffer a report may name (16 TiB)."""


def memory_spec(body: dict[str, Any]) -> tuple[str, tuple[int, ...]]:
    """The ``kind`` and ``buffers`` of a ``memory`` or ``prepare`` body, checked.

    Raises:
        ValueError: an unknown kind, too many buffers, or a size that is not a byte count.
    """
    kind, buffers = body["kind"], body["buffers"]
    if kind not in MEMORY_KINDS:
        raise ValueError(f"memory kind {kind!r} is not one of {', '.join(MEMORY_KINDS)}")
    if len(buffers) > MAX_BUFFERS:
        raise ValueError(f"{len(buffers)} buffers, more than {MAX_BUFFERS}")
    for n in buffers:
        if not isinstance(n, int) or isinstance(n, bool) or not 0 < n <= MAX_BUFFER_BYTES:
            raise ValueError(f"buffer size {n!r} is not a byte count in 1..{MAX_BUFFER_BYTES}")
    return kind, tuple(buffers)


def cover(reports: Iterable[Sequence[int]]) -> tuple[int, ...]:
    """Buffers, largest first, among which every report's buffers find a place (see the module
    docstring)."""
    out: list[int] = []
    for buffers in reports:
        for i, n in enumerate(sorted(buffers, reverse=True)):
            if i == len(out):
                out.append(n)
            else:
                out[i] = max(out[i], n)
    return tuple(out)


class SpareMemory:
    """The coordinator's view of the ranks' buffers, and what it last told the spares."""

    def __init__(self) -> None:
        self._reports: dict[str, tuple[int, str, tuple[int, ...]]] = {}
        self.told: tuple[str, tuple[int, ...]] | None = None
        """The last ``(kind, buffers)`` sent to the spares."""

    def report(self, identity: str, generation: int, kind: str, buffers: tuple[int, ...]) -> None:
        """A rank's buffers in ``generation`` (an older generation's report is ignored)."""
        previous = self._reports.get(identity)
        if previous is None or previous[0] <= generation:
            self._reports[identity] = (generation, kind, buffers)

    def spec(self, ranks: Collection[str], generation: int) -> tuple[str, tuple[int, ...]] | None:
        """What a spare should hold to take the place of any of ``ranks`` (the identities of the
        ranks of ``generation``; others' reports are forgotten), or ``None`` until each of them
        has reported its buffers of that generation (no spare reallocates while they trickle in).
        """
        for gone in set(self._reports) - set(ranks):
            del self._reports[gone]
        reports = [self._reports.get(identity) for identity in ranks]
        if not reports or any(r is None or r[0] != generation for r in reports):
            return None
        kinds = {r[1] for r in reports if r is not None}
        if len(kinds) != 1:
            return None  # ranks configured differently: their replicators refuse to start
        return kinds.pop(), cover(r[2] for r in reports if r is not None)

    def changed(
        self, ranks: Collection[str], generation: int
    ) -> tuple[str, tuple[int, ...]] | None:
        """The spec if it differs from what the spares were last told (and remember it)."""
        spec = self.spec(ranks, generation)
        if spec is None or spec == self.told:
            return None
        self.told = spec
        return spec
