"""What the membership state machine decides: the generation message and the coordinator's actions.

Plain data, no behaviour: :mod:`launcher.membership` produces them (lists of :data:`Decision`),
:mod:`launcher.coordinator` carries them out, and the rank side (:mod:`recovery.session`) reads
the generation's body.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
        """msgpack-able form (map keys become strings).

        ``full=False`` is for members that already hold the previous generation's map: the rank
        and node maps then list only the ranks that changed (a few bytes instead of tens of KB
        at 2,048 ranks). Newcomers (spares taking a rank) get the full maps.
        """
        full = full or self.renumbered
        changed = set(self.replaced) if not full else set(self.ranks)
        return {
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
