"""Hostile input never crashes or changes the coordinator; every drop is logged with a reason.

Run in-process against the real :class:`Coordinator` (its ``handle_frames``, then its socket).
"""

from __future__ import annotations

import copy
import hashlib
import hmac
import time

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from launcher import protocol
from launcher.coordinator import Coordinator, CoordinatorConfig
from launcher.events import read_events
from launcher.membership import MembershipConfig

SECRET = b"0123456789abcdef0123456789abcdef"
OPERATOR_KEY = b"fedcba9876543210fedcba9876543210"
RUN = b"r" * protocol.RUN_NONCE_BYTES
"""The run nonce of the coordinator under test (fixed, so frames can be made up front)."""


@pytest.fixture
def coordinator(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    operator_key = tmp_path / "operator.key"
    operator_key.write_bytes(OPERATOR_KEY)
    operator_key.chmod(0o600)
    c = Coordinator(
        CoordinatorConfig(
            secret_file=str(secret),
            operator_key_file=str(operator_key),
            run_dir=str(tmp_path),
            host_store=False,
            membership=MembershipConfig(world_size=2, ranks_per_node=1),
        )
    )
    c.codec.run = RUN
    yield c
    c.close()


def _state(c: Coordinator):
    m = c.membership
    return copy.deepcopy((m.generation, m.ranks, m.spares, sorted(m.procs), m.replicated))


def _sign(payload: bytes, secret: bytes = SECRET) -> bytes:
    return hmac.new(secret, payload, hashlib.sha256).digest()


EPOCH = time.time_ns()


@pytest.fixture(autouse=True)
def _fresh_epoch():
    """Each test's messages are of a fresh incarnation: a hello must be within FRESHNESS_S of
    the receiver's clock, and a long suite can run a test more than that after import."""
    global EPOCH
    EPOCH = time.time_ns()


def _payload(**over) -> bytes:
    doc = {
        "v": protocol.PROTOCOL_VERSION,
        "epoch": EPOCH,
        "term": 0,
        "type": "hello",
        "job": "p2p-job",
        "run": RUN,
        "sender": "rank/0",
        "gen": 0,
        "seq": 1,
        "body": {"role": "rank", "node": 0, "pid": 1, "rank": 0},
    }
    doc.update(over)
    return msgpack.packb(doc)


BAD_MESSAGES = {
    "no frames": [b"rank/0"],
    "one frame": [b"rank/0", b"x"],
    "three frames": [b"rank/0", b"a", b"b", b"c"],
    "bad tag": [b"rank/0", b"\x00" * 32, _payload()],
    "other secret": [b"rank/0", _sign(_payload(), b"wrong"), _payload()],
    "truncated": [b"rank/0", _sign(_payload()[:-5]), _payload()[:-5]],
    "not msgpack": [b"rank/0", _sign(b"\xc1\xc1"), b"\xc1\xc1"],
    "not a map": [b"rank/0", _sign(msgpack.packb([1, 2])), msgpack.packb([1, 2])],
    "oversized": [b"rank/0", b"", b"x" * (protocol.MAX_MESSAGE_BYTES + 1)],
    "wrong version": [b"rank/0", _sign(_payload(v=99)), _payload(v=99)],
    "other job": [b"rank/0", _sign(_payload(job="x")), _payload(job="x")],
    "unknown type": [b"rank/0", _sign(_payload(type="nuke")), _payload(type="nuke")],
    "spoofed sender": [b"rank/1", _sign(_payload()), _payload()],
    "bad body": [
        b"rank/0",
        _sign(_payload(body={"role": "rank"})),
        _payload(body={"role": "rank"}),
    ],
    "bad role": [
        b"rank/0",
        _sign(_payload(body={"role": "god", "node": 0, "pid": 1})),
        _payload(body={"role": "god", "node": 0, "pid": 1}),
    ],
    "string seq": [b"rank/0", _sign(_payload(seq="1")), _payload(seq="1")],
    "list type": [b"rank/0", _sign(_payload(type=["hello"])), _payload(type=["hello"])],
    "map type": [b"rank/0", _sign(_payload(type={"a": 1})), _payload(type={"a": 1})],
    "no epoch": [b"rank/0", _sign(_payload(epoch=None)), _payload(epoch=None)],
    "stale hello": [b"rank/0", _sign(_payload(epoch=1)), _payload(epoch=1)],
}


@pytest.mark.parametrize("name", sorted(BAD_MESSAGES))
def test_each_kind_of_bad_message_is_dropped_with_its_reason(coordinator, tmp_path, name):
    before = _state(coordinator)
    coordinator.handle_frames(BAD_MESSAGES[name])
    assert _state(coordinator) == before
    assert coordinator.dropped == 1
    drops = [e for e in read_events(tmp_path) if e["event"] == "message_dropped"]
    assert len(drops) == 1 and drops[0]["reason"]


def test_a_replayed_message_is_dropped(coordinator):
    frames = [b"rank/0", _sign(_payload()), _payload()]
    coordinator.handle_frames(frames)
    assert "rank/0" in coordinator.membership.procs
    before = _state(coordinator)
    coordinator.handle_frames(frames)
    assert coordinator.dropped == 1 and _state(coordinator) == before


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(st.binary(max_size=200), min_size=0, max_size=4))
def test_random_frames_never_crash_or_change_anything(coordinator, frames):
    before = _state(coordinator)
    coordinator.handle_frames(frames)
    assert _state(coordinator) == before


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.dictionaries(
        st.sampled_from(["v", "type", "job", "sender", "gen", "seq", "epoch", "term", "body"]),
        st.one_of(
            st.integers(-(2**63), 2**63 - 1),
            st.text(max_size=10),
            st.none(),
            st.booleans(),
            st.floats(),
            st.lists(st.integers(0, 9), max_size=3),
            st.dictionaries(st.text(max_size=5), st.integers(0, 9), max_size=3),
        ),
    )
)
def test_well_signed_but_malformed_documents_never_change_anything(coordinator, doc):
    payload = msgpack.packb(doc)
    before = _state(coordinator)
    coordinator.handle_frames([b"rank/0", _sign(payload), payload])
    # Only a document that is valid in every field may change state: check it changed nothing
    # unless it was a complete, correct hello.
    if not (
        doc.get("type") == "hello"
        and isinstance(doc.get("body"), dict)
        and {"role", "node", "pid"} <= set(doc["body"])
    ):
        assert _state(coordinator) == before


def test_it_keeps_serving_real_sockets_after_garbage(coordinator):
    ctx = zmq.Context()
    bad = ctx.socket(zmq.DEALER)
    bad.setsockopt(zmq.IDENTITY, b"rank/0")
    bad.connect(f"tcp://127.0.0.1:{coordinator.port}")
    for frames in BAD_MESSAGES.values():
        if len(frames) > 1:
            bad.send_multipart(frames[1:])
    codec = protocol.Codec(SECRET, "p2p-job", "rank/0")
    codec.run = RUN
    bad.send_multipart(
        codec.encode(protocol.HELLO, {"role": "rank", "node": 0, "pid": 1, "rank": 0})
    )
    coordinator.serve(stop_after_s=1.0)
    assert "rank/0" in coordinator.membership.procs, "the valid hello still got through"
    assert bad.poll(2000), "and was answered"
    reader = protocol.Codec(SECRET, "p2p-job", "x")
    reader.run = RUN
    reply = reader.decode(bad.recv_multipart())
    assert reply.type == protocol.WELCOME
    bad.close(linger=0)
    ctx.term()


HELLO_BODY = {"role": "rank", "node": 0, "pid": 1, "rank": 0}
WRONG_VALUES = [["x"], {"k": 1}, "1", 1.5, True, None, 2**63]


def _fields():
    for name in ("v", "type", "job", "run", "sender", "gen", "seq", "epoch", "term", "body"):
        yield "envelope", name
    for name in HELLO_BODY:
        yield "body", name


@pytest.mark.parametrize(("where", "name"), list(_fields()))
def test_a_wrong_type_at_any_field_of_a_signed_hello_is_dropped(coordinator, where, name):
    before = _state(coordinator)
    for seq, wrong in enumerate(WRONG_VALUES, start=1):
        if where == "envelope":
            payload = _payload(seq=seq, **{name: wrong}) if name != "seq" else _payload(seq=wrong)
        else:
            if name == "rank" and wrong is None:
                continue  # a spare's hello: no rank is valid
            payload = _payload(seq=seq, body={**HELLO_BODY, name: wrong})
        coordinator.handle_frames([b"rank/0", _sign(payload), payload])
    assert _state(coordinator) == before
    assert coordinator.dropped >= len(WRONG_VALUES) - 1


def _message(codec: protocol.Codec, type_: str, body: dict) -> list[bytes]:
    codec.run = RUN  # a process that has learned this run's nonce
    key = OPERATOR_KEY if codec.sender.startswith("operator/") else None
    return [codec.sender.encode(), *codec.encode(type_, body, key=key)]


def _join_agent(c: Coordinator, node: int) -> protocol.Codec:
    agent = protocol.Codec(SECRET, "p2p-job", f"agent/{node}")
    c.handle_frames(
        _message(agent, protocol.HELLO, {"role": "agent", "node": node, "pid": 10, "world_size": 2})
    )
    assert f"agent/{node}" in c.membership.procs
    return agent


def test_an_old_incarnations_frames_never_count_and_a_restarted_process_rejoins(coordinator):
    spare = protocol.Codec(SECRET, "p2p-job", "spare/0/0")
    hello = _message(spare, protocol.HELLO, {"role": "spare", "node": 0, "pid": 7})
    coordinator.handle_frames(hello)
    assert "spare/0/0" in coordinator.membership.procs
    agent = _join_agent(coordinator, 0)
    coordinator.handle_frames(
        _message(agent, protocol.EXITED, {"identity": "spare/0/0", "pid": 7, "code": -9})
    )
    assert "spare/0/0" not in coordinator.membership.procs
    dropped = coordinator.dropped
    coordinator.handle_frames(hello)  # the gone process's captured hello, replayed
    assert coordinator.dropped == dropped + 1
    assert "spare/0/0" not in coordinator.membership.procs, "no ghost spare"
    # A new process with the same identity (a newer epoch) starts again at sequence 1.
    restarted = protocol.Codec(SECRET, "p2p-job", "spare/0/0")
    assert restarted.epoch > spare.epoch
    coordinator.handle_frames(
        _message(restarted, protocol.HELLO, {"role": "spare", "node": 0, "pid": 8})
    )
    assert "spare/0/0" in coordinator.membership.procs


def test_a_restarted_agent_is_heard_again(coordinator):
    first = _join_agent(coordinator, 0)
    coordinator.handle_frames(_message(first, protocol.HEARTBEAT, {}))
    again = _join_agent(coordinator, 0)  # a new incarnation's seq 1 is not taken for a replay
    assert again.epoch > first.epoch
    dropped = coordinator.dropped
    coordinator.handle_frames(_message(first, protocol.HEARTBEAT, {}))
    assert coordinator.dropped == dropped + 1, "the old incarnation's frames no longer count"


def test_a_previous_runs_scale_is_refused(coordinator, tmp_path):
    old = protocol.Codec(SECRET, "p2p-job", "operator/1")
    old.epoch -= int((protocol.FRESHNESS_S + 60) * 1e9)  # captured more than FRESHNESS_S ago
    coordinator.handle_frames(_message(old, protocol.SCALE, {"size": 1}))
    assert coordinator.dropped == 1
    assert not [e for e in read_events(tmp_path) if e["event"] == "scale_request"]
    # Proof the check can fail: the same message, fresh, is a scale request.
    fresh = protocol.Codec(SECRET, "p2p-job", "operator/1")
    coordinator.handle_frames(_message(fresh, protocol.SCALE, {"size": 1}))
    assert [e for e in read_events(tmp_path) if e["event"] == "scale_request"]


@pytest.mark.parametrize("size", ["2", 1.5, True, None, -1, 0, 2**40])
def test_a_size_must_be_a_valid_integer(coordinator, tmp_path, size):
    op = protocol.Codec(SECRET, "p2p-job", "operator/1")
    coordinator.handle_frames(_message(op, protocol.SCALE, {"size": size}))
    assert coordinator.dropped == 1
    assert not [e for e in read_events(tmp_path) if e["event"] == "scale_request"]


def test_only_an_operator_resizes_and_only_an_agent_reports_its_own_nodes_exits(
    coordinator, tmp_path
):
    rank = protocol.Codec(SECRET, "p2p-job", "rank/0/0")
    coordinator.handle_frames(
        _message(rank, protocol.HELLO, {"role": "rank", "node": 0, "pid": 3, "rank": 0})
    )
    coordinator.handle_frames(_message(rank, protocol.SCALE, {"size": 1}))
    assert not [e for e in read_events(tmp_path) if e["event"] == "scale_request"]
    # A rank reporting another process's exit, or an agent another node's, is dropped.
    coordinator.handle_frames(
        _message(rank, protocol.EXITED, {"identity": "rank/0/0", "pid": 3, "code": 1})
    )
    _join_agent(coordinator, 0)
    other = _join_agent(coordinator, 1)
    before = _state(coordinator)
    coordinator.handle_frames(
        _message(other, protocol.EXITED, {"identity": "rank/0/0", "pid": 3, "code": 1})
    )
    assert _state(coordinator) == before and "rank/0/0" in coordinator.membership.procs
    assert coordinator.dropped == 3
    # An operator sends nothing but scale.
    op = protocol.Codec(SECRET, "p2p-job", "operator/1")
    coordinator.handle_frames(_message(op, protocol.ERROR, {"reason": "x", "fatal": True}))
    assert coordinator.exit_code is None and coordinator.dropped == 4


def test_drop_logging_is_rate_limited(coordinator, tmp_path, caplog):
    with caplog.at_level("WARNING", logger="launcher.protocol"):
        for _ in range(2000):
            coordinator.handle_frames(BAD_MESSAGES["bad tag"])
    assert coordinator.dropped == 2000, "every drop is counted"
    drops = [e for e in read_events(tmp_path) if e["event"] == "message_dropped"]
    assert 1 <= len(drops) <= 20
    assert len(caplog.records) <= 20


def test_buffer_sizes_are_taken_from_ranks_only_checked_and_told_once_all_ranks_reported(
    coordinator, tmp_path
):
    ranks = [protocol.Codec(SECRET, "p2p-job", f"rank/{r}/0") for r in range(2)]
    for r, codec in enumerate(ranks):
        body = {"role": "rank", "node": r, "pid": 20 + r, "rank": r}
        coordinator.handle_frames(_message(codec, protocol.HELLO, body))
    spare = protocol.Codec(SECRET, "p2p-job", "spare/0/5")
    coordinator.handle_frames(
        _message(spare, protocol.HELLO, {"role": "spare", "node": 0, "pid": 30})
    )
    generation = coordinator.membership.generation
    assert generation == 1

    def report(codec, **body):
        body = {"generation": generation, "kind": "host", "buffers": [64, 64], **body}
        coordinator.handle_frames(_message(codec, protocol.MEMORY, body))

    def told():
        return [e for e in read_events(tmp_path) if e["event"] == "spares_prepared"]

    report(spare)  # a spare holds no rank's buffers
    for bad in ([0], ["64"], [True], [2**50], [1] * 65, 64):
        report(ranks[0], buffers=bad)
    report(ranks[0], kind="disk")
    assert coordinator.dropped == 8 and not told()
    report(ranks[0], buffers=[100, 100, 60, 60])
    assert not told(), "rank 1 has not reported yet"
    report(ranks[1], buffers=[110, 110, 50, 50])
    (event,) = told()
    assert event["spares"] == ["spare/0/5"] and event["nbytes"] == 340
    assert coordinator.spare_memory.told == ("host", (110, 110, 60, 60))
    report(ranks[0], buffers=[100, 100, 60, 60])
    assert len(told()) == 1, "the same sizes are not told again"
