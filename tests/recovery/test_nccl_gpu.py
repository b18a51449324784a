"""The engine's NCCL groups on real GPUs (skipped without them; never faked).

With two GPUs: rank 1 dies (``os._exit``) after the generation's groups formed; rank 0 is
then blocked in an all-reduce that can never complete. With the error handling the engine sets
for every group, the NCCL watchdog must not tear rank 0 down: the abort (from another thread, as
the control client's interrupt does) makes the collective fail, and rank 0 carries on and exits
cleanly. With one: the default group bound to its GPU, a split side group with its CTA limit,
and their abort, started together, with kernels queued on both.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.gpu

DEADLINE_S = 120.0


def _comms(rank: int, world_size: int, port: int):
    """The engine's groups of generation 1, as a rank creates them (default group: NCCL)."""
    from recovery.comms import CommsSpec, create_comms

    spec = CommsSpec(
        generation=1,
        rank=rank,
        world_size=world_size,
        store_host="127.0.0.1",
        store_port=port,
        store_prefix="gen1/",
        backend="cpu:gloo,cuda:nccl",
        timeout_s=DEADLINE_S,
    )
    return create_comms(spec, register=lambda c: None)


def _member(rank: int, port: int, peer_gone, results) -> None:
    torch.cuda.set_device(rank)
    comms = _comms(rank, 2, port)
    x = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(x)  # both alive: the communicator works
    torch.cuda.synchronize()
    if rank == 1:
        os._exit(0)
    aborter = threading.Thread(target=lambda: peer_gone.wait(DEADLINE_S) and comms.abort())
    aborter.start()
    failed = False
    try:
        dist.all_reduce(x)
        torch.cuda.synchronize()
    except Exception:
        failed = True
    aborter.join(DEADLINE_S)
    results.put({"rank": rank, "alive": True, "collective_failed": failed})


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_survivor_whose_peer_died_lives() -> None:
    ctx = mp.get_context("spawn")
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    peer_gone, results = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_member, args=(r, master.port, peer_gone, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        procs[1].join(DEADLINE_S)
        assert procs[1].exitcode == 0, "rank 1 did not get as far as dying on purpose"
        peer_gone.set()
        outcome = results.get(timeout=DEADLINE_S)
        procs[0].join(DEADLINE_S)
        assert outcome == {"rank": 0, "alive": True, "collective_failed": True}
        assert procs[0].exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)


def _alone(port: int, results) -> None:
    """One rank: the engine's groups on one GPU, kernels held in flight on both, then aborted."""
    import time

    comms = _comms(0, 1, port)
    side = comms.group("replication", "nccl")
    x = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(x)
    dist.all_reduce(x, group=side)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second: both collectives below wait behind it
    dist.all_reduce(x)
    dist.all_reduce(x, group=side)
    t0 = time.monotonic()
    comms.abort()
    results.put(
        {
            "abort_s": time.monotonic() - t0,
            "error_handling": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"),
            "dump_on_timeout": os.environ.get("TORCH_NCCL_DUMP_ON_TIMEOUT"),
            "dump_wait_ms": os.environ.get("TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"),
        }
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_one_gpu_groups_with_kernels_in_flight_are_aborted_together_without_a_hang() -> None:
    """The default group (bound to its GPU) and a split side group with a CTA limit form on a
    real GPU, and their abort, started together, returns with their kernels queued."""
    ctx = mp.get_context("spawn")
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    results = ctx.Queue()
    proc = ctx.Process(target=_alone, args=(master.port, results))
    proc.start()
    try:
        outcome = results.get(timeout=DEADLINE_S)
        assert outcome["abort_s"] < DEADLINE_S / 2
        assert outcome["error_handling"] == "0" and outcome["dump_on_timeout"] == "0"
        assert outcome["dump_wait_ms"] == "0"
        proc.join(DEADLINE_S)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)
