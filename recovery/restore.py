"""Run a :class:`RestorePlan`: serve the bytes this rank holds, receive the bytes it needs.

Every rank of the new world calls :func:`execute_plan` with the same plan. Sends and receives
run as one chunked, batched exchange on the replication group (every transfer with its own tag
range, in plan order, so both sides agree); local copies (``src == dst``) are plain copies.
Afterwards the target buffer holds this rank's new state, ready for
:meth:`p2p_state.TrainingState.restore`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from p2p_state.layout import LayoutMismatchError
from p2p_state.replicator import ReplicaCorruptError, Replicator
from p2p_state.snapshot import Copy, Slot
from p2p_state.state import TrainingState
from p2p_state.transfer import RecvBuffer, SendBuffer, exchange, gather_bytes, transfer_tag
from recovery import phases
from recovery.planner import RestorePlan, Source, choose_source, plan_restore, shard_layout

logger = logging.getLogger(__name__)

ReceiveBuffer = Callable[[int, int], contextlib.AbstractContextManager[torch.Tensor]]
"""``receive_buffer(nbytes, step)``: lends the buffer a restore of ``step`` receives ``nbytes``
bytes into, for the transfer and the restore."""


def execute_plan(
    plan: RestorePlan,
    rank: int,
    group: dist.ProcessGroup,
    source: Callable[[int], torch.Tensor],
    target: torch.Tensor,
    *,
    chunk_bytes: int,
    timeout_s: float,
) -> int:
    """Carry out this rank's part of ``plan``.

    Args:
        plan: The plan every rank executes (see :func:`recovery.planner.plan_restore`).
        rank: This rank in the new world (as the plan numbers ranks; also its rank in
            ``group``).
        group: The process group of the new world used for the transfers.
        source: ``source(owner)`` returns this rank's verified copy of ``owner``'s old buffer at
            ``plan.step`` (its own snapshot or a replica), e.g. ``Replicator.read``-backed.
        target: This rank's new buffer (``uint8``, the new layout's ``total_bytes``).
        chunk_bytes: Largest chunk per send/recv.
        timeout_s: Deadline per chunk round.

    Returns:
        Bytes this rank received over the network.

    Raises:
        ValueError: the plan still has missing ranges (the caller must fall back to DCP).
        p2p_state.transfer.TransferError: a peer failed or a deadline passed.
    """
    if plan.needs_fallback:
        raise ValueError(
            f"the restore plan for step {plan.step} has {len(plan.missing)} ranges with no "
            "surviving copy; load the last DCP checkpoint instead"
        )
    sends, recvs, received = [], [], 0
    for i, t in enumerate(plan.transfers):
        if t.src == rank and t.dst == rank:
            src = source(t.owner)[t.src_start : t.src_end]
            dst = target[t.dst_start : t.dst_start + t.nbytes]
            if src.data_ptr() != dst.data_ptr():  # restoring straight from a held copy
                dst.copy_(src)
        elif t.src == rank:
            sends.append(
                SendBuffer(t.dst, source(t.owner)[t.src_start : t.src_end], transfer_tag(i))
            )
        elif t.dst == rank:
            recvs.append(
                RecvBuffer(t.src, target[t.dst_start : t.dst_start + t.nbytes], transfer_tag(i))
            )
            received += t.nbytes
    exchange(sends, recvs, group, chunk_bytes=chunk_bytes, timeout_s=timeout_s)
    logger.info(
        "rank %d restored step %d: sent %d pieces, received %d pieces (%.1f MiB)",
        rank,
        plan.step,
        len(sends),
        len(recvs),
        received / 2**20,
    )
    return received


class NoSurvivingCopy(RuntimeError):
    """Some shard has no verified copy on any member: the state must come from a checkpoint."""


@dataclass(frozen=True, slots=True)
class RestoreOutcome:
    """What :func:`restore_world` restored and what it cost."""

    step: int
    extras: dict[str, Any]
    source_world_size: int
    plan_s: float
    transfer_s: float
    restore_s: float
    bytes_received: int
    num_transfers: int
    source: Source
    """Which world and step was restored, who held what, who inherited whom."""


def gather_copies(
    stores: Sequence[Replicator],
    group: dist.ProcessGroup,
    wire_device: torch.device,
    timeout_s: float,
) -> list[set[Copy]]:
    """Every member's census of the copies it holds; collective over ``group``.

    Returns:
        ``held[rank]``: every complete copy held by that member (own snapshots and replicas,
        old generations included).
    """
    mine = msgpack.packb([list(c) for c in _held(stores)])
    return [
        {Copy(*c) for c in msgpack.unpackb(raw)}
        for raw in gather_bytes(mine, group, wire_device, timeout_s)
    ]


def restore_from_peers(
    state: TrainingState,
    stores: Sequence[Replicator],
    held: list[set[Copy]],
    group: dist.ProcessGroup,
    rank: int,
    world_size: int,
    *,
    memory: torch.device,
    chunk_bytes: int,
    timeout_s: float,
    wire_device: torch.device,
    on_phase: Callable[[str], None] | None = None,
    receive_buffer: ReceiveBuffer | None = None,
) -> RestoreOutcome:
    """Rebuild every member's state from the copies the members hold; collective over ``group``.

    Every member computes the same :func:`recovery.planner.choose_source` and
    :func:`recovery.planner.plan_restore` from the census (:func:`gather_copies`), verifies
    the copies it will serve and announces failures (with its layout's structure, so members
    that built different models are caught); a failed copy is dropped and the choice made
    again. Then :func:`execute_plan` moves the bytes and the live state is restored in place.

    Args:
        state: The member's freshly built training state (its layout is the new one).
        stores: Replicators whose copies this member holds.
        held: The census (modified: failed copies are removed).
        group: The new generation's replication group.
        rank, world_size: This member's place in the new world.
        memory: Device for the receive buffer (where snapshots live).
        chunk_bytes, timeout_s: As for the transfers of replication.
        wire_device: Device of the small control tensors on ``group`` (CUDA for NCCL).
        on_phase: Called with ``"transfer"`` and ``"restore"`` as each of these phases begins
            (the job's ``recovery_phase`` hook: faults are injected there).
        receive_buffer: Lends the buffer this member receives its state into (a spare's
            prepared slots, a survivor's old ones: no fresh memory on the transfer's path);
            by default a new one on ``memory``.

    Raises:
        NoSurvivingCopy: no step has a copy of every shard (same answer on every member).
        LayoutMismatchError: members built different models.
        p2p_state.transfer.TransferError: a member failed during the transfer.
    """
    t0 = time.perf_counter()
    new_layouts = [shard_layout(state.layout, world_size, r) for r in range(world_size)]
    if new_layouts[rank].layout_hash != state.layout.layout_hash:
        raise LayoutMismatchError(
            f"rank {rank}'s model has {state.layout.describe()}, not the dim-0 sharding of "
            f"{world_size} ranks the planner expects ({new_layouts[rank].describe()}): shard "
            "every parameter with fully_shard on the default mesh"
        )
    verified: dict[tuple[int, int], torch.Tensor] = {}
    while True:
        source = choose_source(held, world_size)
        if source is None:
            raise NoSurvivingCopy(describe_gap(held))
        old_layouts = [
            shard_layout(state.layout, source.world_size, r) for r in range(source.world_size)
        ]
        plan = plan_restore(
            old_layouts, new_layouts, source.holders, source.inherits_from, source.step
        )
        bad = []
        for owner in sorted({t.owner for t in plan.transfers if t.src == rank}):
            if (source.world_size, owner) in verified:
                continue
            try:
                slot = find_copy(stores, source.world_size, owner, source.step)
                assert slot.header is not None and slot.buffer is not None  # it verified
                if slot.header.layout_hash != old_layouts[owner].layout_hash:
                    raise ReplicaCorruptError(
                        f"copy of rank {owner} at step {source.step} has layout "
                        f"{slot.header.layout_hash}, expected {old_layouts[owner].layout_hash}"
                    )
                verified[(source.world_size, owner)] = slot.buffer
            except (KeyError, ReplicaCorruptError) as e:
                logger.error("rank %d cannot serve its copy: %s", rank, e)
                bad.append([source.world_size, owner, source.step])
        mine = msgpack.packb({"bad": bad, "structure": state.layout.structure_hash})
        reports = [msgpack.unpackb(b) for b in gather_bytes(mine, group, wire_device, timeout_s)]
        for r, doc in enumerate(reports):
            if doc["structure"] != state.layout.structure_hash:
                raise LayoutMismatchError(
                    f"rank {r} built a model of structure {doc['structure']} but rank {rank} "
                    f"built {state.layout.describe()}: every rank's factory must build the same "
                    "model and optimizer"
                )
        failed = [(r, tuple(b)) for r, doc in enumerate(reports) for b in doc["bad"]]
        if not failed:
            break
        for r, (world, owner, step) in failed:
            held[r] = {c for c in held[r] if c[:3] != (world, owner, step)}
    t1 = time.perf_counter()
    if on_phase is not None:
        on_phase(phases.TRANSFER)

    whole_own = [
        t
        for t in plan.transfers
        if t.dst == rank
        and t.src == rank
        and t.src_start == 0
        and t.dst_start == 0
        and t.nbytes >= state.layout.total_bytes
    ]
    with contextlib.ExitStack() as lent:
        if whole_own and len(plan.for_rank(rank)[1]) == 1:
            # This rank's new state is exactly a copy it holds (a survivor of a replace):
            # restore straight from it. It still serves the others.
            target = verified[(source.world_size, whole_own[0].owner)]
            target = target[: state.layout.total_bytes]
        elif receive_buffer is not None:
            target = lent.enter_context(receive_buffer(state.layout.total_bytes, source.step))
        else:
            target = torch.empty(state.layout.total_bytes, dtype=torch.uint8, device=memory)
        received = execute_plan(
            plan,
            rank,
            group,
            lambda owner: verified[(source.world_size, owner)],
            target,
            chunk_bytes=chunk_bytes,
            timeout_s=timeout_s,
        )
        t2 = time.perf_counter()
        if on_phase is not None:
            on_phase(phases.RESTORE)
        step, extras = state.restore(target)
    assert step == source.step, (step, source.step)
    return RestoreOutcome(
        step=step,
        extras=extras,
        source_world_size=source.world_size,
        plan_s=t1 - t0,
        transfer_s=t2 - t1,
        restore_s=time.perf_counter() - t2,
        bytes_received=received,
        num_transfers=len(plan.transfers),
        source=source,
    )


def _held(stores: Sequence[Replicator]) -> list[Copy]:
    out: dict[tuple[int, int, int], bool] = {}
    for store in stores:
        for c in store.copies():
            key = (c.world_size, c.owner, c.step)
            out[key] = out.get(key, False) or c.is_own
    return [Copy(*k, own) for k, own in sorted(out.items())]


def find_copy(stores: Sequence[Replicator], world: int, owner: int, step: int) -> Slot:
    """This member's verified copy of ``owner``'s state at ``step`` in a ``world``-rank world.

    Raises:
        KeyError: none is held here.
        ReplicaCorruptError: it failed its checksum.
    """
    for store in stores:
        if store.world_size == world and (world, owner, step) in {c[:3] for c in store.copies()}:
            return store.slot(owner, step)
    raise KeyError(f"no copy of rank {owner} of a {world}-rank world at step {step} here")


def describe_census(held: Sequence[set[Copy]]) -> str:
    """Every member's copies in one line, for the log of a restore that found none complete:
    ``member 0: W=4 own 0@{3,4}, 2@{3}; member 1: nothing``."""
    parts = []
    for member, copies in enumerate(held):
        by: dict[tuple[int, int, bool], set[int]] = {}
        for c in copies:
            by.setdefault((c.world_size, c.owner, c.is_own), set()).add(c.step)
        items = [
            f"W={w} {'own ' if own else ''}{o}@{{{','.join(map(str, sorted(steps)))}}}"
            for (w, o, own), steps in sorted(by.items())
        ]
        parts.append(f"member {member}: {', '.join(items) if items else 'nothing'}")
    return "; ".join(parts)


def describe_gap(held: Sequence[set[Copy]]) -> str:
    """Which shards have no surviving copy, for the error message.

    A shard lost for good is one with no copy at any step of the newest world; the others may
    only lack a copy of the newest step (a round in flight when the fault hit), which is not a
    loss and is not named as one.
    """
    worlds = sorted({c.world_size for h in held for c in h})
    if not worlds:
        return "no member holds any copy of the training state"
    world = worlds[-1]
    copies = {(c.owner, c.step) for h in held for c in h if c.world_size == world}
    steps = sorted({step for _, step in copies})
    missing = {s: sorted(set(range(world)) - {o for o, t in copies if t == s}) for s in steps}
    lost = sorted(set.intersection(*(set(m) for m in missing.values())))
    empty = [r for r, h in enumerate(held) if not h]
    came = f" (members {empty} hold no copy: they replaced lost ranks)" if empty else ""
    if lost:
        return (
            f"no step has a copy of every shard: the shards of ranks {lost} of the "
            f"{world}-rank world were lost together with every replica of them{came}"
        )
    gaps = "; ".join(f"step {s} lacks ranks {m}" for s, m in missing.items())
    return f"no step has a copy of every shard of the {world}-rank world: {gaps}{came}"
