"""Hostile input never crashes or changes the coordinator; every drop is logged with a reason."""

from __future__ import annotations

import copy
import hashlib
import hmac

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


@pytest.fixture
def coordinator(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    c = Coordinator(
        CoordinatorConfig(
            secret_file=str(secret),
            run_dir=str(tmp_path),
            host_store=False,
            membership=MembershipConfig(world_size=2, ranks_per_node=1),
        )
    )
    yield c
    c.close()


def _state(c: Coordinator):
    m = c.membership
    return copy.deepcopy((m.generation, m.ranks, m.spares, sorted(m.procs), m.replicated))


def _sign(payload: bytes, secret: bytes = SECRET) -> bytes:
    return hmac.new(secret, payload, hashlib.sha256).digest()


def _payload(**over) -> bytes:
    doc = {
        "v": 1,
        "type": "hello",
        "job": "p2p-job",
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
        st.sampled_from(["v", "type", "job", "sender", "gen", "seq", "body"]),
        st.one_of(
            st.integers(-(2**63), 2**63 - 1),
            st.text(max_size=10),
            st.none(),
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
    bad.send_multipart(
        codec.encode(protocol.HELLO, {"role": "rank", "node": 0, "pid": 1, "rank": 0})
    )
    coordinator.serve(stop_after_s=1.0)
    assert "rank/0" in coordinator.membership.procs, "the valid hello still got through"
    assert bad.poll(2000), "and was answered"
    reply = protocol.Codec(SECRET, "p2p-job", "x").decode(bad.recv_multipart())
    assert reply.type == protocol.WELCOME
    bad.close(linger=0)
    ctx.term()
