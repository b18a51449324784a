"""Configuration of the data plane."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicationConfig:
    """How each rank's shard is replicated to its buddies."""

    k: int = 1
    """Replication factor: copies of every shard held by other ranks."""
    interval_steps: int = 1
    """Replicate every N optimizer steps; the committed step advances in multiples of N."""
    memory: str = "auto"
    """Where snapshots and replicas live: ``auto`` (GPU memory when training on a GPU, host
    memory otherwise), ``gpu``, ``pinned`` or ``host``."""
    backend: str = "auto"
    """Transport: ``auto`` (NCCL for GPU memory, gloo otherwise), ``nccl`` or ``gloo``."""
    chunk_bytes: int = 32 * 2**20
    """Transfers move at most this many bytes per send/recv, so a transfer can be abandoned
    between chunks and no staging buffer is larger than this."""
    timeout_s: float = 120.0
    """Deadline for one replication round (all chunks and the commit) and for waiting on the
    previous round before a new snapshot is taken."""
    ranks_per_node: int = 0
    """Ranks per node for buddy placement; 0 reads LOCAL_WORLD_SIZE (torchrun, p2p-run)."""
    blob_capacity_bytes: int = 256 * 1024
    """Bytes reserved for the non-tensor state (scheduler, hyper-parameters, RNG, extras)."""
    verify_on_receive: bool = False
    """Checksum every replica as it arrives (costs one pass over the bytes per step). Replicas
    are always verified before they are restored from."""
    max_memory_fraction: float = 0.8
    """Refuse to start if snapshots and replicas need more than this share of the free memory
    (on a GPU: of what is free beside the training step's peak)."""
    step_peak_bytes: int = 0
    """GPU memory one training step needs above what stays allocated between steps, when
    measured beforehand (``torch.cuda.max_memory_allocated()`` after a trial step, less
    ``torch.cuda.memory_allocated()`` before it). The memory check keeps the larger of this and
    the allocator's own record free; before the first step the allocator has none."""

    def __post_init__(self) -> None:
        if self.step_peak_bytes < 0:
            raise ValueError(
                f"ReplicationConfig.step_peak_bytes must be >= 0, got {self.step_peak_bytes}"
            )
        if self.k < 1:
            raise ValueError(f"ReplicationConfig.k must be >= 1, got {self.k}")
        if self.interval_steps < 1:
            raise ValueError(
                f"ReplicationConfig.interval_steps must be >= 1, got {self.interval_steps}"
            )
        if self.memory not in ("auto", "gpu", "pinned", "host"):
            raise ValueError(
                f"ReplicationConfig.memory={self.memory!r}; choose auto, gpu, pinned or host"
            )
        if self.backend not in ("auto", "nccl", "gloo"):
            raise ValueError(
                f"ReplicationConfig.backend={self.backend!r}; choose auto, nccl or gloo"
            )
        if self.chunk_bytes < 4096 or self.chunk_bytes % 256:
            raise ValueError(
                f"ReplicationConfig.chunk_bytes={self.chunk_bytes}; use a multiple of 256 bytes "
                "of at least 4096 (the default is 32 MiB)"
            )
        if self.timeout_s <= 0:
            raise ValueError(f"ReplicationConfig.timeout_s must be > 0, got {self.timeout_s}")
        if self.ranks_per_node < 0:
            raise ValueError(
                f"ReplicationConfig.ranks_per_node must be >= 0, got {self.ranks_per_node}"
            )
        if not 0 < self.max_memory_fraction <= 1:
            raise ValueError(
                "ReplicationConfig.max_memory_fraction must be in (0, 1], got "
                f"{self.max_memory_fraction}"
            )
