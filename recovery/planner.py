"""The restore plan: who sends which bytes to whom after a fault or a resize.

A pure function of plain data. The inputs are the old ranks' layouts (what each old rank's
buffer holds), the new ranks' layouts (what each new rank's buffer must hold), which new ranks
hold a verified copy of each old rank's buffer at the committed step (its own snapshot if it
survived, replicas on buddies), and, for per-rank state that is not sharded (RNG, the
non-tensor blob, tensors FSDP does not shard), which old rank each new rank inherits from.

FSDP2 shards every parameter and its optimizer state on dim 0, so a local shard is a contiguous
run of global rows and any row range of it is a contiguous byte range. The planner intersects
the row ranges of old and new shards entry by entry, which makes replace (same layouts, a spare
in a lost rank's place), shrink and grow the same computation. Adjacent pieces are coalesced,
and each piece is served by the holder with the least work so far, preferring a copy the
receiver already holds (a local copy moves nothing over the network). Large pieces are split
across all holders of their owner so that a lost rank's state comes from every buddy at once.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from p2p_state.layout import ALIGN_BYTES, StateLayout, TensorEntry, dtype_from_name
from p2p_state.snapshot import Copy


@dataclass(frozen=True, slots=True)
class Transfer:
    """Bytes ``[src_start, src_end)`` of ``owner``'s old buffer go to ``dst`` at ``dst_start``.

    ``src`` is the new rank that serves them from its copy of ``owner``'s buffer; when
    ``src == dst`` the copy is local.
    """

    src: int
    dst: int
    owner: int
    src_start: int
    src_end: int
    dst_start: int

    @property
    def nbytes(self) -> int:
        """Size of the transfer."""
        return self.src_end - self.src_start


@dataclass(frozen=True, slots=True)
class MissingRange:
    """Bytes of ``owner``'s old buffer that new rank ``dst`` needs and no survivor holds."""

    owner: int
    dst: int
    src_start: int
    src_end: int


@dataclass(frozen=True)
class RestorePlan:
    """The transfers that rebuild every new rank's buffer, and what cannot be rebuilt."""

    step: int
    transfers: tuple[Transfer, ...]
    missing: tuple[MissingRange, ...]

    @property
    def needs_fallback(self) -> bool:
        """Some bytes have no surviving copy: the job must load the last DCP checkpoint."""
        return bool(self.missing)

    def bytes_by_src(self) -> dict[int, int]:
        """Network bytes each serving rank sends (local copies excluded)."""
        out: dict[int, int] = {}
        for t in self.transfers:
            if t.src != t.dst:
                out[t.src] = out.get(t.src, 0) + t.nbytes
        return out

    def for_rank(self, rank: int) -> tuple[list[Transfer], list[Transfer]]:
        """``(sends, receives)`` of one rank; a local copy appears in both."""
        return (
            [t for t in self.transfers if t.src == rank],
            [t for t in self.transfers if t.dst == rank],
        )


def _row_bytes(e: TensorEntry) -> int:
    row = dtype_from_name(e.dtype).itemsize
    for d in e.shape[1:]:
        row *= d
    return row


def _is_sharded(name: str, layouts: Sequence[StateLayout]) -> bool:
    """An entry is row-sharded when some rank holds less than the whole tensor."""
    return any(
        (e := layout.entry(name)).shape != e.global_shape or e.dim0_offset for layout in layouts
    )


def shard_layout(template: StateLayout, world_size: int, rank: int) -> StateLayout:
    """The layout ``rank`` of a ``world_size`` job would have, from any rank's layout.

    Row-sharded entries are re-chunked with FSDP2's rule (``torch.chunk`` on dim 0: chunks of
    ``ceil(rows / world_size)`` rows, the last ones short or empty); every other entry keeps its
    shape. Which entries are sharded is read from ``template`` (shape differs from global shape or
    the shard starts past row 0); pass a layout of a job with more than one rank.
    """
    specs = []
    for e in template.entries:
        sharded = e.shape != e.global_shape or e.dim0_offset
        if sharded and e.global_shape:
            rows = e.global_shape[0]
            chunk = -(-rows // world_size)
            start = min(rank * chunk, rows)
            end = min(start + chunk, rows)
            shape = (end - start, *e.global_shape[1:])
            specs.append((e.name, dtype_from_name(e.dtype), shape, e.global_shape, start))
        else:
            specs.append((e.name, dtype_from_name(e.dtype), e.shape, e.global_shape, 0))
    return StateLayout.build(specs, template.blob_capacity)


def plan_restore(
    old_layouts: Sequence[StateLayout],
    new_layouts: Sequence[StateLayout],
    holders: Mapping[int, Sequence[int]],
    inherits_from: Sequence[int],
    step: int,
    *,
    split_bytes: int = 4 * 2**20,
) -> RestorePlan:
    """Plan the transfers that build every new rank's buffer from the old ranks' buffers.

    Args:
        old_layouts: ``old_layouts[old_rank]`` for every rank of the old world.
        new_layouts: ``new_layouts[new_rank]`` for every rank of the new world.
        holders: ``holders[old_rank]``: the *new* ranks that hold a verified copy of that old
            rank's buffer at ``step`` (its own snapshot when it survived, its replicas). An old
            rank with no entry or an empty list has no surviving copy.
        inherits_from: ``inherits_from[new_rank]``: the old rank whose per-rank state (RNG,
            the non-tensor blob, tensors that are not row-sharded) the new rank takes over.
        step: The committed step the plan restores.
        split_bytes: Pieces at least twice this size are split across all of their holders.

    Returns:
        The plan. ``missing`` lists what no survivor holds (the caller falls back to DCP).

    Raises:
        ValueError: the layouts do not describe the same model (names, dtypes, global shapes),
            or ``inherits_from`` is malformed.
    """
    if len(inherits_from) != len(new_layouts):
        raise ValueError(
            f"inherits_from has {len(inherits_from)} entries for {len(new_layouts)} new ranks"
        )
    if any(not 0 <= o < len(old_layouts) for o in inherits_from):
        raise ValueError(f"inherits_from names a rank outside the old world: {inherits_from}")
    ref = old_layouts[0].structure_hash
    for layout in (*old_layouts, *new_layouts):
        if layout.structure_hash != ref:
            raise ValueError(
                f"old and new layouts describe different models: {old_layouts[0].describe()} "
                f"vs {layout.describe()} ({old_layouts[0].first_difference(layout)})"
            )

    # 1. What each new rank needs, as (owner, src_start, src_end, dst_start) pieces.
    needs: list[tuple[int, int, int, int, int]] = []  # (dst, owner, s0, s1, d0)
    names = [e.name for e in old_layouts[0].entries]
    for name in names:
        if _is_sharded(name, old_layouts) or _is_sharded(name, new_layouts):
            _plan_rows(name, old_layouts, new_layouts, needs)
        else:
            for dst, layout in enumerate(new_layouts):
                src_e, dst_e = old_layouts[inherits_from[dst]].entry(name), layout.entry(name)
                needs.append((dst, inherits_from[dst], src_e.offset, src_e.end, dst_e.offset))
    for dst, layout in enumerate(new_layouts):
        old = old_layouts[inherits_from[dst]]
        needs.append(
            (
                dst,
                inherits_from[dst],
                old.blob_offset,
                old.blob_offset + old.blob_capacity,
                layout.blob_offset,
            )
        )

    # 2. Coalesce pieces contiguous on both sides.
    needs.sort(key=lambda n: (n[0], n[1], n[2]))
    merged: list[list[int]] = []
    for dst, owner, s0, s1, d0 in needs:
        if s1 == s0:
            continue
        last = merged[-1] if merged else None
        if (
            last
            and last[0] == dst
            and last[1] == owner
            and last[3] == s0
            and (last[4] + (last[3] - last[2]) == d0)
        ):
            last[3] = s1
        else:
            merged.append([dst, owner, s0, s1, d0])

    # 3. Choose who serves each piece: the receiver itself if it holds a copy, else spread.
    load: dict[int, int] = {}
    transfers: list[Transfer] = []
    missing: list[MissingRange] = []
    for dst, owner, s0, s1, d0 in merged:
        sources = sorted(set(holders.get(owner, ())))
        if not sources:
            missing.append(MissingRange(owner, dst, s0, s1))
            continue
        if dst in sources:
            transfers.append(Transfer(dst, dst, owner, s0, s1, d0))
            continue
        n = len(sources) if s1 - s0 >= 2 * split_bytes else 1
        cuts = [s0 + (s1 - s0) * i // n // ALIGN_BYTES * ALIGN_BYTES for i in range(n)] + [s1]
        for a, b in itertools.pairwise(cuts):
            if b <= a:
                continue
            src = min(sources, key=lambda r: (load.get(r, 0), r))
            load[src] = load.get(src, 0) + (b - a)
            transfers.append(Transfer(src, dst, owner, a, b, d0 + (a - s0)))
    return RestorePlan(step, tuple(transfers), tuple(missing))


def _plan_rows(
    name: str,
    old_layouts: Sequence[StateLayout],
    new_layouts: Sequence[StateLayout],
    needs: list[tuple[int, int, int, int, int]],
) -> None:
    for dst, layout in enumerate(new_layouts):
        ne = layout.entry(name)
        n0, n1 = ne.dim0_offset, ne.dim0_offset + (ne.shape[0] if ne.shape else 0)
        row = _row_bytes(ne)
        for owner, old in enumerate(old_layouts):
            oe = old.entry(name)
            o0, o1 = oe.dim0_offset, oe.dim0_offset + (oe.shape[0] if oe.shape else 0)
            a, b = max(n0, o0), min(n1, o1)
            if a < b:
                needs.append(
                    (
                        dst,
                        owner,
                        oe.offset + (a - o0) * row,
                        oe.offset + (b - o0) * row,
                        ne.offset + (a - n0) * row,
                    )
                )


@dataclass(frozen=True, slots=True)
class Source:
    """The state recovery restores: ``step`` of a world of ``world_size`` ranks, and its copies."""

    world_size: int
    step: int
    holders: dict[int, list[int]]
    """Old rank -> the new ranks holding a copy of its state at ``step``."""
    inherits_from: list[int]
    """New rank -> the old rank whose per-rank state (RNG, schedule, extras) it takes."""


def choose_source(copies: Sequence[Iterable[Copy]], new_world_size: int) -> Source | None:
    """The most recent state every shard of which some new rank still holds.

    A copy of rank ``r``'s state at step ``s`` in a world of ``W`` ranks is the same bytes
    whichever generation made it, so copies are matched on ``(W, r, s)``: snapshots survivors
    kept of their own state, replicas they keep of others', from any generation. The newest
    step for which all ``W`` shards have a copy wins (at equal steps, the world the job is
    going to, which moves fewer bytes).

    Args:
        copies: ``copies[new_rank]``: every verified copy that new rank holds.
        new_world_size: Ranks of the world being restored into.

    Returns:
        The source, or ``None`` when no step is complete (the caller falls back to DCP).
    """
    by_key: dict[tuple[int, int], dict[int, set[int]]] = {}  # (W, s) -> owner -> new ranks
    own: dict[tuple[int, int], dict[int, int]] = {}  # (W, s) -> new rank -> its old rank
    for new_rank, held in enumerate(copies):
        for world, owner, step, is_own in held:
            by_key.setdefault((world, step), {}).setdefault(owner, set()).add(new_rank)
            if is_own:
                own.setdefault((world, step), {})[new_rank] = owner
    complete = [k for k, owners in by_key.items() if len(owners) == k[0]]
    if not complete:
        return None
    world, step = max(complete, key=lambda k: (k[1], k[0] == new_world_size, -k[0]))
    holders = {o: sorted(r) for o, r in sorted(by_key[(world, step)].items())}
    mine = own.get((world, step), {})
    taken = set(mine.values())
    inherits = []
    for n in range(new_world_size):
        if n in mine:
            inherits.append(mine[n])
        elif n < world and n not in taken:
            inherits.append(n)  # a spare in a lost rank's place takes over that rank
        else:
            inherits.append(n % world)
    return Source(world, step, holders, inherits)
