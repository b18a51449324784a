"""What a protected job is configured with and the record of a recovery (its errors:
:mod:`recovery.errors`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from p2p_state.config import ReplicationConfig
from recovery import phases
from recovery.checkpoint import CheckpointConfig
from recovery.source import RestoreSource


@dataclass(frozen=True, slots=True, kw_only=True)
class RecoveryConfig:
    """How a protected job replicates, checkpoints and recovers."""

    replication: ReplicationConfig = field(default_factory=ReplicationConfig)
    """The data plane: replication factor, interval, memory, chunking, deadlines."""
    checkpoint: CheckpointConfig | None = None
    """The cold fallback (DCP every ``every_steps`` steps); ``None``: no periodic checkpoint."""
    resume: bool = False
    """Start from the latest complete checkpoint under ``checkpoint.root``."""
    fault_wait_s: float = 30.0
    """After a collective fails, how long to wait for the coordinator's new generation before
    this rank reports itself failed (the coordinator normally answers within milliseconds for a
    crash and within the heartbeat timeout for a hang)."""
    collective_timeout_s: float = 300.0
    """Timeout of every process group. A last resort only: a fault the coordinator sees aborts
    the groups at once."""
    emergency_checkpoint_root: str | None = None
    """Where the checkpoint written when the job must stop (no spare in time) goes when
    ``checkpoint`` is not set; default ``<run dir>/checkpoints``."""

    def __post_init__(self) -> None:
        if self.fault_wait_s <= 0:
            raise ValueError(f"RecoveryConfig.fault_wait_s must be > 0, got {self.fault_wait_s}")
        if self.collective_timeout_s <= 0:
            raise ValueError(
                f"RecoveryConfig.collective_timeout_s must be > 0, got {self.collective_timeout_s}"
            )
        if self.resume and self.checkpoint is None:
            raise ValueError(
                "RecoveryConfig.resume needs RecoveryConfig.checkpoint (where to resume from)"
            )


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
        interrupted_t: float,
        generation_t: float,
        step_reached: int,
    ) -> RecoveryRecord:
        """The record of a recovery from a fault this rank caught at ``caught_t``.

        Args:
            interrupted_t: When the coordinator's word (interrupt or generation) arrived.
            generation_t: When the generation recovered into arrived.
        """
        rec = cls(
            generation, cause, started_t=min(interrupted_t, caught_t), step_reached=step_reached
        )
        # From the coordinator's word to the training thread leaving the step; or, when a
        # collective failed first, from that failure to the coordinator's word.
        rec.phases[phases.INTERRUPT] = max(0.0, caught_t - interrupted_t)
        rec.phases[phases.WAIT] = max(0.0, generation_t - caught_t)
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
