"""Gloo groups whose pairs connect on first use: what they connect, and an abort that finds them.

A generation's gloo groups are made with ``TORCH_GLOO_LAZY_INIT``: a member connects to a peer
the first time an operation needs the pair. Their sockets are learnt from the addresses gloo
writes and reads through the store, and an abort must release an operation waiting on a pair
whichever side of it the member is: the side that connects has a socket to shut down, the side
that waits has none, and is released by a connection presenting the peer's rank.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from launcher.local import rank_context, rank_process
from launcher.store import StoreServer
from recovery.comms import CommsSpec, create_comms
from recovery.gloo_pairs import lazy_pairs_work, listener_of, waits_for
from recovery.sockets import tcp_listeners
from tests.recovery.conftest import assert_bitwise, run

SECRET = b"s" * 32
JOB_ID = "lazy-pairs"
WORLD_SIZE = 4  # ring pairs 0-1, 1-2, 2-3, 3-0: the pair 0-2 is left to connect on first use
COLLECTIVE_TIMEOUT_S = 120.0  # gloo waits five times this for a peer to connect
HANG_DEADLINE_S = 60.0
RELEASE_DEADLINE_S = 20.0


class _Recorder(dist.Store):
    def __init__(self) -> None:
        super().__init__()
        self.inner = dist.HashStore()
        self.written: dict[str, bytes] = {}

    def set(self, key: str, value: bytes) -> None:
        self.written[key] = bytes(value)
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        return bytes(self.inner.get(key))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self.inner.wait(keys)


def test_gloo_s_address_record_is_read_as_its_listening_socket(monkeypatch) -> None:
    monkeypatch.setenv("TORCH_GLOO_LAZY_INIT", "1")
    store = _Recorder()
    before = set(tcp_listeners())
    pg = dist.ProcessGroupGloo(store, 0, 1, timedelta(seconds=10))
    listening = {tuple(local[:2]) for fd, (_, local) in tcp_listeners().items() if fd not in before}
    assert [listener_of(v) for v in store.written.values()] == list(listening), store.written
    del pg
    assert lazy_pairs_work()


@given(st.binary(max_size=400))
def test_any_other_bytes_are_not_taken_for_an_address(data: bytes) -> None:
    endpoint = listener_of(data)  # never raises
    assert endpoint is None or (isinstance(endpoint[0], str) and 0 < endpoint[1] < 65536)


def test_records_of_the_wrong_shape_are_refused() -> None:
    address = struct.pack("=H", socket.AF_INET) + struct.pack("!H", 4242) + bytes([127, 0, 0, 1])
    address = address.ljust(128, b"\0") + struct.pack("=q", -1)
    record = struct.pack("=Q", 4) + b"host" + struct.pack("=Q", len(address)) + address
    assert listener_of(record) == ("127.0.0.1", 4242)
    assert listener_of(record + b"\0" * 8) == ("127.0.0.1", 4242)  # one pair number
    assert listener_of(record + b"\0" * 3) is None  # not whole pair numbers
    assert listener_of(record[:-1]) is None  # truncated
    assert listener_of(struct.pack("=Q", 1 << 40) + record[8:]) is None  # absurd host name
    unix = record.replace(struct.pack("=H", socket.AF_INET), struct.pack("=H", socket.AF_UNIX), 1)
    assert listener_of(unix) is None


def test_the_member_with_the_lower_address_waits() -> None:
    # Ports compare as gloo stores them, in network byte order: 256 is 0x0100, stored 01 00,
    # read on a little-endian host as 1; 2 is stored 00 02, read as 512.
    assert waits_for(("127.0.0.1", 5000), ("127.0.0.2", 10))
    assert not waits_for(("127.0.0.2", 10), ("127.0.0.1", 5000))
    if struct.pack("=H", 1) == b"\x01\x00":
        assert waits_for(("127.0.0.1", 256), ("127.0.0.1", 2))


def _spec(rank: int, generation: int, port: int) -> CommsSpec:
    return CommsSpec(
        generation=generation,
        rank=rank,
        world_size=WORLD_SIZE,
        store_host="127.0.0.1",
        store_port=port,
        store_prefix=f"gen{generation}/",
        store_secret=SECRET,
        job_id=JOB_ID,
        backend="gloo",
        timeout_s=COLLECTIVE_TIMEOUT_S,
        join_timeout_s=30.0,
        lazy_gloo=True,
    )


def _poll(ready, what: str) -> None:
    import time

    deadline = time.monotonic() + RELEASE_DEADLINE_S
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {RELEASE_DEADLINE_S}s waiting for {what}")
        time.sleep(0.01)


def _member(rank: int, port: int, barrier, ports, out) -> None:
    """One member: two generations; in each, rank 0 or 2 waits to receive from the other
    (which never sends), first the one that waits for the pair to connect, then the other."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    logging.basicConfig(level=logging.INFO)
    try:
        for generation, waiting_side in ((1, True), (2, False)):
            comms = create_comms(_spec(rank, generation, port), register=lambda c: None)
            assert comms.pairs is not None, "this generation's gloo pairs are not lazy"
            (listener,) = comms.pairs.listeners
            ports[rank] = listener[1]
            ring = len(comms.pairs.sockets())
            barrier.wait(HANG_DEADLINE_S)
            if rank in (0, 2):
                peer = 2 - rank
                peer_listener = ("127.0.0.1", ports[peer])
                if waits_for(listener, peer_listener) == waiting_side:
                    result = _wait_then_abort(comms, peer, peer_listener, ring)
                    out.put(("waited", rank, waiting_side, ring, *result))
            barrier.wait(HANG_DEADLINE_S)  # the peer stays idle until the waiter is released
            comms.abort()
            comms.destroy()
            out.put(("ring", rank, generation, ring))
    except Exception as e:
        out.put(("error", rank, repr(e)))
        raise


def _wait_then_abort(comms, peer: int, peer_listener, ring: int) -> tuple[int, str]:
    outcome: list[str] = []

    def receive() -> None:  # gloo's recv waits in the caller for its pair to connect
        try:
            dist.irecv(torch.zeros(4), src=peer).wait(timeout=timedelta(seconds=RELEASE_DEADLINE_S))
            outcome.append("completed")
        except Exception as e:
            outcome.append(str(e))

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    _poll(lambda: comms.pairs.read(peer), f"gloo to read member {peer}'s address")
    # The side that connects has a socket to the peer's listener once connected (the peer's
    # gloo accepts it though it never receives); the side that waits never has one (the peer
    # never comes): only the presented connection can release it.
    if not waits_for(comms.pairs.listeners[0], peer_listener):
        _poll(lambda: len(comms.pairs.sockets()) > ring, "a socket to the peer")
    connected = len(comms.pairs.sockets()) - ring
    comms.abort()
    thread.join(RELEASE_DEADLINE_S + 5)
    return connected, outcome[0] if outcome else "still waiting"


@pytest.mark.slow
def test_an_abort_releases_a_wait_on_a_lazy_pair_on_either_side_of_it():
    server = StoreServer(SECRET, JOB_ID, "127.0.0.1").start()
    ctx = rank_context()
    barrier, out = ctx.Barrier(WORLD_SIZE), ctx.Queue()
    ports = ctx.Array("i", WORLD_SIZE)
    procs = [
        rank_process(_member, (r, server.port, barrier, ports, out)) for r in range(WORLD_SIZE)
    ]
    for p in procs:
        p.start()
    results = []
    try:
        while len(results) < 2 * WORLD_SIZE + 2:
            results.append(out.get(timeout=HANG_DEADLINE_S * 2))
            assert results[-1][0] != "error", results[-1]
    finally:
        for p in procs:
            p.join(timeout=10)
            p.kill()
        server.close()
    waited = {r[2]: r for r in results if r[0] == "waited"}
    assert set(waited) == {True, False}, results
    # Made lazily, each member connected its two ring neighbours, not all three peers.
    assert {r[3] for r in results if r[0] == "ring"} == {2}, results
    _, _, _, _, connected, error = waited[True]
    assert connected == 0, "the side that waits had a socket to shut down"
    assert error not in ("completed", "still waiting") and "timed out" not in error.lower(), error
    _, _, _, _, connected, error = waited[False]
    assert connected == 1, "the side that connects had no socket to the peer"
    assert error not in ("completed", "still waiting") and "timed out" not in error.lower(), error


@pytest.mark.slow
def test_a_job_with_lazy_gloo_pairs_recovers_from_a_kill_then_a_hang_bitwise(
    tmp_path, data_cache, reference
):
    # Every group of the job is made lazily: a pair first used in a step that is interrupted
    # (FSDP's, replication's buddies, a restore's) is released by the aborts.
    outcome = run(
        tmp_path,
        data_cache,
        faults=("kill:rank=1@step=3:phase=backward", "hang:rank=2@step=5"),
        spares=(1, 1),
        launcher_args=("--lazy-gloo",),
    )
    assert_bitwise(outcome, reference)
    done = outcome.events("recovery_done")
    assert {e["restored_from"] for e in done} == {"peers"}, done
    assert {e["lazy_gloo"] for e in done} == {True}, done
    assert len({e["generation"] for e in done}) == 2, done


def _member_on_a_new_pair(rank: int, port, barrier, out, share: bool) -> None:
    """Form the groups, let the store move (``share``: go), then use a pair no ring uses."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    try:
        comms = create_comms(_spec(rank, 1, port.value), register=lambda c: None)
        learnt = comms.share_addresses() if share else 0  # over the ring, while it answers
        barrier.wait(HANG_DEADLINE_S)  # formed (ring pairs only): the store now moves or goes
        barrier.wait(HANG_DEADLINE_S)
        if not share:
            mover = comms.store_moved("127.0.0.1", port.value)
            assert mover is not None
            mover.join(HANG_DEADLINE_S)
        barrier.wait(HANG_DEADLINE_S)  # every member's address is where it will be read
        t = torch.full((4,), float(rank))
        if rank in (0, 2):
            peer = 2 - rank
            op = dist.isend if rank == 0 else dist.irecv
            op(t, peer).wait(timeout=timedelta(seconds=RELEASE_DEADLINE_S))
        out.put(("done", rank, (learnt, t.tolist())))
        barrier.wait(HANG_DEADLINE_S)
        comms.abort()
        comms.destroy()
    except Exception as e:
        out.put(("error", rank, repr(e)))
        raise


def _new_pair_after(share: bool, between) -> dict[int, tuple[int, list[float]]]:
    """Run :func:`_member_on_a_new_pair` on every rank, with ``between(port)`` done once the
    groups are formed (``port``: the store's, a shared value); each member's result."""
    server = StoreServer(SECRET, JOB_ID, "127.0.0.1").start()
    ctx = rank_context()
    barrier, out = ctx.Barrier(WORLD_SIZE + 1), ctx.Queue()
    port = ctx.Value("i", server.port)
    procs = [
        rank_process(_member_on_a_new_pair, (r, port, barrier, out, share))
        for r in range(WORLD_SIZE)
    ]
    for p in procs:
        p.start()
    results = {}
    try:
        barrier.wait(HANG_DEADLINE_S)
        server.close()
        between(port)
        barrier.wait(HANG_DEADLINE_S)
        barrier.wait(HANG_DEADLINE_S)
        for _ in range(WORLD_SIZE):
            kind, rank, value = out.get(timeout=HANG_DEADLINE_S)
            assert kind == "done", (kind, rank, value)
            results[rank] = value
        barrier.wait(HANG_DEADLINE_S)
    finally:
        for p in procs:
            p.join(timeout=10)
            p.kill()
    return results


@pytest.mark.slow
def test_after_the_store_moves_a_pair_used_for_the_first_time_connects_through_the_new_one():
    """A standby coordinator took over, its store new and empty: every member writes its
    address there again, and a pair first used afterwards still finds its peer."""
    stores: list[StoreServer] = []

    def move(port) -> None:
        stores.append(StoreServer(SECRET, JOB_ID, "127.0.0.1").start())
        port.value = stores[0].port

    try:
        results = _new_pair_after(share=False, between=move)
    finally:
        for store in stores:
            store.close()
    assert results[2][1] == [0.0] * 4, results  # rank 0's tensor arrived


@pytest.mark.slow
def test_members_that_shared_their_addresses_connect_a_new_pair_with_no_store_left():
    """Every coordinator is lost, and the store with it: a pair first used afterwards (a stop
    checkpoint's gather, say) finds its peer's address in what the members gave each other."""
    results = _new_pair_after(share=True, between=lambda port: None)
    # Each member learnt the default group's address of the three others.
    assert {learnt for learnt, _ in results.values()} == {WORLD_SIZE - 1}, results
    assert results[2][1] == [0.0] * 4, results  # rank 0's tensor arrived
