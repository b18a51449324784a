"""The GPU path: the same replication over NCCL from GPU memory, and over gloo from pinned memory.

Skipped where there is no CUDA device (or, for NCCL, fewer than two GPUs): never faked.
"""

from __future__ import annotations

import pytest
import torch

from launcher.local import WorkerGroupConfig, run_local
from p2p_state.memory import MemoryKind, PreparedPool
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


def test_a_staged_capture_on_a_side_stream_writes_the_bytes_of_a_host_capture():
    # Default AdamW keeps its step counters on the host: they, the RNG states and the blob go
    # through the pinned staging; everything else is one device-side batched copy.
    from p2p_state.snapshot import HostStaging
    from p2p_state.state import TrainingState

    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64)).to(device)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 64, device=device)).sum().backward()
    opt.step()
    state = TrainingState(model, opt)
    assert any(not s.is_cuda for v in opt.state.values() for s in v.values())
    staging = HostStaging(device, state.staging_bytes())
    on_gpu = torch.zeros(state.layout.total_bytes, dtype=torch.uint8, device=device)
    side = torch.cuda.Stream(device)
    for step in (1, 2):  # the second reuses the staging buffers
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            state.capture(on_gpu, step, {"step": step}, staging)
        side.synchronize()
        on_host = torch.zeros(state.layout.total_bytes, dtype=torch.uint8)
        state.capture(on_host, step, {"step": step})
        assert torch.equal(on_gpu.cpu(), on_host)


@pytest.mark.parametrize("variant", ["default", "fused", "capturable"])
def test_fsdp2_capture_and_restore_on_a_one_rank_nccl_mesh_is_bitwise(variant):
    from bench.gpu_state_checks import bitwise_restore

    device = torch.device("cuda", torch.cuda.current_device())
    r = bitwise_restore(device, variant)
    assert r["passed"], r


def test_the_next_forward_waits_for_the_snapshot_of_the_buffers_it_mutates():
    from bench.gpu_state_checks import stream_race

    r = stream_race(torch.device("cuda", torch.cuda.current_device()))
    assert r["fenced_equal"] is True
    assert r["unfenced_differs"] is True  # the check can see the race it guards against


def test_after_a_step_the_gpu_budget_is_checked_with_the_step_s_measured_peak():
    from p2p_state.memory import recheck_after_step

    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    torch.cuda.reset_peak_memory_stats(device)
    transient = torch.empty(int(free * 0.9), dtype=torch.uint8, device=device)  # a step's peak
    del transient  # back in the allocator's cache, as a step's activations are
    try:
        assert recheck_after_step(1 << 20, device, 0.8, "1 MiB of snapshots") is None
        # Half the free memory would fit if the step's peak were not kept out of the budget.
        verdict = recheck_after_step(free // 2, device, 0.8, "half the GPU's snapshots")
        assert verdict is not None and "kept for the training step's peak" in verdict
    finally:
        torch.cuda.empty_cache()


def test_a_spare_s_prepared_pinned_buffers_are_pinned():
    device = torch.device("cuda", 0)
    prepared = PreparedPool(device, max_fraction=0.8)
    prepared.prepare(MemoryKind.PINNED, (1 << 20, 1 << 20))
    pool = prepared.take(timeout_s=60)
    assert pool is not None and pool.free_bytes == 2 << 20
    slot = pool.take(1 << 20, MemoryKind.PINNED, device)
    assert slot.is_pinned() and pool.fresh_bytes == 0
