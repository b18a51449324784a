"""The record of each recovery a rank lives through, and the events that report it.

A :class:`RecoveryRecord` collects one recovery's phases, source and bytes; a
:class:`RecoveryLog` keeps them in order and writes the ``recovery_done``, ``recovery_abandoned``,
``first_step_done`` and ``step_done`` events to the job's log.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from recovery import phases
from recovery.source import RestoreSource

if TYPE_CHECKING:
    from recovery.generation import GenerationInfo
    from recovery.session import Session

logger = logging.getLogger(__name__)

CAUSE_JOINED = "joined the job"
"""The cause recorded by a process that enters the job (a spare taking a place, a new node)."""


@dataclass(slots=True)
class RecoveryRecord:
    """One recovery as this rank lived it (also written to the event log)."""

    generation: int
    cause: str
    source: RestoreSource | None = None
    """Where the state came from (``None`` until it is restored)."""
    step: int = -1
    """The step the job was restored to."""
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds per phase: interrupt, communicators, build, plan, transfer, restore, replicate."""
    bytes_received: int = 0
    started_t: float = 0.0
    step_reached: int = -1
    """The last step this rank had completed when the fault took it out of training (-1 for a
    spare): the steps after the restored one up to it are done again."""

    @classmethod
    def after_fault(
        cls,
        generation: int,
        cause: str,
        *,
        caught_t: float,
        left_t: float,
        interrupted_t: float,
        generation_t: float,
        step_reached: int,
    ) -> RecoveryRecord:
        """The record of a recovery from a fault this rank caught at ``caught_t``.

        Args:
            left_t: When this rank had left the step and broken the generation's groups.
            interrupted_t: When the coordinator's word (interrupt or generation) arrived.
            generation_t: When the generation recovered into arrived.
        """
        started_t = min(interrupted_t, caught_t)
        rec = cls(generation, cause, started_t=started_t, step_reached=step_reached)
        # From the coordinator's word (or a failed collective, if first) to the step left and
        # the groups broken; then waiting for the coordinator's generation, if it came later.
        rec.phases[phases.INTERRUPT] = max(0.0, left_t - started_t)
        rec.phases[phases.WAIT] = max(0.0, generation_t - max(left_t, started_t))
        return rec

    def done_event(self, rank: int | None, world_size: int) -> dict[str, Any]:
        """The fields of the ``recovery_done`` event of this rank."""
        return {
            "generation": self.generation,
            "rank": rank,
            "world_size": world_size,
            "restored_from": self.source.value if self.source is not None else None,
            "step": self.step,
            "phases": self.phases,
            "bytes_received": self.bytes_received,
            "cause": self.cause,
            "started_t": self.started_t,
            "step_reached": self.step_reached,
        }

    def summary(self, rank: int | None) -> str:
        """One line for the log."""
        source = self.source.value if self.source is not None else "nowhere"
        phases = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in self.phases.items())
        return (
            f"rank {rank}: restored step {self.step} from {source} in generation "
            f"{self.generation} ({phases})"
        )


class RecoveryLog:
    """The recoveries of one rank, in order, and their events.

    Args:
        session: Where the events go, and who this process is.
    """

    def __init__(self, session: Session) -> None:
        self._session = session
        self.records: list[RecoveryRecord] = []
        self._first_step_pending: RecoveryRecord | None = None

    def after_fault(
        self,
        info: GenerationInfo,
        cause: str,
        *,
        caught_t: float,
        left_t: float,
        step_reached: int,
    ) -> RecoveryRecord:
        """The record of a recovery into ``info`` from a fault caught at ``caught_t`` (the step
        left and the groups broken at ``left_t``)."""
        return RecoveryRecord.after_fault(
            info.generation,
            cause,
            caught_t=caught_t,
            left_t=left_t,
            interrupted_t=self._session.interrupt_time() or info.arrived_t,
            generation_t=info.arrived_t,
            step_reached=step_reached,
        )

    def abandoned(self, info: GenerationInfo, reason: str) -> None:
        """The recovery into ``info`` failed: the next generation is waited for."""
        logger.warning(
            "%s: recovery into generation %d failed (%s); waiting for the next",
            self._session.identity,
            info.generation,
            reason,
        )
        self._session.event("recovery_abandoned", generation=info.generation, reason=reason)

    def done(
        self, rec: RecoveryRecord, info: GenerationInfo, source: RestoreSource, step: int
    ) -> None:
        """The recovery ``rec`` restored ``step`` from ``source``."""
        rank = info.rank_of(self._session.identity)
        rec.source, rec.step = source, step
        self.records.append(rec)
        self._first_step_pending = rec
        comms = self._session.comms
        self._session.event(
            "recovery_done",
            **rec.done_event(rank, info.world_size),
            lazy_gloo=comms is not None and comms.pairs is not None,
        )
        logger.warning("%s", rec.summary(rank))

    def step_done(self, step: int, rank: int) -> None:
        """``step`` is done (replicated as far as due); the first after a recovery is timed."""
        rec, self._first_step_pending = self._first_step_pending, None
        if rec is not None:
            self._session.event(
                "first_step_done",
                generation=rec.generation,
                step=step,
                since_fault_s=time.monotonic() - rec.started_t,
            )
        if rank == 0:
            self._session.event("step_done", step=step)
