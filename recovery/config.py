"""What a protected job is configured with, the errors it raises and the record of a recovery."""

from __future__ import annotations

from dataclasses import dataclass, field

from p2p_state.config import ReplicationConfig
from recovery.checkpoint import CheckpointConfig


class RecoveryFailed(RuntimeError):
    """The job cannot go on: no copy of some state survives and there is no checkpoint."""


class ConfigurationError(ValueError):
    """The job is set up in a way it cannot run; the message names the fix."""


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
    source: str = ""
    """``peers``, ``checkpoint`` or ``initial``."""
    step: int = -1
    """The step the job was restored to."""
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds per phase: interrupt, communicators, build, plan, transfer, restore, replicate."""
    bytes_received: int = 0
    started_t: float = 0.0
    step_reached: int = -1
    """The last step this rank had completed when the fault took it out of training (-1 for a
    spare): the steps after the restored one up to it are done again."""
