"""What a protected job is configured with (its records: :mod:`recovery.records`; its errors:
:mod:`recovery.errors`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from p2p_state.config import ReplicationConfig
from recovery.checkpoint import CheckpointConfig


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
