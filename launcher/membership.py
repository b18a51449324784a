"""Membership and generations: the coordinator's decisions, as a pure state machine.

Inputs are events with the time they happened (a process said hello, heartbeat, a process
exited or was reported faulty, an acknowledgement, a replication report, a clock tick); outputs
are actions for the shell around it to carry out (send a generation to its members, kill a
process, start a spare, end the job) and events for the log. No sockets, no clocks, no threads:
every decision is a function of what came in, and is tested that way.

A generation is the unit of membership change. On a fault the lost ranks get spares, the
generation number goes up, and one message tells every member everything: the rank map, who
replaces whom, the store prefix, the committed step. A member that does not acknowledge within
``ack_timeout_s`` is itself a fault, and a fault while a generation is pending starts the next.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from p2p_state.placement import place


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
    """rank -> [old identity, new identity] for ranks that changed process."""
    lost: list[int]
    """Ranks whose process was lost in this change (their state must come from replicas)."""
    committed_step: int
    store_prefix: str
    holders: dict[int, list[int]]
    """The replica map: rank -> ranks holding a copy of its shard (``p2p_state.place``)."""
    directive: str = "train"
    """``train``, or ``checkpoint``: restore, write a cold checkpoint and stop (the job ends)."""
    reason: str = ""
    renumbered: bool = False
    """Ranks moved or the world size changed: every member needs the full maps."""
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
            "directive": self.directive,
            "reason": self.reason,
            "ack_timeout_s": self.ack_timeout_s,
            "generation": self.generation,
            "world_size": self.world_size,
            "full": full,
            "ranks": {str(r): i for r, i in self.ranks.items() if r in changed},
            "nodes": {str(r): n for r, n in self.nodes.items() if r in changed},
            "replaced": {str(r): v for r, v in self.replaced.items()},
            "lost": self.lost,
            "committed_step": self.committed_step,
            "store_prefix": self.store_prefix,
            "holders": {str(r): h for r, h in self.holders.items() if r in changed},
        }


# Actions for the shell.
@dataclass(frozen=True, slots=True)
class Send:
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


@dataclass(frozen=True, slots=True, kw_only=True)
class MembershipConfig:
    """Sizes and deadlines of a job's membership."""

    world_size: int
    ranks_per_node: int
    heartbeat_timeout_s: float = 3.0
    """Silence after which a process (or a whole node, for an agent) is declared lost."""
    ack_timeout_s: float = 10.0
    """Time members have to acknowledge a new generation before stragglers are faults."""
    spare_wait_s: float = 60.0
    """With no spare left, how long a lost rank may wait for one before the job fails."""
    replicas: int = 1
    """Replication factor k of the data plane (for the replica map in every generation)."""
    stop_timeout_s: float = 300.0
    """When the job must stop (no spare in time), how long the survivors have to write their
    checkpoint before the job ends anyway."""

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.ranks_per_node < 1:
            raise ValueError(
                f"world_size={self.world_size} and ranks_per_node={self.ranks_per_node} "
                "must both be >= 1"
            )
        if not 1 <= self.replicas < max(2, self.world_size):
            raise ValueError(
                f"MembershipConfig.replicas={self.replicas} must be >= 1 and below the world "
                f"size {self.world_size}"
            )
        for name in ("heartbeat_timeout_s", "ack_timeout_s", "spare_wait_s", "stop_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"MembershipConfig.{name} must be > 0")


class Membership:
    """Who is in the job, which generation it is in, and what to do on each event."""

    def __init__(self, config: MembershipConfig) -> None:
        self.config = config
        if config.world_size > 1:
            placement = place(config.world_size, config.ranks_per_node, config.replicas)
            self._replica_map = {r: list(h) for r, h in enumerate(placement.holders)}
        else:
            self._replica_map = {0: []}
        self.generation = 0
        self.procs: dict[str, Process] = {}
        self.ranks: dict[int, str] = {}
        self.spares: list[str] = []
        self.last_seen: dict[str, float] = {}
        self.replicated: dict[int, int] = {}
        self.finished: set[int] = set()
        self.done: set[str] = set()
        """Ranks that completed their training and are leaving (no heartbeat deadline)."""
        self.failed_after_done: list[str] = []
        """Ranks that failed once others had completed: the job's end reports them."""
        self.assigned: dict[int, list[str]] = {}
        """Ranks given to spares whose generation has not started yet: rank -> [old, new]."""
        self.pending: Generation | None = None
        self.acks: set[str] = set()
        self.awaiting: set[str] = set()
        """Members of the pending generation that have not acknowledged it yet."""
        self.ack_deadline = 0.0
        self.vacant: dict[int, str] = {}
        """Lost ranks still waiting for a spare -> the identity they had."""
        self.vacant_since = 0.0
        self.ended = False
        self.gone: set[str] = set()
        """Identities already declared lost (their later exit reports change nothing)."""
        self.stopping: Generation | None = None
        """The final generation (checkpoint and stop) once the job must stop."""
        self.stop_deadline = 0.0
        self.notified: set[int] = set()
        """Vacant ranks whose fault the live ranks were already told about."""

    # -- queries -------------------------------------------------------------------------------

    @property
    def committed_step(self) -> int:
        """Minimum over all ranks of their last replicated step (-1 if none yet).

        Kept per rank, not per process: a lost rank's last report still says which step its
        buddies hold, and that is the step its replacement restores.
        """
        return min(self.replicated.get(r, -1) for r in range(self.config.world_size))

    def rank_of(self, identity: str) -> int | None:
        """The rank a process holds, if any."""
        for r, i in self.ranks.items():
            if i == identity:
                return r
        return None

    # -- events --------------------------------------------------------------------------------

    def hello(self, proc: Process, rank: int | None, now: float) -> list[Any]:
        """A process connected. Ranks say which rank they start as; spares join the pool."""
        out: list[Any] = []
        self.procs[proc.identity] = proc
        self.last_seen[proc.identity] = now
        if proc.role == "rank" and rank is not None and self.generation == 0:
            if not 0 <= rank < self.config.world_size or rank in self.ranks:
                out.append(Event("rejected_rank", {"identity": proc.identity, "rank": rank}))
                return out
            self.ranks[rank] = proc.identity
            out.append(Event("rank_joined", {"rank": rank, "identity": proc.identity}))
            if len(self.ranks) == self.config.world_size:
                out += self._new_generation(lost=[], replaced={}, now=now)
        elif proc.role == "spare":
            self.spares.append(proc.identity)
            out.append(Event("spare_joined", {"identity": proc.identity, "node": proc.node}))
            if self.vacant:
                out += self._fill_vacancies(now)
        return out

    def heartbeat(self, identity: str, now: float) -> None:
        """A sign of life."""
        if identity in self.procs and identity not in self.done:
            self.last_seen[identity] = now

    def report_done(self, identity: str) -> list[Any]:
        """A rank completed its training and is about to exit: stop watching its heartbeats."""
        rank = self.rank_of(identity)
        if rank is None or identity in self.done:
            return []
        self.done.add(identity)
        self.last_seen.pop(identity, None)
        return [Event("rank_done", {"rank": rank, "identity": identity})]

    def _finish(self, rank: int, identity: str, failure: str | None = None) -> list[Any]:
        self.finished.add(rank)
        out: list[Any] = [Event("rank_finished", {"rank": rank, "identity": identity})]
        if failure is not None:
            self.failed_after_done.append(f"rank {rank} {failure}")
        if len(self.finished) == self.config.world_size:
            if self.failed_after_done:
                out += self._end(
                    1, "the training completed, but " + "; ".join(self.failed_after_done)
                )
            else:
                out += self._end(0, "every rank finished")
        return out

    def report_replicated(self, identity: str, step: int) -> list[Any]:
        """A rank finished replicating ``step``; the committed step may advance."""
        rank = self.rank_of(identity)
        if rank is None or step <= self.replicated.get(rank, -1):
            return []
        before = self.committed_step
        self.replicated[rank] = step
        after = self.committed_step
        return [Event("committed", {"step": after})] if after > before else []

    def exited(self, identity: str, code: int, now: float, rank: int | None = None) -> list[Any]:
        """A process ended (seen by its agent). Code 0 from a rank means it finished.

        ``rank`` is what its agent started it as: a script that does not use the engine never
        says hello, yet its end still counts (code 0: finished; otherwise the job fails, as
        there is no state to recover it from).
        """
        proc = self.procs.get(identity)
        if proc is None:
            if identity in self.gone or rank is None or self.ended:
                return []
            self.gone.add(identity)
            if code != 0:
                return self._end(
                    1,
                    f"rank {rank} ({identity}) exited with code {code} and does not use the "
                    "engine, so it cannot be recovered in process",
                )
            return self._finish(rank, identity)
        rank = self.rank_of(identity)
        if self.stopping is not None:
            return self._stopped_one(identity)
        if rank is not None and (code == 0 or identity in self.done):
            self.procs.pop(identity, None)
            self.last_seen.pop(identity, None)
            self.gone.add(identity)
            return self._finish(rank, identity, None if code == 0 else f"exited with code {code}")
        return self.fault(identity, f"exited with code {code}", now)

    def fault(self, identity: str, reason: str, now: float) -> list[Any]:
        """A process is lost (crashed, hung, reported a collective failure, straggled).

        A lost agent is a lost node: every process it started is lost with it, and all the
        node's ranks are replaced in one generation.
        """
        out = self._lose(identity, reason, now)
        return out + self._fill_vacancies(now) if out else out

    def _lose(self, identity: str, reason: str, now: float) -> list[Any]:
        proc = self.procs.pop(identity, None)
        self.last_seen.pop(identity, None)
        if proc is None or self.ended:
            return []
        if self.stopping is not None:  # no more generations: a loss only counts as an exit
            return [Event("fault", {"identity": identity, "reason": reason})] + (
                self._stopped_one(identity) if proc.role != "agent" else []
            )
        self.gone.add(identity)
        self.awaiting.discard(identity)  # a lost member is no longer awaited
        out: list[Any] = [Event("fault", {"identity": identity, "reason": reason})]
        if proc.role == "agent":
            for other in [p for p in self.procs.values() if p.node == proc.node]:
                out += self._lose(other.identity, f"node {proc.node} lost ({reason})", now)
            return out
        if identity in self.spares:
            self.spares.remove(identity)
            return [*out, SpawnSpare(proc.node)]
        rank = self.rank_of(identity)
        if rank is None or rank in self.finished:
            return out
        if self.done:
            # Others completed the training and are leaving: there is no job left to rejoin.
            return out + self._finish(rank, identity, f"was lost ({reason})")
        del self.ranks[rank]
        if not self.vacant:
            self.vacant_since = now
        self.vacant[rank] = identity
        return out

    def ack(self, identity: str, generation: int, now: float) -> list[Any]:
        """A member acknowledged a generation."""
        if self.pending is None or generation != self.pending.generation:
            return []
        self.acks.add(identity)
        self.awaiting.discard(identity)
        if not self.awaiting:  # O(1) per ack: 2,048 acks must not cost 2,048^2 set operations
            g = self.pending
            self.pending = None
            return [Event("generation_complete", {"generation": g.generation})]
        return []

    def tick(self, now: float) -> list[Any]:
        """Check every deadline: heartbeats, acknowledgements, waiting for spares."""
        out: list[Any] = []
        timeout = self.config.heartbeat_timeout_s
        for identity, seen in sorted(self.last_seen.items()):
            if now - seen > timeout and identity in self.procs:
                proc = self.procs[identity]
                if proc.role != "agent":
                    out.append(Kill(proc.node, identity, proc.pid, "missed heartbeats"))
                out += self._lose(identity, f"no heartbeat for {now - seen:.1f}s", now)
        if self.pending is not None and self.awaiting and now > self.ack_deadline:
            late = sorted(self.awaiting)
            out.append(Event("stragglers", {"generation": self.pending.generation, "late": late}))
            for identity in late:
                proc = self.procs.get(identity)
                if proc is not None:
                    out.append(Kill(proc.node, identity, proc.pid, "did not acknowledge"))
                    out += self._lose(identity, "did not acknowledge in time", now)
        if any(isinstance(a, Event) and a.name == "fault" for a in out):
            out += self._fill_vacancies(now)  # everything lost in this tick: one generation
        if (
            self.vacant
            and not self.ended
            and self.stopping is None
            and now - self.vacant_since > self.config.spare_wait_s
        ):
            out += self._stop(
                f"no spare for ranks {sorted(self.vacant)} within {self.config.spare_wait_s:.0f}s "
                "(--spare-wait); add spares with --spares",
                now,
            )
        if self.stopping is not None and not self.ended and now > self.stop_deadline:
            out += self._end(
                1, f"{self.stopping.reason} (the stop checkpoint did not finish in time)"
            )
        return out

    # -- internals -----------------------------------------------------------------------------

    def _fill_vacancies(self, now: float) -> list[Any]:
        if self.stopping is not None:
            return []
        out: list[Any] = []
        for rank in sorted(self.vacant):
            if not self.spares:
                out.append(Event("waiting_for_spare", {"rank": rank}))
                continue
            spare = self.spares.pop(0)
            self.ranks[rank] = spare
            self.assigned[rank] = [self.vacant.pop(rank), spare]
            out.append(Event("spare_assigned", {"rank": rank, "identity": spare}))
            out.append(SpawnSpare(self.procs[spare].node))
        if self.assigned and not self.vacant:
            # Every vacancy has its spare: one generation with every replacement made since
            # the last one (spares may have arrived one by one).
            replaced, self.assigned = self.assigned, {}
            out += self._new_generation(lost=sorted(replaced), replaced=replaced, now=now)
        fresh = sorted(set(self.vacant) - self.notified)
        if fresh and self.ranks:
            # No spare yet: stop the survivors now (their collectives would otherwise wait on
            # the lost rank) and tell them how long the next generation may take.
            self.notified.update(fresh)
            out.append(
                Interrupt(
                    tuple(self.ranks.values()),
                    self.generation,
                    tuple(sorted(self.vacant)),
                    self.config.spare_wait_s,
                )
            )
        return out

    def _stop(self, reason: str, now: float) -> list[Any]:
        """The survivors restore the committed state among themselves, checkpoint it, and stop.

        They form one last generation of their own (renumbered in rank order, a smaller world
        whose state is resharded from the replicas of the lost ranks), so the checkpoint holds
        the lost ranks' shards too.
        """
        survivors = [i for _, i in sorted(self.ranks.items())]
        if not survivors:
            return self._end(1, reason)
        self.ranks = dict(enumerate(survivors))
        lost = sorted(self.vacant)
        self.vacant.clear()
        self.assigned.clear()
        out = [Event("job_stopping", {"reason": reason, "survivors": len(survivors)})]
        out += self._new_generation(
            lost=lost, replaced={}, now=now, directive="checkpoint", reason=reason
        )
        self.stopping = self.pending
        self.stop_deadline = now + self.config.stop_timeout_s
        self.awaiting = set()  # members exit when done; their exits end the job
        return out

    def _stopped_one(self, identity: str) -> list[Any]:
        assert self.stopping is not None
        members = set(self.stopping.ranks.values())
        self.gone.add(identity)
        if members <= self.gone and not self.ended:
            return self._end(1, f"{self.stopping.reason}; the survivors wrote a checkpoint")
        return []

    def _new_generation(
        self,
        lost: list[int],
        replaced: dict[int, list[str]],
        now: float,
        directive: str = "train",
        reason: str = "",
    ) -> list[Any]:
        self.generation += 1
        world = len(self.ranks) if directive == "checkpoint" else self.config.world_size
        gen = Generation(
            generation=self.generation,
            world_size=world,
            ranks=dict(sorted(self.ranks.items())),
            nodes={r: self.procs[i].node for r, i in sorted(self.ranks.items())},
            replaced=replaced,
            lost=lost,
            committed_step=self.committed_step,
            store_prefix=f"gen{self.generation}/",
            holders=self._replica_map if world == self.config.world_size else {},
            directive=directive,
            reason=reason,
            renumbered=world != self.config.world_size,
            ack_timeout_s=self.config.ack_timeout_s,
        )
        superseded = self.pending
        self.pending = gen
        self.acks = set()
        self.awaiting = set(gen.ranks.values())
        self.ack_deadline = now + self.config.ack_timeout_s
        fields = {"generation": gen.generation, "lost": lost, "replaced": replaced}
        if superseded is not None:
            fields["supersedes"] = superseded.generation
        return [Event("generation_started", fields), Send(tuple(gen.ranks.values()), gen)]

    def end(self, code: int, reason: str) -> list[Any]:
        """End the job (a fatal report from a rank); nothing happens if it already ended."""
        return self._end(code, reason)

    def _end(self, code: int, reason: str) -> list[Any]:
        if self.ended:
            return []
        self.ended = True
        return [Event("job_ended", {"code": code, "reason": reason}), End(code, reason)]
