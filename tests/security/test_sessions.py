"""Who a message counts from, against the real coordinator: this run only (the run nonce), the
connection its sender's hello came on only (identity binding), and a resize only with the
operator key."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import zmq

from launcher import protocol
from launcher.coordinator import Coordinator, CoordinatorConfig
from launcher.events import read_events
from launcher.membership import MembershipConfig
from launcher.secret import OPERATOR_KEY_FILE
from tests.security.conftest import dealer

SECRET = b"0123456789abcdef0123456789abcdef"
OPERATOR_KEY = b"fedcba9876543210fedcba9876543210"
AGENT_HELLO = {"role": "agent", "node": 1, "pid": 5, "world_size": 2}


def _private(path, data: bytes) -> str:
    path.write_bytes(data)
    path.chmod(0o600)
    return str(path)


def _coordinator(run_dir, **config) -> Coordinator:
    run_dir.mkdir(exist_ok=True)
    return Coordinator(
        CoordinatorConfig(
            secret_file=_private(run_dir / "secret", SECRET),
            operator_key_file=_private(run_dir / OPERATOR_KEY_FILE, OPERATOR_KEY),
            run_dir=str(run_dir),
            host_store=False,
            membership=MembershipConfig(world_size=2, ranks_per_node=1),
            **config,
        )
    )


@pytest.fixture
def served(tmp_path):
    """A coordinator serving its socket in a thread (the test talks to it over loopback)."""
    c = _coordinator(tmp_path)
    c.publish_address()
    thread = threading.Thread(target=c.serve, kwargs={"stop_after_s": 120}, daemon=True)
    thread.start()
    yield c
    c.exit_code = 0
    thread.join(timeout=10)
    assert not thread.is_alive(), "the coordinator stops when told"
    c.close()


def _until(sock: zmq.Socket, codec: protocol.Codec, type_: str, timeout_s: float = 20.0):
    """The first ``type_`` message ``codec`` reads on ``sock`` (its drain answers challenges)."""
    deadline = time.monotonic() + timeout_s
    while (left_s := deadline - time.monotonic()) > 0:
        if sock.poll(left_s * 1000):
            for msg in codec.drain(sock):
                if msg.type == type_:
                    return msg
    raise AssertionError(f"no {type_} within {timeout_s}s")


def _eventually(predicate, timeout_s: float = 20.0) -> bool:
    """Whether ``predicate()`` becomes true within ``timeout_s`` (the coordinator's thread
    acts on a message just after it answers it)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _state(c: Coordinator):
    m = c.membership
    return copy.deepcopy(
        (
            m.generation,
            m.ranks,
            m.spares,
            sorted(m.procs),
            m.world_size,
            getattr(m, "requested_size", None),
        )
    )


def _events(c: Coordinator, name: str) -> list[dict]:
    return [e for e in read_events(c.config.run_dir) if e["event"] == name]


# -- the run nonce ---------------------------------------------------------------------------


def test_a_previous_runs_hello_and_scale_are_refused_in_a_run_reusing_the_secret(tmp_path):
    run_a = _coordinator(tmp_path / "a")
    try:
        agent = protocol.Codec(SECRET, "p2p-job", "agent/1")
        agent.run = run_a.codec.run  # it learned run A's nonce
        hello = [b"agent/1", *agent.encode(protocol.HELLO, AGENT_HELLO)]
        operator = protocol.Codec(OPERATOR_KEY, "p2p-job", "operator/7")
        operator.run = run_a.codec.run
        scale = [b"operator/7", *operator.encode(protocol.SCALE, {"size": 1})]
        # Proof the captured frames are valid in their own run.
        run_a.handle_frames(hello)
        run_a.handle_frames(scale)
        assert "agent/1" in run_a.membership.procs and _events(run_a, "scale_request")
    finally:
        run_a.close()
    # Run B: the same secret and operator key, within FRESHNESS_S of run A.
    run_b = _coordinator(tmp_path / "b")
    try:
        assert run_b.codec.run != run_a.codec.run
        before = _state(run_b)
        run_b.handle_frames(hello)
        run_b.handle_frames(scale)
        assert run_b.dropped == 2 and _state(run_b) == before, "dropped, and logged"
        assert "agent/1" not in run_b.membership.procs and not run_b.routes
        assert not _events(run_b, "scale_request") and not _events(run_b, "hello")
        reasons = [e["reason"] for e in _events(run_b, "message_dropped")]
        assert all("of another run" in r for r in reasons), reasons
    finally:
        run_b.close()


def test_a_process_learns_the_run_from_the_challenge_and_joins(served, ctx):
    agent = protocol.Codec(SECRET, "p2p-job", "agent/1")
    sock = dealer(ctx, protocol.routing_id("agent/1"), served.port)
    sock.send_multipart(agent.encode(protocol.HELLO, AGENT_HELLO))  # no run nonce yet
    _until(sock, agent, protocol.WELCOME)
    assert agent.run == served.codec.run
    assert _eventually(lambda: "agent/1" in served.membership.procs)


# -- identity bound to the hello's connection ------------------------------------------------


def test_replies_go_only_to_the_connection_that_said_hello(served, ctx):
    # A squatter connects first under the predictable name, then under the same name again
    # (it reconnects), replaying what it captured of the real agent.
    squatter = dealer(ctx, "agent/1", served.port)
    squatter.send_multipart([b"squat", b"x"])
    agent = protocol.Codec(SECRET, "p2p-job", "agent/1")
    real = dealer(ctx, protocol.routing_id("agent/1"), served.port)
    real.send_multipart(agent.encode(protocol.HELLO, AGENT_HELLO))
    _until(real, agent, protocol.WELCOME)
    captured = [agent.encode(protocol.HELLO, AGENT_HELLO), agent.encode(protocol.HEARTBEAT)]
    for frames in captured:
        real.send_multipart(frames)
    squatter.close()
    squatter = dealer(ctx, "agent/1", served.port)
    for frames in captured:
        squatter.send_multipart(frames)  # replays: their sequence numbers were seen
    # The coordinator beats every agent every 0.2 s: the real one hears them, the squatter
    # (whatever it sends) nothing at all.
    _until(real, agent, protocol.HEARTBEAT)
    _until(real, agent, protocol.HEARTBEAT)
    assert not squatter.poll(500), "nothing meant for agent/1 reaches the squatter"
    assert served.routes["agent/1"] == real.getsockopt(zmq.IDENTITY)


def test_a_signed_message_on_a_connection_that_said_no_hello_is_challenged(served, ctx):
    agent = protocol.Codec(SECRET, "p2p-job", "agent/1")
    first = dealer(ctx, protocol.routing_id("agent/1"), served.port)
    first.send_multipart(agent.encode(protocol.HELLO, AGENT_HELLO))
    _until(first, agent, protocol.WELCOME)
    dropped = served.dropped
    # The same process's next message, on another connection (say, a new routing id after a
    # restart of its socket): it does not count there until a hello binds that connection.
    other = dealer(ctx, protocol.routing_id("agent/1"), served.port)
    other.send_multipart(agent.encode(protocol.EXITED, {"identity": "agent/1", "code": 0}))
    reader = protocol.Codec(SECRET, "p2p-job", "reader")
    deadline = time.monotonic() + 20
    challenge = None
    while challenge is None and other.poll(max(0.0, deadline - time.monotonic()) * 1000):
        frames = other.recv_multipart()
        msg = reader.decode(frames)  # a challenge is taken whatever run the reader knows
        challenge = msg if msg.type == protocol.CHALLENGE else None
    assert challenge is not None and challenge.run == served.codec.run
    assert served.dropped > dropped and "agent/1" in served.membership.procs
    reasons = [e["reason"] for e in _events(served, "message_dropped")]
    assert any("has not said hello on" in r for r in reasons), reasons
    # Its drain answers with the hello it sent last: the new connection is now the route.
    agent.answer(other, challenge)
    _until(other, agent, protocol.WELCOME)
    assert _eventually(lambda: served.routes["agent/1"] == other.getsockopt(zmq.IDENTITY))


# -- the operator key ------------------------------------------------------------------------


def test_the_secret_alone_cannot_resize_only_the_operator_key_can(tmp_path):
    c = _coordinator(tmp_path)
    try:
        with_secret = protocol.Codec(SECRET, "p2p-job", "operator/1")
        with_secret.run = c.codec.run
        c.handle_frames([b"operator/1", *with_secret.encode(protocol.SCALE, {"size": 1})])
        assert not _events(c, "scale_request") and c.dropped == 1
        assert "operator key" in _events(c, "message_dropped")[0]["reason"]
        # The operator key signs nothing but a scale from an operator.
        key = protocol.Codec(OPERATOR_KEY, "p2p-job", "agent/1")
        key.run = c.codec.run
        c.handle_frames([b"agent/1", *key.encode(protocol.HELLO, AGENT_HELLO)])
        assert "agent/1" not in c.membership.procs and c.dropped == 2
        operator = protocol.Codec(OPERATOR_KEY, "p2p-job", "operator/1")
        operator.run = c.codec.run
        c.handle_frames([b"operator/1", *operator.encode(protocol.SCALE, {"size": 1})])
        assert [e["size"] for e in _events(c, "scale_request")] == [1]
    finally:
        c.close()


def test_p2p_run_scale_resizes_with_the_operator_key(served, tmp_path, capsys):
    from launcher.scale import main as scale_main

    assert scale_main(["--to", "1", "--run-dir", str(tmp_path)]) == 0
    assert _eventually(lambda: _events(served, "scale_request"))
    assert [e["size"] for e in _events(served, "scale_request")] == [1]
    # Without the operator key there is no request to send: one line says why.
    (tmp_path / OPERATOR_KEY_FILE).unlink()
    with pytest.raises(SystemExit) as e:
        scale_main(["--to", "1", "--run-dir", str(tmp_path)])
    assert e.value.code == 2
    assert "operator.key does not exist (--operator-key)" in capsys.readouterr().err


def test_p2p_run_makes_a_private_operator_key_once(tmp_path):
    from launcher.cli import _operator_key

    _operator_key(tmp_path)
    path = tmp_path / OPERATOR_KEY_FILE
    key = path.read_bytes()
    assert path.stat().st_mode & 0o777 == 0o600 and len(key) == 64
    _operator_key(tmp_path)  # a second node, or a restart: the same key
    assert path.read_bytes() == key


def test_a_routing_id_of_another_identity_is_refused_with_one_line():
    from launcher.client import ClientConfig

    with pytest.raises(ValueError, match="P2P_ROUTING_ID 'rank/1#ab' is not a routing id of"):
        ClientConfig(
            coordinator="127.0.0.1:1",
            job_id="j",
            secret_file="s",
            identity="rank/0",
            role="rank",
            node=0,
            routing_id="rank/1#ab",
        )
