"""The authenticated rendezvous store against real sockets: torch's semantics, real gloo groups
through it, and what a party without the secret (or with an old frame) can do to it: nothing."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import msgpack
import pytest
import torch
import torch.distributed as dist
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from launcher import store as store_mod
from launcher.store import StoreServer
from launcher.store_client import SignedStore

SECRET = b"0123456789abcdef0123456789abcdef"
JOB = "job-1"


@pytest.fixture(scope="module")
def server():
    with StoreServer(SECRET, JOB, "127.0.0.1") as s:
        yield s


@pytest.fixture
def client(server):
    c = SignedStore("127.0.0.1", server.port, SECRET, JOB, timedelta(seconds=5))
    yield c
    c.close()


def _raw(ctx, port: int) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"tcp://127.0.0.1:{port}")
    return s


def _request(seq: int, op: str, args: list, sid: bytes = b"s" * 16, **over) -> list[bytes]:
    doc = {"v": 1, "job": JOB, "sid": sid, "seq": seq, "ts": time.time_ns(), "op": op}
    doc["args"] = args
    doc.update(over)
    payload = msgpack.packb(doc, use_bin_type=True)
    return store_mod._sign(store_mod._store_key(SECRET), payload)


def _answered(sock: zmq.Socket, timeout_ms: int = 2000) -> dict | None:
    if not sock.poll(timeout_ms):
        return None
    return msgpack.unpackb(sock.recv_multipart()[1], raw=False)


def test_a_gloo_group_forms_through_it_and_computes(server):
    results: dict[int, float] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            c = SignedStore("127.0.0.1", server.port, SECRET, JOB, timedelta(seconds=30))
            pg = dist.ProcessGroupGloo(dist.PrefixStore("gen7/", c), r, 3, timedelta(seconds=30))
            t = torch.full((4,), float(r + 1))
            pg.allreduce([t]).wait()
            results[r] = t[0].item()
            c.close()
        except BaseException as e:  # surfaced by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert results == {0: 6.0, 1: 6.0, 2: 6.0}
    assert server.delete_prefix("gen7/") > 0
    assert not any(k.startswith("gen7/") for k in server._data.values)


_keys = st.sampled_from(["a", "b", "c/d"])
_vals = st.binary(max_size=8)
_ops = st.one_of(
    st.tuples(st.just("set"), _keys, _vals),
    st.tuples(st.just("get"), _keys),
    st.tuples(st.just("add"), st.sampled_from(["n", "m"]), st.integers(-5, 5)),
    st.tuples(st.just("compare_set"), _keys, _vals, _vals),
    st.tuples(st.just("check"), _keys),
    st.tuples(st.just("delete_key"), _keys),
    st.tuples(st.just("num_keys")),
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(_ops, max_size=12))
def test_same_answers_as_torchs_own_store(server, ops):
    ours = SignedStore("127.0.0.1", server.port, SECRET, JOB, timedelta(seconds=5))
    prefix = f"h{time.time_ns()}/"
    theirs = dist.HashStore()
    try:
        for op, *args in ops:
            if op != "num_keys":
                args[0] = prefix + args[0]  # this example's keys only (the server is shared)
            if op == "get" and not theirs.check([args[0]]):
                continue  # both would block until their timeout
            if op == "check":
                assert ours.check([args[0]]) == theirs.check([args[0]])
            elif op == "num_keys":
                continue  # ours counts other examples' keys too (a shared server)
            else:
                assert getattr(ours, op)(*args) == getattr(theirs, op)(*args), (op, args)
    finally:
        ours.close()
        server.delete_prefix(prefix)


def test_a_client_without_the_secret_changes_nothing_and_is_told_so(server, client):
    before = client.num_keys()
    outsider = SignedStore("127.0.0.1", server.port, b"x" * 32, JOB, timedelta(seconds=1))
    try:
        with pytest.raises(dist.DistStoreError, match="no answer from the rendezvous store"):
            outsider.set("gen1/rank0", b"forged address")
    finally:
        outsider.close()
    assert client.num_keys() == before
    assert not client.check(["gen1/rank0"])


def test_a_replayed_request_counts_once(server, client, ctx):
    sock = _raw(ctx, server.port)
    frames = _request(1, "add", ["replayed", 5], sid=b"r" * 16)
    sock.send_multipart(frames)
    assert _answered(sock)["result"] == 5
    sock.send_multipart(frames)  # the same frames again, as a capture would be replayed
    assert _answered(sock, 500) is None
    assert client.get("replayed") == b"5"


def test_stale_other_jobs_and_malformed_requests_are_dropped(server, client, ctx):
    sock = _raw(ctx, server.port)
    dropped = server.drops.total
    stale = time.time_ns() - int(2 * store_mod.FRESHNESS_S * 1e9)
    cases = [
        _request(1, "set", ["k1", b"v"], sid=b"a" * 16, ts=stale),
        _request(1, "set", ["k1", b"v"], sid=b"b" * 16, job="another-job"),
        _request(1, "set", ["k1", b"v"], sid=b"short"),
        _request(1, ["set"], ["k1", b"v"], sid=b"c" * 16),
        _request(1, "set", "not a list", sid=b"d" * 16),
        _request(1, "launch", [], sid=b"e" * 16),
        [b"only one frame"],
        [b"x" * 32, b"\xc1 not msgpack"],
    ]
    for frames in cases:
        sock.send_multipart(frames)
    assert _answered(sock, 500) is None
    assert server.drops.total >= dropped + len(cases)
    assert not client.check(["k1"])


def test_bad_arguments_get_an_error_reply_not_a_dead_server(server, client, ctx):
    sock = _raw(ctx, server.port)
    sock.send_multipart(_request(1, "set", [], sid=b"f" * 16))
    assert _answered(sock)["error"]
    with pytest.raises(dist.DistStoreError, match="does not hold an integer"):
        client.set("text", b"abc")
        client.add("text", 1)
    assert client.add("counter-after-errors", 1) == 1


def test_values_are_bounded_one_by_one_and_together():
    with StoreServer(SECRET, JOB, "127.0.0.1", max_total_bytes=4096) as small:
        c = SignedStore("127.0.0.1", small.port, SECRET, JOB, timedelta(seconds=5))
        try:
            c.set("a", b"x" * 3000)
            with pytest.raises(dist.DistStoreError, match="store is full"):
                c.set("b", b"x" * 3000)
            c.set("a", b"x" * 3500)  # replacing a value counts only the difference
            with pytest.raises(dist.DistStoreError, match="malformed value"):
                c.set("big", b"x" * (store_mod.MAX_VALUE_BYTES + 1))
            assert small.total_bytes == 1 + 3500
        finally:
            c.close()


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(st.binary(max_size=200), min_size=1, max_size=4))
def test_random_frames_never_stop_the_server(server, client, ctx, frames):
    sock = _raw(ctx, server.port)
    sock.send_multipart(frames)
    sock.close()
    client.set("alive", b"yes")
    assert client.get("alive") == b"yes"


def test_it_listens_on_the_address_it_is_given_only(server):
    endpoint = server._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
    assert endpoint.startswith("tcp://127.0.0.1:")


def test_close_from_another_thread_ends_a_blocked_get(server):
    """An abort closes the store: a rank waiting for a dead member's key is released."""
    waiting = SignedStore("127.0.0.1", server.port, SECRET, JOB, timedelta(seconds=120))
    outcome: list[BaseException] = []

    def get() -> None:
        try:
            waiting.get("a key nobody writes")
        except dist.DistStoreError as e:
            outcome.append(e)

    t = threading.Thread(target=get)
    t.start()
    deadline = time.monotonic() + 10
    while waiting._seq == 0 and time.monotonic() < deadline:  # the get has reached the server
        time.sleep(0.01)
    waiting.close()
    t.join(30)  # far below the store's own 120 s timeout
    assert not t.is_alive()
    assert outcome and "closed" in str(outcome[0])
