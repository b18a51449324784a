"""The GPU path: the same replication over NCCL from GPU memory, and over gloo from pinned memory.

Skipped where there is no CUDA device (or, for NCCL, fewer than two GPUs): never faked.
"""

from __future__ import annotations

import pytest
import torch

from launcher.local import WorkerGroupConfig, run_local
from tests.p2p_state import _gpu_workers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank")
def test_nccl_replication_from_gpu_memory_restores_bitwise():
    cfg = WorkerGroupConfig(world_size=2, ranks_per_node=1, backend="nccl", timeout_s=300)
    for r in run_local(_gpu_workers.replicate_on_gpu, cfg, ("gpu", 3)):
        assert r == {"equal": True, "step": 3, "kind": "gpu", "backend": "nccl"}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="FSDP2 on CUDA trains over NCCL")
def test_pinned_replicas_over_gloo_restore_bitwise():
    # Training over NCCL, replicas in pinned host memory moved by gloo.
    cfg = WorkerGroupConfig(world_size=2, ranks_per_node=1, backend="nccl", timeout_s=300)
    for r in run_local(_gpu_workers.replicate_on_gpu, cfg, ("pinned", 3)):
        assert r == {"equal": True, "step": 3, "kind": "pinned", "backend": "gloo"}


def test_gpu_checksum_matches_in_chunks_the_host_s_and_catches_a_flip():
    from p2p_state.checksum import BLOCK_BYTES, Checksum, checksum

    buf = torch.randint(0, 256, (16 * BLOCK_BYTES + 777,), dtype=torch.uint8, device="cuda")
    whole = checksum(buf)
    assert whole == checksum(buf.cpu())  # any holder can verify any copy
    c = Checksum(on_gpu=True)
    for off in range(0, buf.numel(), 2 * BLOCK_BYTES):
        c.update(buf[off : off + 2 * BLOCK_BYTES], off)
    assert c.value() == whole
    buf[12345] ^= 1
    assert checksum(buf) != whole
