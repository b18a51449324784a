"""Run a :class:`RestorePlan`: serve the bytes this rank holds, receive the bytes it needs.

Every rank of the new world calls :func:`execute_plan` with the same plan. Sends and receives
run as one chunked, batched exchange on the replication group (every transfer with its own tag
range, in plan order, so both sides agree); local copies (``src == dst``) are plain copies.
Afterwards the target buffer holds this rank's new state, ready for
:meth:`p2p_state.TrainingState.restore`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

from p2p_state.transfer import Recv, Send, exchange, transfer_tag
from recovery.planner import RestorePlan

logger = logging.getLogger(__name__)


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
            target[t.dst_start : t.dst_start + t.nbytes].copy_(
                source(t.owner)[t.src_start : t.src_end]
            )
        elif t.src == rank:
            sends.append(Send(t.dst, source(t.owner)[t.src_start : t.src_end], transfer_tag(i)))
        elif t.dst == rank:
            recvs.append(Recv(t.src, target[t.dst_start : t.dst_start + t.nbytes], transfer_tag(i)))
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
