"""A generation as a process sees it, decoded from the coordinator's announcement.

The coordinator announces each generation in full or as a delta on the one before; the replica
map is not sent: every rank computes it from the node map, as the coordinator does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from launcher.decisions import body_maps
from p2p_state.placement import place


@dataclass(frozen=True, slots=True)
class GenerationInfo:
    """One generation as this process sees it (full maps, deltas applied)."""

    generation: int
    world_size: int
    ranks: dict[int, str]
    """rank -> identity."""
    nodes: dict[int, int]
    """rank -> node."""
    lost: tuple[int, ...]
    replaced: dict[int, tuple[str, str]]
    committed_step: int
    store_prefix: str
    holders: dict[int, tuple[int, ...]]
    """The coordinator's replica map: rank -> ranks holding a copy of its shard."""
    directive: str
    """``train`` (carry on), or ``checkpoint`` (restore, write a cold checkpoint and stop)."""
    ack_timeout_s: float
    """The coordinator's deadline for acknowledging this generation."""
    graceful: bool
    """Members finish their step and switch at the next commit of replication (a resize
    nothing forces); otherwise the step in flight is abandoned at once."""
    replicas: int
    """Replication factor k."""
    reason: str
    arrived_t: float
    """``time.monotonic()`` when it arrived."""

    def rank_of(self, identity: str) -> int | None:
        """The rank ``identity`` holds in this generation, if any."""
        for r, i in self.ranks.items():
            if i == identity:
                return r
        return None


def decode_generation(
    body: dict[str, Any], prev: GenerationInfo | None, now: float
) -> GenerationInfo:
    """The generation announced by ``body``; a delta applies to ``prev`` (the newest known).

    Args:
        now: ``time.monotonic()`` when it arrived.
    """
    g = int(body["generation"])
    ranks = {} if body.get("full", True) or prev is None else dict(prev.ranks)
    nodes = {} if body.get("full", True) or prev is None else dict(prev.nodes)
    carried_ranks, carried_nodes = body_maps(body)
    ranks.update(carried_ranks)
    nodes.update(carried_nodes)
    world = int(body["world_size"])
    ranks = {r: i for r, i in ranks.items() if r < world}
    nodes = {r: n for r, n in nodes.items() if r < world}
    k = int(body.get("replicas", 1))
    holders: dict[int, tuple[int, ...]] = {}
    if 1 <= k < world and len(nodes) == world:
        # The replica map is a pure function of the node map: every rank and the
        # coordinator compute the same one.
        rpn = int(body.get("ranks_per_node", 1))
        placement = place(world, rpn, k, [nodes[r] for r in range(world)])
        holders = dict(enumerate(placement.holders))
    return GenerationInfo(
        generation=g,
        world_size=world,
        ranks=ranks,
        nodes=nodes,
        lost=tuple(int(r) for r in body.get("lost", ())),
        replaced={int(r): (str(a), str(b)) for r, (a, b) in body["replaced"].items()},
        committed_step=int(body.get("committed_step", -1)),
        store_prefix=str(body["store_prefix"]),
        holders=holders,
        directive=str(body.get("directive", "train")),
        ack_timeout_s=float(body.get("ack_timeout_s", 10.0)),
        graceful=bool(body.get("graceful", False)),
        replicas=k,
        reason=str(body.get("reason", "")),
        arrived_t=now,
    )
