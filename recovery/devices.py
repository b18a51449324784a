"""Where a protected job's tensors live (training, control tensors, snapshots); its replica map."""

from __future__ import annotations

import os

import torch

from p2p_state.config import ReplicationConfig
from p2p_state.placement import Placement
from p2p_state.replicator import Replicator, state_device
from p2p_state.state import TrainingState
from recovery.errors import ConfigurationError
from recovery.generation import GenerationInfo


def training_device(device_type: str) -> torch.device:
    """Where training runs: the current CUDA device under CUDA, else the CPU."""
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def replication_backend(config: ReplicationConfig, device: torch.device) -> str:
    """The backend of the replication group for a state trained on ``device``."""
    _, backend = Replicator.backend_for(config, device)
    return backend


def wire_device(config: ReplicationConfig, device: torch.device) -> torch.device:
    """Device of small control tensors on the replication group (CUDA under NCCL)."""
    return device if replication_backend(config, device) == "nccl" else torch.device("cpu")


def snapshot_device(config: ReplicationConfig, state: TrainingState) -> torch.device:
    """Where the snapshots of ``state`` are kept (its device for GPU memory, else the CPU)."""
    kind, _ = Replicator.backend_for(config, state_device(state))
    return state_device(state) if kind.value == "gpu" else torch.device("cpu")


def placement_of(info: GenerationInfo | None, k: int) -> Placement | None:
    """The coordinator's replica map for this generation (the replicator's default if none).

    Raises:
        ConfigurationError: the coordinator keeps another number of copies than ``k``.
    """
    if info is None or len(info.holders) != info.world_size:
        return None
    holders = tuple(tuple(info.holders[r]) for r in range(info.world_size))
    if any(len(h) != k for h in holders):
        raise ConfigurationError(
            f"the coordinator keeps {len(holders[0])} copies of every shard (p2p-run "
            f"--replicas) but ReplicationConfig.k is {k}; make them agree"
        )
    rpn = int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size))
    return Placement(info.world_size, rpn, k, holders)
