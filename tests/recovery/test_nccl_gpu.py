"""A survivor whose NCCL peer died lives, on real GPUs (skipped without two; never faked).

Rank 1 dies (``os._exit``) after the generation's groups formed; rank 0 is then blocked in an
all-reduce that can never complete. With the error handling the engine sets for every group,
the NCCL watchdog must not tear rank 0 down: the abort (from another thread, as the control
client's interrupt does) makes the collective fail, and rank 0 carries on and exits cleanly.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading

import pytest
import torch
import torch.distributed as dist

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

DEADLINE_S = 120.0


def _member(rank: int, port: int, peer_gone, results) -> None:
    from recovery.comms import CommsSpec, create_comms

    torch.cuda.set_device(rank)
    spec = CommsSpec(
        generation=1,
        rank=rank,
        world_size=2,
        store_host="127.0.0.1",
        store_port=port,
        store_prefix="gen1/",
        backend="cpu:gloo,cuda:nccl",
        timeout_s=DEADLINE_S,
    )
    comms = create_comms(spec, register=lambda c: None)
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
