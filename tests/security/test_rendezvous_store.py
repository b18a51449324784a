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


def _gloo_group(server, prefix: str, world: int) -> dict[int, float]:
    """Form a gloo group of ``world`` ranks (threads) through ``server`` and all-reduce once."""
    results: dict[int, float] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            c = SignedStore("127.0.0.1", server.port, SECRET, JOB, timedelta(seconds=30))
            pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, c), r, world, timedelta(seconds=30))
            t = torch.full((4,), float(r + 1))
            pg.allreduce([t]).wait()
            results[r] = t[0].item()
            c.close()
        except BaseException as e:  # surfaced by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return results


def test_a_gloo_group_forms_through_it_and_computes(server):
    assert _gloo_group(server, "gen7/", 3) == {0: 6.0, 1: 6.0, 2: 6.0}
    assert server.delete_prefix("gen7/") > 0
    assert not any(k.startswith("gen7/") for k in server._data.values)


def test_with_the_engines_gloo_environment_a_group_reads_few_small_addresses(server, monkeypatch):
    """Every member reads all the others' addresses: by default one ``get`` each (N^2 reads a
    group) of values that grow with N; with the environment every group of the engine is made
    in, batched ``multi_get`` reads of values whose size does not depend on N. Both as
    ``p2p-bench rendezvous`` emulates them."""
    from bench.rendezvous_bench import address_bytes, reads_per_member
    from bench.scale_model import LAZY_PAIRS
    from recovery.comms import GLOO_ENVIRONMENT

    def form(prefix: str, world: int) -> tuple[dict[str, int], set[int]]:
        before = dict(server.served_ops)
        total = world * (world + 1) / 2
        assert _gloo_group(server, prefix, world) == dict.fromkeys(range(world), total)
        ops = {op: n - before.get(op, 0) for op, n in server.served_ops.items()}
        sizes = {len(v) for k, v in server._data.values.items() if k.startswith(prefix)}
        server.delete_prefix(prefix)
        return ops, sizes

    for name in GLOO_ENVIRONMENT:  # set for good by any group the engine made in this process
        monkeypatch.delenv(name, raising=False)
    plain_ops, plain_5 = form("plain5/", 5)
    assert plain_ops["set"] == 5 and plain_ops["get"] == 5 * 5  # a wait (checks), then a get
    assert plain_ops["check"] + plain_ops["get"] >= 5 * reads_per_member(5, "default")
    assert plain_5 == {address_bytes(5, engine=False)}  # one pair number per member in each
    _, plain_8 = form("plain8/", 8)
    assert plain_8 == {address_bytes(8, engine=False)} and max(plain_8) > max(plain_5)
    for name, (value, _) in GLOO_ENVIRONMENT.items():
        monkeypatch.setenv(name, value)
    ops_5, sizes_5 = form("v2a/", 5)
    _, sizes_8 = form("v2b/", 8)
    assert ops_5.get("get", 0) == ops_5.get("check", 0) == 0
    assert ops_5["multi_get"] >= 5 * reads_per_member(5, "engine")  # and polls
    assert sizes_5 == sizes_8 == {address_bytes(5, engine=True)}  # the same at any size
    # With --lazy-gloo a member reads only the addresses of the pairs it connects: its ring
    # neighbours' for an all-reduce, a wait and a get each.
    monkeypatch.setenv("TORCH_GLOO_LAZY_INIT", "1")
    lazy_ops, lazy_5 = form("lazy/", 5)
    assert lazy_ops["set"] == 5 and lazy_ops.get("multi_get", 0) == 0
    assert lazy_ops["get"] == 5 * LAZY_PAIRS
    assert lazy_ops["check"] + lazy_ops["get"] >= 5 * reads_per_member(5, "lazy")
    assert lazy_5 == {address_bytes(5, engine=True)}


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
    st.tuples(st.just("append"), _keys, _vals),
    st.tuples(st.just("multi_set"), st.lists(_keys, max_size=3), st.lists(_vals, max_size=3)),
    st.tuples(st.just("multi_get"), st.lists(_keys, max_size=3)),
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
            if op in ("multi_set", "multi_get"):
                args[0] = [prefix + k for k in args[0]]
                if op == "multi_set":
                    n = min(len(args[0]), len(args[1]))
                    args = [args[0][:n], args[1][:n]]
            elif op != "num_keys":
                args[0] = prefix + args[0]  # this example's keys only (the server is shared)
            if op == "get" and not theirs.check([args[0]]):
                continue  # both would block until their timeout
            if op == "multi_get" and not theirs.check(args[0]):
                continue
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


def test_a_client_moved_to_a_new_store_writes_its_keys_there_and_asks_it_from_then_on():
    """A standby coordinator took over with a new, empty store: what the client wrote is
    written there again, and a request the old store never answered is asked there."""
    old = StoreServer(SECRET, JOB, "127.0.0.1").start()
    moved = SignedStore("127.0.0.1", old.port, SECRET, JOB, timedelta(seconds=60))
    moved.set("mine", b"my address")
    old.close()  # hung: nothing is answered any more
    got: list[bytes] = []
    t = threading.Thread(target=lambda: got.append(moved.get("theirs")))
    t.start()
    with StoreServer(SECRET, JOB, "127.0.0.1") as new:
        other = SignedStore("127.0.0.1", new.port, SECRET, JOB, timedelta(seconds=30))
        try:
            moved.move_to("127.0.0.1", new.port)
            assert other.get("mine") == b"my address"
            other.set("theirs", b"their address")
            t.join(30)  # far below the client's own 60 s timeout
            assert got == [b"their address"]
            moved.set("later", b"x")
            assert other.get("later") == b"x"
        finally:
            other.close()
            moved.close()


def test_values_it_was_given_are_answered_with_no_store_left():
    gone = StoreServer(SECRET, JOB, "127.0.0.1").start()
    c = SignedStore("127.0.0.1", gone.port, SECRET, JOB, timedelta(seconds=2))
    gone.close()
    c.know({"a": b"1", "b": b"2"})
    try:
        c.wait(["a", "b"])
        assert c.check(["a"]) and c.get("b") == b"2" and c.multi_get(["b", "a"]) == [b"2", b"1"]
        with pytest.raises(dist.DistStoreError, match="no answer"):
            c.get("c")  # anything else is still asked of the store
    finally:
        c.close()


def test_a_multi_get_waits_for_every_key_and_pages_what_one_reply_cannot_hold(server, client):
    big = b"x" * (store_mod.MAX_VALUE_BYTES * 3 // 5)  # two do not fit in one reply
    client.multi_set(["page/a", "page/b"], [big, b"small"])
    late = threading.Timer(0.2, lambda: client.set("page/c", big))
    late.start()
    before = server.served_ops["multi_get"]
    waiter = SignedStore("127.0.0.1", server.port, SECRET, JOB, timedelta(seconds=10))
    try:
        assert waiter.multi_get(["page/a", "page/b", "page/c"]) == [big, b"small", big]
    finally:
        late.join()
        waiter.close()
    assert server.served_ops["multi_get"] - before >= 2  # the wait's polls and the second page
    short = SignedStore("127.0.0.1", server.port, SECRET, JOB, timedelta(seconds=0.3))
    try:
        with pytest.raises(dist.DistStoreError, match=r"timed out .* 3 keys from 'page/a'"):
            short.multi_get(["page/a", "page/b", "page/never"])
    finally:
        short.close()
    server.delete_prefix("page/")


def test_the_extended_api_keeps_every_bound():
    with StoreServer(SECRET, JOB, "127.0.0.1", max_total_bytes=4096) as small:
        c = SignedStore("127.0.0.1", small.port, SECRET, JOB, timedelta(seconds=5))
        try:
            c.multi_set(["a", "b"], [b"x" * 1000, b"y" * 1000])
            with pytest.raises(dist.DistStoreError, match="store is full"):
                c.multi_set(["c", "d"], [b"1" * 1000, b"2" * 2000])
            assert not c.check(["c"])  # all or nothing
            with pytest.raises(ValueError, match="2 keys with 1 values"):
                c.multi_set(["c", "d"], [b"1"])
            c.append("a", b"z")
            assert c.get("a") == b"x" * 1000 + b"z"
        finally:
            c.close()
    with StoreServer(SECRET, JOB, "127.0.0.1") as server:
        c = SignedStore("127.0.0.1", server.port, SECRET, JOB, timedelta(seconds=5))
        try:
            c.set("long", b"x" * store_mod.MAX_VALUE_BYTES)
            with pytest.raises(dist.DistStoreError, match="longer than a value may be"):
                c.append("long", b"y")
        finally:
            c.close()


def test_malformed_extended_requests_get_an_error_reply(server, ctx):
    sock = _raw(ctx, server.port)
    for seq, (op, args) in enumerate(
        [
            ("multi_set", [["k"], [b"1", b"2"]]),
            ("multi_set", [["k"], "not a list"]),
            ("multi_get", ["not a list"]),
            ("multi_get", [["k"] * (store_mod.MAX_KEYS_PER_REQUEST + 1)]),
            ("append", ["k", 5]),
        ],
        start=1,
    ):
        sock.send_multipart(_request(seq, op, args, sid=b"m" * 16))
        reply = _answered(sock)
        assert reply is not None and reply["error"], (op, args)
