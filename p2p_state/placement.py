"""Buddy placement: which ranks hold a copy of each rank's shard.

A pure function of (world size, ranks per node, replication factor k, and optionally the node of
every rank). By default ranks are numbered node by node (ranks ``[n * ranks_per_node,
(n + 1) * ranks_per_node)`` live on node ``n``), as torchrun and ``p2p-run`` number them at the
start; after spares took lost ranks' places or a resize renumbered the ranks, the coordinator
passes the real node of every rank.

The placement walks a ring in which the nodes are interleaved (local rank 0 of every node, then
local rank 1 of every node, ...), so a rank's ring successors sit on other nodes. For each shard it
takes the first candidates along that ring, preferring, in this order:

1. a node that holds no copy of this shard yet, on a rank holding fewer than k replicas;
2. a node that holds no copy of this shard yet (even if that rank then holds more than k);
3. a node other than the owner's, under the cap; 4. a node other than the owner's;
5. any rank under the cap; 6. any other rank.

On equal-sized nodes with more than k nodes this is the plain ring ``holder_j = ring[pos + j]``:
every shard's copies sit on k distinct other nodes and every rank holds exactly k replicas. Failure
domains come before balance: on uneven nodes a rank may hold more than k replicas rather than share
a node with the shard it protects. Shapes that cannot survive a node loss are reported, not hidden.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class Placement:
    """Which ranks hold a replica of which rank's shard.

    Build one with :func:`place`; every field is derived from the three inputs.
    """

    world_size: int
    ranks_per_node: int
    k: int
    holders: tuple[tuple[int, ...], ...]
    """``holders[owner]``: the ranks holding a copy of ``owner``'s shard, in preference order."""
    nodes: tuple[int, ...] | None = None
    """``nodes[rank]``: the node of every rank, when they are not numbered node by node."""

    def node_of(self, rank: int) -> int:
        """The node a rank lives on."""
        return self.nodes[rank] if self.nodes is not None else rank // self.ranks_per_node

    @property
    def num_nodes(self) -> int:
        """Number of nodes (the last one may be partial)."""
        if self.nodes is not None:
            return len(set(self.nodes))
        return -(-self.world_size // self.ranks_per_node)

    @cached_property
    def held_by(self) -> tuple[tuple[int, ...], ...]:
        """``held_by[rank]``: the owners whose shard ``rank`` keeps a replica of, ascending."""
        held: list[list[int]] = [[] for _ in range(self.world_size)]
        for owner, hs in enumerate(self.holders):
            for h in hs:
                held[h].append(owner)
        return tuple(tuple(sorted(h)) for h in held)

    @cached_property
    def exposed_to_node_loss(self) -> tuple[int, ...]:
        """Owners whose shard and every copy of it live on one node (a node loss loses them)."""
        return tuple(
            owner
            for owner, hs in enumerate(self.holders)
            if all(self.node_of(h) == self.node_of(owner) for h in hs)
        )

    @cached_property
    def max_load(self) -> int:
        """The largest number of replicas any one rank holds."""
        return max((len(h) for h in self.held_by), default=0)

    def warnings(self) -> list[str]:
        """Human-readable reasons this placement is weaker than asked for; empty when it is not."""
        out = []
        if self.exposed_to_node_loss:
            out.append(
                f"{len(self.exposed_to_node_loss)} of {self.world_size} shards have every copy on "
                f"their owner's node (world_size={self.world_size}, "
                f"ranks_per_node={self.ranks_per_node}, {self.num_nodes} node(s)): losing that "
                "node loses them and recovery falls back to the last DCP checkpoint; "
                "run on more than one node to avoid this"
            )
        if self.max_load > self.k:
            out.append(
                f"uneven nodes: one rank holds {self.max_load} replicas (k={self.k}) so that "
                "every shard keeps a copy on another node"
            )
        return out


def _ring_order(nodes: Sequence[int]) -> list[int]:
    """Ranks with nodes interleaved: the first rank of every node, then the second, ..."""
    by_node: dict[int, list[int]] = {}
    for rank, node in enumerate(nodes):
        by_node.setdefault(node, []).append(rank)
    groups = [by_node[n] for n in sorted(by_node)]
    depth = max(len(g) for g in groups)
    return [g[i] for i in range(depth) for g in groups if i < len(g)]


def place(
    world_size: int, ranks_per_node: int, k: int = 1, nodes: Sequence[int] | None = None
) -> Placement:
    """Choose the k holders of every rank's shard.

    Args:
        world_size: Number of training ranks.
        ranks_per_node: Ranks per node (the last node may hold fewer).
        k: Replication factor: copies of each shard besides the owner's own.
        nodes: ``nodes[rank]``: the node of every rank, when ranks are not numbered node by
            node (spares in lost ranks' places, a renumbered world after a resize).

    Returns:
        The placement; see the module docstring for its properties.

    Raises:
        ValueError: a size is not positive, or ``k >= world_size`` (not enough other ranks).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
    if k < 1:
        raise ValueError(f"replication factor k must be >= 1, got {k}")
    if k >= world_size:
        raise ValueError(
            f"replication factor k={k} needs at least k+1={k + 1} ranks, world_size={world_size}; "
            "lower k or add ranks"
        )
    if nodes is not None and len(nodes) != world_size:
        raise ValueError(f"nodes names {len(nodes)} ranks, world_size={world_size}")
    node_of = list(nodes) if nodes is not None else [r // ranks_per_node for r in range(world_size)]
    ring = _ring_order(node_of)
    pos = {r: i for i, r in enumerate(ring)}
    load = [0] * world_size
    holders: list[tuple[int, ...]] = [()] * world_size

    for owner in ring:
        owner_node = node_of[owner]
        chosen: list[int] = []
        used_nodes = {owner_node}
        for _ in range(k):
            best, best_tier = -1, 99
            for step in range(1, world_size):
                cand = ring[(pos[owner] + step) % world_size]
                if cand in chosen:
                    continue
                node = node_of[cand]
                under_cap = load[cand] < k
                if node not in used_nodes:
                    tier = 0 if under_cap else 1
                elif node != owner_node:
                    tier = 2 if under_cap else 3
                else:
                    tier = 4 if under_cap else 5
                if tier < best_tier:
                    best, best_tier = cand, tier
                    if tier == 0:
                        break
            assert best >= 0, "k < world_size guarantees a candidate"
            chosen.append(best)
            used_nodes.add(node_of[best])
            load[best] += 1
        holders[owner] = tuple(chosen)
    return Placement(
        world_size, ranks_per_node, k, tuple(holders), tuple(nodes) if nodes is not None else None
    )
