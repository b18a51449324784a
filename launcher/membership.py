"""Membership and generations: the coordinator's decisions, as a pure state machine.

Inputs are events with the time they happened (a process said hello, heartbeat, a process
exited or was reported faulty, an acknowledgement, a replication report, an operator's resize
request, a clock tick); outputs are actions for the shell around it to carry out (send a
generation to its members, kill a process, start a spare, end the job) and events for the log.
No sockets, no clocks, no threads: every decision is a function of what came in, and is tested
that way. *What* to do about lost ranks, idle spares and resize requests is the elastic policy's
call (:mod:`launcher.policy`); this module keeps the books and turns its decisions into
generations.

A generation is the unit of membership change. On a fault the lost ranks get spares (or, with no
spare in time, the job shrinks if it is elastic, or stops with a checkpoint if not), the
generation number goes up, and one message tells every member everything: the rank and node
maps, who replaces whom, the store prefix, the committed step. A member that does not
acknowledge within ``ack_timeout_s`` is itself a fault, and a fault while a generation is pending
starts the next. A resize nothing forces (growing into spares, giving ranks back) is *graceful*:
members finish their step and switch at the next commit of replication, so no step is lost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from launcher.config import setting
from launcher.decisions import (
    Decision,
    End,
    Event,
    Generation,
    Interrupt,
    Kill,
    Process,
    SendGeneration,
    SpawnSpare,
)
from launcher.policy import (
    Capacity,
    ElasticConfig,
    Fail,
    Hold,
    PolicyState,
    Replace,
    Resize,
    decide,
)
from p2p_state.placement import place

__all__ = [
    "Decision",
    "End",
    "Event",
    "Generation",
    "Interrupt",
    "Kill",
    "Membership",
    "MembershipConfig",
    "Process",
    "SendGeneration",
    "SpawnSpare",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class MembershipConfig:
    """Sizes and deadlines of a job's membership."""

    world_size: int
    """Ranks the job starts with."""
    ranks_per_node: int
    heartbeat_timeout_s: float = setting(
        3.0,
        flag="--heartbeat-timeout",
        help="silence after which a process is lost, seconds (default {default})",
    )
    """Silence after which a process (or a whole node, for an agent) is declared lost."""
    ack_timeout_s: float = setting(
        10.0,
        flag="--ack-timeout",
        help="deadline to acknowledge a new generation, seconds (default {default})",
    )
    """Time members have to acknowledge a new generation before stragglers are faults."""
    spare_wait_s: float = setting(
        60.0,
        flag="--spare-wait",
        help="how long a lost rank may wait for a spare, seconds (default {default})",
    )
    """With no spare left, how long a lost rank may wait for one (or come back) before the job
    shrinks (elastic) or stops with a checkpoint."""
    replicas: int = setting(
        1, flag="--replicas", help="replication factor k of the data plane (default {default})"
    )
    """Replication factor k of the data plane (for the replica map in every generation)."""
    stop_timeout_s: float = 300.0
    """When the job must stop (no spare in time), how long the survivors have to write their
    checkpoint before the job ends anyway."""
    elastic: ElasticConfig | None = None
    """Bounds and timings of resizing; ``None``: the world size never changes."""
    refill_delay_s: float = 5.0
    """A spare used up is replaced once the job replicates again after the change, or after
    this long at the latest (a new spare's start-up competes with the recovery for CPU)."""
    max_restarts: int = setting(
        3,
        flag=("--max-restarts", "--max_restarts"),
        help="recoveries in a row that may fail to get the training past its last committed "
        "step; one more fault stops the job with a checkpoint (0: stop at the first fault; "
        "default {default})",
    )
    """Recoveries from faults in a row without the training advancing (no new committed step
    since the previous one): one more fault then stops the job with a checkpoint instead. A
    fault that repeats on every recovery (a rank that cannot restore) ends instead of using up
    spares forever, while a long job survives any number of unrelated faults."""
    join_timeout_s: float | None = None
    """Start-up deadline: when the agent of a node the job starts with has not said hello
    this long after the coordinator's first tick, the job ends (code ``JOIN_FAILED``) naming
    those nodes. ``None``: wait for them forever."""

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
        if self.join_timeout_s is not None and self.join_timeout_s <= 0:
            raise ValueError(f"MembershipConfig.join_timeout_s={self.join_timeout_s} must be > 0")
        for name in ("heartbeat_timeout_s", "ack_timeout_s", "spare_wait_s", "stop_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"MembershipConfig.{name} must be > 0")
        if self.max_restarts < 0:
            raise ValueError(f"MembershipConfig.max_restarts={self.max_restarts} must be >= 0")
        if self.elastic is not None:
            if not self.elastic.min_ranks <= self.world_size <= self.elastic.max_ranks:
                raise ValueError(
                    f"the job starts with {self.world_size} ranks, outside --min-ranks "
                    f"{self.elastic.min_ranks} .. --max-ranks {self.elastic.max_ranks}"
                )
            if self.elastic.min_ranks <= self.replicas and self.world_size > 1:
                raise ValueError(
                    f"--min-ranks {self.elastic.min_ranks} leaves no room for {self.replicas} "
                    "replica(s) of every shard on other ranks; raise it above --replicas"
                )

    @property
    def policy(self) -> ElasticConfig:
        """The elastic policy; a fixed-size job is one whose only allowed size is its own."""
        if self.elastic is not None:
            return self.elastic
        return ElasticConfig(
            min_ranks=self.world_size,
            max_ranks=self.world_size,
            scale_down_wait_s=self.spare_wait_s,
        )


#: The share of ``ack_timeout_s`` a generation may take to form before the coordinator warns.
#: Each group must form within half of the deadline (the members' join deadline), and a member
#: that has read every address may wait up to half of that again, uninterrupted, for a peer
#: still reading the store (``recovery.comms.creation_timeout``): a generation whose groups
#: already take a quarter of it leaves no margin for a recovery's own delays.
FORMATION_SHARE = 0.25

#: The end code of a job whose nodes did not all join within ``join_timeout_s``.
JOIN_FAILED = 3
#: In the reason a job ends with when a rank that never spoke to the coordinator fails.
NOT_THE_ENGINE = "does not use the engine"


class Membership:
    """Who is in the job, which generation it is in, and what to do on each event."""

    def __init__(self, config: MembershipConfig) -> None:
        self.config = config
        self.policy = config.policy
        self.policy_state = PolicyState.initial()
        self.world_size = config.world_size
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
        self.awaiting: set[str] = set()
        """Members of the pending generation that have not acknowledged it yet."""
        self.arrived: set[str] = set()
        """Members of the pending generation that left their old groups and are forming it."""
        self.ack_deadline = 0.0
        self.pending_t = 0.0
        """When the pending generation started."""
        self.vacant: dict[int, str] = {}
        """Lost ranks not replaced yet -> the identity they had."""
        self.last_error: tuple[str, str] | None = None
        """The last process whose exit came with a recorded exception, and that exception:
        named when the job stops because the same rank keeps failing."""
        self.vacant_since: dict[int, float] = {}
        self.notified: set[int] = set()
        """Vacant ranks whose fault the live ranks were already told about."""
        self.requested_size: int | None = None
        """A world size an operator asked for (``p2p-run scale``)."""
        self.leaving: dict[str, float] = {}
        """Ranks given back by a resize -> the time they are killed if still running."""
        self.released: set[str] = set()
        """Spares given back by a resize (not refilled)."""
        self.switching: set[str] = set()
        """Members of a graceful generation not yet seen replicating in it: no other resize
        is decided until they have switched."""
        self.refills: list[int] = []
        """Nodes owed a new spare: started once the job is back (spare start-up competes
        with the recovery for the node's CPU), or at once when a vacancy has no spare."""
        self.refill_gate = -1
        """Committed step at the last generation: refills wait until it advances."""
        self.refill_gate_t = 0.0
        self.ended = False
        self.gone: set[str] = set()
        """Identities already declared lost (their later exit reports change nothing)."""
        self.stopping: Generation | None = None
        """The final generation (checkpoint and stop) once the job must stop."""
        self.stop_deadline = 0.0
        self.stop_written: dict[str, int] = {}
        """Members of the stopping generation that reported the stop checkpoint written."""
        self.restarts = 0
        """Generations started for faults since the committed step last advanced past
        ``restart_mark`` (the committed step the latest of them restored)."""
        self.restart_mark = -1
        self.agents_seen: set[int] = set()
        """Nodes whose agent said hello (the start-up deadline waits for those of the start)."""
        self.join_deadline: float | None = None

    # -- queries -------------------------------------------------------------------------------

    @property
    def committed_step(self) -> int:
        """Minimum over all ranks of their last replicated step (-1 if none yet).

        Kept per rank, not per process: a lost rank's last report still says which step its
        buddies hold, and that is the step its replacement restores.
        """
        return min(self.replicated.get(r, -1) for r in range(self.world_size))

    def rank_of(self, identity: str) -> int | None:
        """The rank a process holds, if any."""
        for r, i in self.ranks.items():
            if i == identity:
                return r
        return None

    # -- events --------------------------------------------------------------------------------

    def hello(self, proc: Process, rank: int | None, now: float) -> list[Decision]:
        """A process connected. Ranks say which rank they start as; spares join the pool."""
        out: list[Decision] = []
        self.procs[proc.identity] = proc
        self.last_seen[proc.identity] = now
        if proc.role == "agent":
            self.agents_seen.add(proc.node)
        if proc.role == "rank" and rank is not None and self.generation == 0:
            if not 0 <= rank < self.world_size or rank in self.ranks:
                out.append(Event("rejected_rank", {"identity": proc.identity, "rank": rank}))
                return out
            self.ranks[rank] = proc.identity
            out.append(Event("rank_joined", {"rank": rank, "identity": proc.identity}))
            if len(self.ranks) == self.world_size:
                out += self._new_generation(lost=[], replaced={}, now=now)
        elif proc.role == "spare":
            self.spares.append(proc.identity)
            out.append(Event("spare_joined", {"identity": proc.identity, "node": proc.node}))
            out += self._decide(now)
        return out

    def heartbeat(self, identity: str, now: float) -> None:
        """A sign of life."""
        if identity in self.procs and identity not in self.done:
            self.last_seen[identity] = now

    def report_done(self, identity: str, checkpoint_step: int | None = None) -> list[Decision]:
        """A rank completed its training and is about to exit: stop watching its heartbeats.

        ``checkpoint_step``: a member of the stopping generation wrote the stop checkpoint.
        """
        rank = self.rank_of(identity)
        if self.stopping is not None and checkpoint_step is not None and rank is not None:
            self.stop_written[identity] = checkpoint_step
        if rank is None or identity in self.done:
            return []
        self.done.add(identity)
        self.last_seen.pop(identity, None)
        return [Event("rank_done", {"rank": rank, "identity": identity})]

    def report_replicated(
        self, identity: str, step: int, generation: int | None = None
    ) -> list[Decision]:
        """A rank finished replicating ``step`` (in ``generation``); the committed step may
        advance, and a graceful switch is confirmed once every member replicates in it."""
        if generation is not None and generation >= self.generation:
            self.switching.discard(identity)
        rank = self.rank_of(identity)
        if rank is None or step <= self.replicated.get(rank, -1):
            return []
        before = self.committed_step
        self.replicated[rank] = step
        after = self.committed_step
        out: list[Decision] = [Event("committed", {"step": after})] if after > before else []
        if self.restarts and after > self.restart_mark:
            self.restarts = 0  # the training advanced since the last recovery
        return out + self._release_refills(force=False)

    def request_size(self, size: int, now: float) -> list[Decision]:
        """An operator asked for ``size`` ranks (to give some back, or to grow into spares)."""
        self.requested_size = size
        return [Event("scale_requested", {"size": size}), *self._decide(now)]

    def exited(
        self, identity: str, code: int, now: float, rank: int | None = None, error: str = ""
    ) -> list[Decision]:
        """A process ended (seen by its agent). Code 0 from a rank means it finished.

        ``rank`` is what its agent started it as: a script that does not use the engine never
        says hello, yet its end still counts (code 0: finished; otherwise the job fails, as
        there is no state to recover it from). ``error`` is the exception it recorded, if any
        (torchrun's error file): it ends the reason given for its loss.
        """
        exit_ = f"exited with code {code}" + (f" ({error})" if error else "")
        if error and code != 0:
            self.last_error = (identity, error)
        proc = self.procs.get(identity)
        if proc is None:
            if identity in self.gone or rank is None or self.ended:
                return []
            self.gone.add(identity)
            if code != 0:
                return self._end(
                    1,
                    f"rank {rank} ({identity}) {exit_} and {NOT_THE_ENGINE}, "
                    "so it cannot be recovered in process",
                )
            return self._finish(rank, identity)
        if identity in self.leaving or identity in self.released:
            self._forget(identity)
            return [Event("process_left", {"identity": identity, "code": code})]
        rank = self.rank_of(identity)
        if self.stopping is not None:
            return self._stopped_one(identity)
        if rank is not None and (code == 0 or identity in self.done):
            self._forget(identity)
            return self._finish(rank, identity, None if code == 0 else exit_)
        return self.fault(identity, exit_, now)

    def fault(self, identity: str, reason: str, now: float) -> list[Decision]:
        """A process is lost (crashed, hung, reported a collective failure, straggled).

        A lost agent is a lost node: every process it started is lost with it, and all the
        node's ranks are handled in one decision.
        """
        out = self._lose(identity, reason, now)
        return out + self._decide(now) if out else out

    def ack(self, identity: str, generation: int, now: float) -> list[Decision]:
        """A member acknowledged a generation."""
        if self.pending is None or generation != self.pending.generation:
            return []
        self.awaiting.discard(identity)
        if not self.awaiting:  # O(1) per ack: 2,048 acks must not cost 2,048^2 set operations
            g = self.pending
            self.pending = None
            formed_s = round(now - self.pending_t, 3)
            out: list[Decision] = [
                Event("generation_complete", {"generation": g.generation, "formed_s": formed_s})
            ]
            limit_s = self.config.ack_timeout_s * FORMATION_SHARE
            if not g.graceful and formed_s > limit_s:
                fields = {
                    "generation": g.generation,
                    "formed_s": formed_s,
                    "ack_timeout_s": self.config.ack_timeout_s,
                    "advised_ack_timeout_s": math.ceil(formed_s / FORMATION_SHARE),
                }
                out.append(Event("slow_formation", fields))
            return out
        return []

    def arrive(self, identity: str, generation: int) -> list[Decision]:
        """A member left its old generation's groups and is forming the pending one."""
        pending = self.pending
        if pending is not None and generation == pending.generation and identity in self.awaiting:
            self.arrived.add(identity)
        return []

    def tick(self, now: float) -> list[Decision]:
        """Check every deadline: heartbeats, acknowledgements, leavers, the policy's timers."""
        out: list[Decision] = self._check_join(now)
        timeout = self.config.heartbeat_timeout_s
        # One pass without sorting every member (this runs after every batch of messages):
        # only the few that missed their heartbeats are sorted, for a deterministic order.
        missed = sorted((i, seen) for i, seen in self.last_seen.items() if now - seen > timeout)
        for identity, seen in missed:
            if identity in self.procs:
                proc = self.procs[identity]
                agent = f"agent/{proc.node}"
                # A rank's beats travel through its agent: when the agent has fallen silent too,
                # the node is what was lost (the agent's own last beat may be a little newer).
                if agent in self.procs and now - self.last_seen.get(agent, now) > timeout / 2:
                    out += self._lose(agent, f"no heartbeat for {now - seen:.1f}s", now)
                    continue
                if proc.role != "agent":
                    out.append(Kill(proc.node, identity, proc.pid, "missed heartbeats"))
                out += self._lose(identity, f"no heartbeat for {now - seen:.1f}s", now)
        if self.pending is not None and self.awaiting and now > self.ack_deadline:
            late = sorted(self.awaiting)
            missing = [identity for identity in late if identity not in self.arrived]
            fields = {"generation": self.pending.generation, "late": late, "not_arrived": missing}
            out.append(Event("stragglers", fields))
            # The members that arrived could not form the generation without those that did
            # not (a survivor held up leaving its old groups, a spare still starting): only
            # those are replaced, and the rest wait for the generation that replaces them. When
            # every member arrived and it still did not form, none is more to blame: all go.
            culprits = missing or late
            if missing:
                self.awaiting.clear()  # no acknowledgement of this generation can come now
            why = "did not arrive" if missing else "did not acknowledge"
            for identity in culprits:
                late_proc = self.procs.get(identity)
                if late_proc is not None:
                    out.append(Kill(late_proc.node, identity, late_proc.pid, why))
                    out += self._lose(identity, f"{why} in time", now)
        for identity, deadline in sorted(self.leaving.items()):
            leaver = self.procs.get(identity)
            if now > deadline and leaver is not None:
                out.append(Kill(leaver.node, identity, leaver.pid, "given back and still running"))
                self.leaving[identity] = float("inf")
        out += self._decide(now)
        out += self._release_refills(force=False, now=now)
        if self.stopping is not None and not self.ended and now > self.stop_deadline:
            out += self._end(
                1, f"{self.stopping.reason} (the stop checkpoint did not finish in time)"
            )
        return out

    def missing_nodes(self) -> list[int]:
        """Nodes of the start whose agent has not said hello yet."""
        nnodes = self.config.world_size // self.config.ranks_per_node
        return [n for n in range(nnodes) if n not in self.agents_seen]

    def _check_join(self, now: float) -> list[Decision]:
        if self.config.join_timeout_s is None or self.ended or self.join_deadline == float("inf"):
            return []
        if self.join_deadline is None:
            self.join_deadline = now + self.config.join_timeout_s
        missing = self.missing_nodes()
        if not missing:
            self.join_deadline = float("inf")  # everyone arrived: the deadline is over
            return []
        if now <= self.join_deadline:
            return []
        return self._end(
            JOIN_FAILED,
            f"node(s) {missing} did not join within {self.config.join_timeout_s:.0f}s "
            "(--join-timeout): they were never started, or cannot reach the coordinator or "
            "the run directory",
        )

    def end(self, code: int, reason: str) -> list[Decision]:
        """End the job (a fatal report from a rank); nothing happens if it already ended."""
        return self._end(code, reason)

    def took_over(self, now: float) -> list[Decision]:
        """A standby coordinator took over with this (mirrored) state.

        A generation still pending was being set up through the old coordinator's store,
        which is gone with it: the same change starts again as the next generation, through
        the new store (the census finds every copy again). A job between faults goes on
        untouched: nothing is sent to the ranks.
        """
        g = self.stopping or self.pending
        out: list[Decision] = [
            Event("takeover_state", {"generation": self.generation, "restarted": bool(g)})
        ]
        if g is None or self.ended:
            return out
        stopping = self.stopping is not None
        self.pending = None
        out += self._new_generation(
            lost=list(g.lost),
            replaced=g.replaced,
            now=now,
            directive=g.directive,
            reason=g.reason,
            graceful=g.graceful,
            renumbered=g.renumbered,
        )
        if stopping:  # the stop in progress, through the new store; members exit when done
            self.stopping = self.pending
            self.awaiting = set()
        return out

    # -- decisions -----------------------------------------------------------------------------

    def _decide(self, now: float) -> list[Decision]:
        """Ask the elastic policy what to do with the vacancies, spares and requests now."""
        if (
            self.ended
            or self.stopping is not None
            or self.done
            or self.finished
            or self.generation == 0
        ):
            return []  # not started, or ending: nothing to replace, shrink or grow
        requested = self.requested_size
        if self.switching and not self.vacant:
            return []  # one graceful resize at a time: wait until its members have switched
        if self.vacant and self.restarts >= self.config.max_restarts:
            return self._stop(self._budget_spent(), now)
        capacity = Capacity(
            world_size=self.world_size,
            active={r: self.procs[i].node for r, i in self.ranks.items()},
            vacant={r: self.vacant_since[r] for r in self.vacant},
            spares={s: self.procs[s].node for s in self.spares},
            requested_size=requested,
        )
        decision, self.policy_state = decide(self.policy, self.policy_state, capacity, now)
        if isinstance(decision, Replace):
            return self._replace(decision.assignments, now)
        if isinstance(decision, Resize):
            return self._resize(decision, now)
        if isinstance(decision, Fail):
            reason = decision.reason
            if self.config.elastic is None:
                reason = (
                    f"no spare for ranks {sorted(self.vacant)} within "
                    f"{self.config.spare_wait_s:.0f}s (--spare-wait); add spares with --spares, "
                    "or let the job shrink (--min-ranks)"
                )
            return self._stop(reason, now)
        assert isinstance(decision, Hold)
        return self._notify(decision, now)

    def _budget_spent(self) -> str:
        lost = f"rank(s) {sorted(self.vacant)} lost"
        if self.config.max_restarts == 0:
            return f"{lost} and --max-restarts is 0 (no recovery allowed)"
        reached = (
            "through its first step" if self.restart_mark < 0 else f"past step {self.restart_mark}"
        )
        why = "the failing rank's log says why"
        if self.last_error is not None and self.last_error[0] in self.vacant.values():
            identity, error = self.last_error
            rank = next(r for r, i in self.vacant.items() if i == identity)
            why = f"rank {rank} ({identity}) failed with {error}"
        return (
            f"{lost} again after {self.restarts} "
            f"{'recovery' if self.restarts == 1 else 'recoveries'} in a row that never got the "
            f"training {reached} (--max-restarts {self.config.max_restarts}): {why}; fix that, "
            "or raise --max-restarts"
        )

    def _replace(self, assignments: dict[int, str], now: float) -> list[Decision]:
        out: list[Decision] = []
        for rank, spare in sorted(assignments.items()):
            self.spares.remove(spare)
            self.ranks[rank] = spare
            self.assigned[rank] = [self.vacant.pop(rank), spare]
            self.vacant_since.pop(rank)
            out.append(Event("spare_assigned", {"rank": rank, "identity": spare}))
            self.refills.append(self.procs[spare].node)
        if self.assigned and not self.vacant:
            # Every vacancy has its spare: one generation with every replacement made since
            # the last one (spares may have arrived one by one).
            replaced, self.assigned = self.assigned, {}
            out += self._new_generation(lost=sorted(replaced), replaced=replaced, now=now)
        out += self._release_refills(force=bool(self.vacant))
        if self.vacant and not self.spares:
            out += self._decide(now)  # the rest waits: tell the live ranks now
        return out

    def _notify(self, hold: Hold, now: float) -> list[Decision]:
        """Vacancies that must wait: stop the live ranks now and tell them for how long."""
        fresh = sorted(set(self.vacant) - self.notified)
        if not fresh or not self.ranks:
            return []
        # Their collectives would otherwise wait on the lost rank until they time out.
        self.notified.update(fresh)
        wait_s = (hold.until - now if hold.until is not None else self.config.spare_wait_s) + (
            self.config.ack_timeout_s
        )
        out: list[Decision] = [Event("waiting_for_spare", {"rank": r}) for r in fresh]
        out.append(
            Interrupt(
                tuple(self.ranks.values()), self.generation, tuple(sorted(self.vacant)), wait_s
            )
        )
        return out + self._release_refills(force=True)

    def _resize(self, resize: Resize, now: float) -> list[Decision]:
        """Shrink or grow: survivors keep their order and are numbered from 0, joiners follow."""
        leaving = [self.ranks[r] for r in resize.leaving]
        survivors = [i for r, i in sorted(self.ranks.items()) if r not in resize.leaving]
        for spare in resize.joining:
            self.spares.remove(spare)
        out: list[Decision] = [
            Event(
                "resize",
                {
                    "from": self.world_size,
                    "to": resize.target,
                    "graceful": resize.graceful,
                    "reason": resize.reason,
                    "leaving": leaving,
                    "joining": list(resize.joining),
                },
            )
        ]
        for spare in resize.released_spares:
            self.spares.remove(spare)
            self.released.add(spare)
            proc = self.procs[spare]
            out.append(Kill(proc.node, spare, proc.pid, "released: the job shrank"))
        lost = sorted(self.vacant)
        committed = self.committed_step
        self.ranks = dict(enumerate([*survivors, *resize.joining]))
        self.world_size = resize.target
        self.replicated = dict.fromkeys(range(resize.target), committed)
        self.vacant.clear()
        self.vacant_since.clear()
        self.assigned.clear()
        if self.requested_size is not None and self.requested_size == resize.target:
            self.requested_size = None
        grace = resize.graceful_timeout_s if resize.graceful else self.config.ack_timeout_s
        for identity in leaving:
            self.leaving[identity] = now + grace
        first_new = self.world_size - len(resize.joining)
        joined = {first_new + i: ["", s] for i, s in enumerate(resize.joining)}
        out += self._new_generation(
            lost=lost,
            replaced=joined,
            now=now,
            reason=resize.reason,
            graceful=resize.graceful,
            also_to=tuple(leaving),
            renumbered=True,
        )
        if resize.graceful:
            self.switching = set(self.ranks.values())
        return out

    def _stop(self, reason: str, now: float) -> list[Decision]:
        """The survivors restore the committed state among themselves, checkpoint it, and stop.

        They form one last generation of their own (renumbered in rank order, a smaller world
        whose state is resharded from the replicas of the lost ranks), so the checkpoint holds
        the lost ranks' shards too.
        """
        survivors = [i for _, i in sorted(self.ranks.items())]
        if not survivors:
            return self._end(1, reason)
        self.ranks = dict(enumerate(survivors))
        self.world_size = len(survivors)
        lost = sorted(self.vacant)
        self.vacant.clear()
        self.vacant_since.clear()
        self.assigned.clear()
        out: list[Decision] = [
            Event("job_stopping", {"reason": reason, "survivors": len(survivors)})
        ]
        out += self._new_generation(
            lost=lost, replaced={}, now=now, directive="checkpoint", reason=reason, renumbered=True
        )
        self.stopping = self.pending
        self.stop_deadline = now + self.config.stop_timeout_s
        self.awaiting = set()  # members exit when done; their exits end the job
        return out

    # -- bookkeeping ---------------------------------------------------------------------------

    def _lose(self, identity: str, reason: str, now: float) -> list[Decision]:
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
        self.switching.discard(identity)
        if identity in self.leaving or identity in self.released:
            self.leaving.pop(identity, None)
            return [Event("process_left", {"identity": identity, "reason": reason})]
        out: list[Decision] = [Event("fault", {"identity": identity, "reason": reason})]
        if proc.role == "agent":
            for other in [p for p in self.procs.values() if p.node == proc.node]:
                out += self._lose(other.identity, f"node {proc.node} lost ({reason})", now)
            return out
        if identity in self.spares:
            self.spares.remove(identity)
            self.refills.append(proc.node)
            return out + self._release_refills(force=True)
        rank = self.rank_of(identity)
        if rank is None or rank in self.finished:
            return out
        if self.done:
            # Others completed the training and are leaving: there is no job left to rejoin.
            return out + self._finish(rank, identity, f"was lost ({reason})")
        del self.ranks[rank]
        self.assigned.pop(rank, None)
        self.vacant[rank] = identity
        self.vacant_since[rank] = now
        return out

    def _release_refills(self, force: bool, now: float | None = None) -> list[Decision]:
        """Start the spares owed, once the job replicates again, at the latest after
        ``refill_delay_s``, or at once when forced (a vacancy has no spare)."""
        late = now is not None and now >= self.refill_gate_t + self.config.refill_delay_s
        if not self.refills or not (force or late or self.committed_step > self.refill_gate):
            return []
        nodes, self.refills = self.refills, []
        return [SpawnSpare(node) for node in nodes]

    def _forget(self, identity: str) -> None:
        self.procs.pop(identity, None)
        self.last_seen.pop(identity, None)
        self.leaving.pop(identity, None)
        self.gone.add(identity)

    def _finish(self, rank: int, identity: str, failure: str | None = None) -> list[Decision]:
        self.finished.add(rank)
        out: list[Decision] = [Event("rank_finished", {"rank": rank, "identity": identity})]
        if failure is not None:
            self.failed_after_done.append(f"rank {rank} {failure}")
        if len(self.finished) == self.world_size:
            if self.failed_after_done:
                out += self._end(
                    1, "the training completed, but " + "; ".join(self.failed_after_done)
                )
            else:
                out += self._end(0, "every rank finished")
        return out

    def _stopped_one(self, identity: str) -> list[Decision]:
        assert self.stopping is not None
        members = set(self.stopping.ranks.values())
        self.gone.add(identity)
        if members <= self.gone and not self.ended:
            reason = self.stopping.reason
            missing = sorted(members - set(self.stop_written))
            if not missing:
                step = min(self.stop_written[m] for m in members)
                return self._end(1, f"{reason}; the survivors wrote a checkpoint of step {step}")
            return self._end(
                1,
                f"{reason}; the survivors could not write a checkpoint ({', '.join(missing)} "
                "failed before it was written: see their logs)",
            )
        return []

    def _new_generation(
        self,
        lost: list[int],
        replaced: dict[int, list[str]],
        now: float,
        directive: str = "train",
        reason: str = "",
        graceful: bool = False,
        also_to: tuple[str, ...] = (),
        renumbered: bool = False,
    ) -> list[Decision]:
        self.generation += 1
        world = self.world_size
        nodes = {r: self.procs[i].node for r, i in sorted(self.ranks.items())}
        k = min(self.config.replicas, world - 1)
        holders = (
            {
                r: list(h)
                for r, h in enumerate(
                    place(
                        world, self.config.ranks_per_node, k, [nodes[r] for r in range(world)]
                    ).holders
                )
            }
            if k >= 1
            else {r: [] for r in range(world)}
        )
        gen = Generation(
            generation=self.generation,
            world_size=world,
            ranks=dict(sorted(self.ranks.items())),
            nodes=nodes,
            replaced=replaced,
            lost=lost,
            committed_step=self.committed_step,
            store_prefix=f"gen{self.generation}/",
            holders=holders,
            replicas=k,
            ranks_per_node=self.config.ranks_per_node,
            directive=directive,
            reason=reason,
            renumbered=renumbered,
            graceful=graceful,
            ack_timeout_s=self.config.ack_timeout_s,
        )
        if lost and directive == "train":
            self.restarts += 1
            self.restart_mark = gen.committed_step
        superseded = self.pending
        self.pending = gen
        self.awaiting = set(gen.ranks.values())
        self.arrived = set()
        self.ack_deadline = now + self.config.ack_timeout_s
        self.pending_t = now
        self.notified.clear()
        self.switching.clear()
        self.refill_gate = self.committed_step
        self.refill_gate_t = now
        fields: dict[str, Any] = {"generation": gen.generation, "lost": lost, "replaced": replaced}
        if superseded is not None:
            fields["supersedes"] = superseded.generation
        if world != self.config.world_size:
            fields["world_size"] = world
        return [
            Event("generation_started", fields),
            SendGeneration((*gen.ranks.values(), *also_to), gen),
        ]

    def _end(self, code: int, reason: str) -> list[Decision]:
        if self.ended:
            return []
        self.ended = True
        return [Event("job_ended", {"code": code, "reason": reason}), End(code, reason)]
