"""A member whose peer left the rendezvous after publishing its address is out of the group's
creation within the join deadline, in time for the next generation.

Of the two members of a gloo pair, the one with the lower address waits for the other to connect,
in a wait nothing interrupts. Here the peer's gloo device listens on 127.255.255.254 and the
waiting member's on 127.0.0.1 (``GLOO_SOCKET_IFNAME=lo``), so the waiting side is the one under
test; the peer publishes its address in the store and dies before connecting.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from launcher.local import rank_context, rank_process
from recovery.comms import GROUP_ENVIRONMENT, CommsSpec, create_comms

JOIN_TIMEOUT_S = 4.0
PREFIX = "gen3/"
#: Where the peer's device listens: above any address of this host's loopback interface.
PEER_HOST = "127.255.255.254"
HANG_DEADLINE_S = 60.0


class _DiesAfterPublishing(dist.Store):
    """The peer's store: once its own address is written, the process dies."""

    def __init__(self, inner: dist.Store, rank: int) -> None:
        super().__init__()
        self.inner, self.rank = inner, rank

    def set(self, key: str, value: bytes) -> None:
        self.inner.set(key, value)
        if key.endswith(f"/{self.rank}"):
            os._exit(0)

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self.inner.wait(keys)


def _peer(port: int) -> None:
    os.environ.update({name: value for name, (value, _) in GROUP_ENVIRONMENT.items()})
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    # The keys of a generation's default group (group "0", its cpu backend), as the member has.
    prefixed = dist.PrefixStore("cpu/", dist.PrefixStore("0/", dist.PrefixStore(PREFIX, store)))
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=PEER_HOST)]
    options._timeout = timedelta(seconds=JOIN_TIMEOUT_S)
    dist.ProcessGroupGloo(_DiesAfterPublishing(prefixed, 1), 1, 2, options)


def _member(port: int, out: mp.Queue) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    spec = CommsSpec(
        generation=3,
        rank=0,
        world_size=2,
        store_host="127.0.0.1",
        store_port=port,
        store_prefix=PREFIX,
        backend="gloo",
        timeout_s=60.0,
        join_timeout_s=JOIN_TIMEOUT_S,
    )
    t0 = time.monotonic()
    try:
        create_comms(spec, register=lambda comms: None)
        out.put(("formed", "", time.monotonic() - t0))
    except Exception as e:
        out.put((type(e).__name__, str(e), time.monotonic() - t0))


@pytest.mark.slow
def test_a_member_waiting_for_a_peer_that_left_is_out_within_the_join_deadline():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = rank_context()
    out = ctx.Queue()
    procs = [rank_process(_peer, (master.port,))]
    procs.append(rank_process(_member, (master.port, out)))
    for p in procs:
        p.start()
    try:
        outcome, message, elapsed_s = out.get(timeout=HANG_DEADLINE_S)
    finally:
        for p in procs:
            p.join(timeout=10)
            p.kill()
    assert procs[0].exitcode == 0, "the peer died before publishing its address"
    # It waited for the peer to connect (not for the store), and gave up...
    assert outcome == "RuntimeError" and "Connect timeout" in message, (outcome, message)
    # ...before the join deadline: gloo waits five times its timeout, uninterrupted.
    assert elapsed_s < JOIN_TIMEOUT_S, elapsed_s
