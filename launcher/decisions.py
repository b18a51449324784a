"""What the membership state machine decides: the generation message and the coordinator's actions.

Plain data, no behaviour: :mod:`launcher.membership` produces them (lists of :data:`Decision`),
:mod:`launcher.coordinator` carries them out, and the rank side (:mod:`recovery.session`) reads
the generation's body.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

#: The most ranks a generation body may describe (a bound for receivers, far above any job).
MAX_WORLD_SIZE = 1 << 20
_NUMBERED = re.compile(r"(.*?)(0|[1-9][0-9]*)")


@dataclass(frozen=True, slots=True)
class Process:
    """A process the control plane knows: a rank, a spare or a node agent."""

    identity: str
    role: str
    node: int
    pid: int


@dataclass(frozen=True, slots=True)
class Generation:
    """One membership: the message every member of it receives."""

    generation: int
    world_size: int
    ranks: dict[int, str]
    """rank -> identity of the process holding it."""
    nodes: dict[int, int]
    """rank -> node of that process (failure domains for replica placement)."""
    replaced: dict[int, list[str]]
    """rank -> [old identity, new identity] for ranks a new process takes."""
    lost: list[int]
    """Ranks whose process was lost in this change (their state must come from replicas)."""
    committed_step: int
    store_prefix: str
    holders: dict[int, list[int]]
    """The replica map, rank -> ranks holding a copy of its shard: ``p2p_state.place`` of this
    generation's node map, which every rank computes alike from the body (not sent)."""
    replicas: int = 1
    """Replication factor k."""
    ranks_per_node: int = 1
    directive: str = "train"
    """``train``, or ``checkpoint``: restore, write a cold checkpoint and stop (the job ends)."""
    reason: str = ""
    renumbered: bool = False
    """Ranks moved or the world size changed: every member needs the full maps."""
    graceful: bool = False
    """A resize nothing forces: members finish their step and switch at the next commit of
    replication (no step lost); otherwise they abandon the step at once."""
    ack_timeout_s: float = 10.0
    """How long members have to acknowledge it (they bound their joining by half of it)."""

    def to_body(self, full: bool = True) -> dict[str, Any]:
        """msgpack-able form (map keys become strings); :func:`body_maps` reads its maps back.

        A full body carries the rank and node maps as runs (``rank_runs``, ``node_runs``):
        identities and nodes follow each other rank by rank, so 16,384 ranks on 2,048 nodes
        take ~50 KB instead of 400 KB, and the first generation, which every member receives
        whole, is 0.8 GB in all instead of 6.7 GB. ``full=False`` is for members that already
        hold the previous generation's maps: ``ranks`` and ``nodes`` then list only the ranks
        that changed (a few bytes). Newcomers (spares taking a rank) get the full maps.
        """
        full = full or self.renumbered
        changed = set() if full else set(self.replaced)
        body: dict[str, Any] = {
            "generation": self.generation,
            "world_size": self.world_size,
            "full": full,
            "ranks": {str(r): i for r, i in self.ranks.items() if r in changed},
            "nodes": {str(r): n for r, n in self.nodes.items() if r in changed},
            "replaced": {str(r): v for r, v in self.replaced.items()},
            "lost": self.lost,
            "committed_step": self.committed_step,
            "store_prefix": self.store_prefix,
            "replicas": self.replicas,
            "ranks_per_node": self.ranks_per_node,
            "directive": self.directive,
            "reason": self.reason,
            "graceful": self.graceful,
            "ack_timeout_s": self.ack_timeout_s,
        }
        if full:
            body["rank_runs"] = rank_runs(self.ranks)
            body["node_runs"] = node_runs(self.nodes)
        return body


def rank_runs(ranks: dict[int, str]) -> list[list[Any]]:
    """``ranks`` as runs ``[first_rank, count, prefix, first_number]``: rank ``first_rank + j``
    is held by ``f"{prefix}{first_number + j}"`` (``first_number`` ``None``: one rank, whose
    identity is ``prefix``)."""
    runs: list[list[Any]] = []
    for rank in sorted(ranks):
        m = _NUMBERED.fullmatch(ranks[rank])
        prefix, number = (m.group(1), int(m.group(2))) if m else (ranks[rank], None)
        last = runs[-1] if runs else None
        if (
            last is not None
            and number is not None
            and last[3] is not None
            and (last[0] + last[1], last[2], last[3] + last[1]) == (rank, prefix, number)
        ):
            last[1] += 1
        else:
            runs.append([rank, 1, prefix, number])
    return runs


def node_runs(nodes: dict[int, int]) -> list[list[int]]:
    """``nodes`` as runs ``[first_rank, count, node]`` of consecutive ranks on one node."""
    runs: list[list[int]] = []
    for rank in sorted(nodes):
        last = runs[-1] if runs else None
        if last is not None and last[0] + last[1] == rank and last[2] == nodes[rank]:
            last[1] += 1
        else:
            runs.append([rank, 1, nodes[rank]])
    return runs


def body_maps(body: dict[str, Any]) -> tuple[dict[int, str], dict[int, int]]:
    """The rank -> identity and rank -> node maps a generation body carries (all of them in a
    full body, the changed ranks' in a delta).

    Raises:
        ValueError: the body's maps are malformed (nothing is allocated beyond its world size).
    """
    try:
        return _body_maps(body)
    except (TypeError, ValueError, AttributeError) as e:
        if isinstance(e, ValueError) and str(e).startswith("generation body"):
            raise
        raise ValueError(f"generation body: malformed maps ({e})") from None


def _body_maps(body: dict[str, Any]) -> tuple[dict[int, str], dict[int, int]]:
    world = body.get("world_size")
    if not isinstance(world, int) or isinstance(world, bool) or not 0 < world <= MAX_WORLD_SIZE:
        raise ValueError(f"generation body: world_size {world!r} is not in 1..{MAX_WORLD_SIZE}")
    ranks = {int(r): str(i) for r, i in dict(body.get("ranks", {})).items()}
    nodes = {int(r): int(n) for r, n in dict(body.get("nodes", {})).items()}
    for run in list(body.get("rank_runs", [])):
        first, count, prefix, number = run
        _check_run(first, count, world, "rank_runs")
        if number is None and count != 1:
            raise ValueError("generation body: a rank run without a number spans one rank")
        for j in range(count):
            ranks[first + j] = str(prefix) if number is None else f"{prefix}{int(number) + j}"
    for run in list(body.get("node_runs", [])):
        first, count, node = run
        _check_run(first, count, world, "node_runs")
        for j in range(count):
            nodes[first + j] = int(node)
    return ranks, nodes


def _check_run(first: Any, count: Any, world: int, key: str) -> None:
    ok = all(isinstance(v, int) and not isinstance(v, bool) for v in (first, count))
    if not ok or first < 0 or count < 1 or first + count > world:
        raise ValueError(f"generation body: {key} run ({first!r}, {count!r}) outside 0..{world}")


# Actions for the shell.
@dataclass(frozen=True, slots=True)
class SendGeneration:
    """Send the generation to these identities."""

    to: tuple[str, ...]
    generation: Generation


@dataclass(frozen=True, slots=True)
class Kill:
    """Have the agent of ``node`` kill a process (hung, straggler, or superseded)."""

    node: int
    identity: str
    pid: int
    reason: str


@dataclass(frozen=True, slots=True)
class SpawnSpare:
    """Have the agent of ``node`` start a new spare."""

    node: int


@dataclass(frozen=True, slots=True)
class Interrupt:
    """Tell these identities their generation is broken; the next one comes within ``wait_s``."""

    to: tuple[str, ...]
    generation: int
    lost: tuple[int, ...]
    wait_s: float


@dataclass(frozen=True, slots=True)
class End:
    """The job is over: ``code`` 0 when every rank finished, non-zero on failure."""

    code: int
    reason: str


@dataclass(frozen=True, slots=True)
class Event:
    """A decision for the JSON-lines event log."""

    name: str
    fields: dict[str, Any] = field(default_factory=dict)


Decision = SendGeneration | Kill | SpawnSpare | Interrupt | End | Event
"""One thing the membership decided: an action for the coordinator's shell, or an event."""
