"""The coordinator's admission limits, against the real coordinator over loopback: a cap on
connections that said no hello, and a message quota per connection."""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest
import zmq

from launcher import protocol
from launcher.admission import Quota
from launcher.coordinator import Coordinator, CoordinatorConfig
from launcher.membership import MembershipConfig
from tests.security.conftest import dealer

SECRET = b"0123456789abcdef0123456789abcdef"
AGENT_HELLO = {"role": "agent", "node": 1, "pid": 5, "world_size": 2}


def _coordinator(tmp_path, **config) -> Coordinator:
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    return Coordinator(
        CoordinatorConfig(
            secret_file=str(secret),
            run_dir=str(tmp_path),
            host_store=False,
            membership=MembershipConfig(world_size=2, ranks_per_node=1),
            **config,
        )
    )


def _dealer(ctx, routing: bytes, port: int) -> zmq.Socket:
    return dealer(ctx, routing, port, RECONNECT_IVL=50)


def _joins(sock: zmq.Socket, codec: protocol.Codec, body: dict, timeout_s: float = 30.0) -> bool:
    """Whether a hello sent on ``sock`` is welcomed within ``timeout_s``; sent again every
    0.5 s while unanswered, as a rank's client does (a refused connection loses its queue)."""
    deadline = time.monotonic() + timeout_s
    while deadline - time.monotonic() > 0:
        try:
            sock.send_multipart(codec.encode(protocol.HELLO, body), zmq.NOBLOCK)
        except zmq.Again:
            pass  # not connected (yet, or refused): again in a moment
        if sock.poll(500) and any(m.type == protocol.WELCOME for m in codec.drain(sock)):
            return True
    return False


def _eventually(predicate, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_connections_beyond_the_cap_are_refused_with_one_line_and_real_peers_get_in(
    tmp_path, ctx, caplog
):
    from launcher.client import ClientConfig, ControlClient

    c = _coordinator(tmp_path, max_unauthenticated_connections=4)
    thread = threading.Thread(target=c.serve, kwargs={"stop_after_s": 120}, daemon=True)
    thread.start()
    client = None
    try:
        with caplog.at_level(logging.WARNING, logger="launcher.admission"):
            first = protocol.Codec(SECRET, "p2p-job", "agent/0")
            early = _dealer(ctx, protocol.routing_id("agent/0").encode(), c.port)
            assert _joins(early, first, {**AGENT_HELLO, "node": 0}), "admitted under the cap"
            # Idle connections that never say hello, one at a time: 4 are let in.
            idle = []
            for i in range(4):
                idle.append(_dealer(ctx, f"idle/{i}".encode(), c.port))
                assert _eventually(lambda n=i + 1: c.gate.unauthenticated == n)
            idle.append(_dealer(ctx, b"idle/4", c.port))
            assert _eventually(lambda: c.gate.refused == 1), "the 5th is refused"
            assert _eventually(lambda: c.gate.unauthenticated == 4)
            # A rank arriving now is refused too, and tries again on a fresh connection.
            client = ControlClient(
                ClientConfig(
                    coordinator=f"127.0.0.1:{c.port}",
                    job_id="p2p-job",
                    secret_file=str(tmp_path / "secret"),
                    identity="rank/0",
                    role="rank",
                    node=0,
                ),
                rank=0,
            )
            assert _eventually(lambda: c.gate.refused >= 2)
            assert "rank/0" not in c.membership.procs
            records = [r for r in caplog.records if "refused a connection" in r.getMessage()]
            assert "max_unauthenticated_connections, is 4" in records[0].getMessage()
            # One line per 10 s window, however many are refused (2 or more by now).
            windows = 1 + int((time.time() - records[0].created) / 10)
            assert len(records) <= windows
            for s in idle:
                s.close(linger=0)
            client.store_address(timeout_s=30)  # welcomed once the idle connections closed
            assert _eventually(lambda: "rank/0" in c.membership.procs)
            # The peer that said hello before the flood was served throughout.
            assert "agent/0" in c.membership.procs
    finally:
        if client is not None:
            client.close()
        c.exit_code = 0
        thread.join(timeout=10)
        c.close()


def test_a_connection_over_its_quota_is_dropped_before_its_tag_is_checked(tmp_path, caplog):
    c = _coordinator(tmp_path, max_messages_per_s=1.0)  # a burst of 2, then 1 a second
    try:
        with caplog.at_level(logging.WARNING, logger="launcher.protocol"):
            for _ in range(50):
                c.handle_frames([b"flood", os.urandom(32), os.urandom(64)])
        assert c.over_quota >= 40 and c.dropped == 50
        assert any("over its quota of 1 messages/s" in r.getMessage() for r in caplog.records)
        # Another connection has a quota of its own: its hello is taken.
        agent = protocol.Codec(SECRET, "p2p-job", "agent/1")
        agent.run = c.codec.run
        c.handle_frames([b"agent/1", *agent.encode(protocol.HELLO, AGENT_HELLO)])
        assert "agent/1" in c.membership.procs
    finally:
        c.close()


def test_the_quota_refills_at_its_rate_and_tracks_a_bounded_number_of_connections():
    quota = Quota(per_s=10.0, burst=5.0, max_tracked=100)
    assert [quota.allow(b"a", 0.0) for _ in range(6)] == [True] * 5 + [False]
    assert not quota.allow(b"a", 0.05), "half a token is not a message"
    assert quota.allow(b"a", 0.2)
    assert quota.allow(b"b", 0.2), "each connection has its own bucket"
    for i in range(1000):
        quota.allow(str(i).encode(), 10.0 + i)
    assert len(quota._buckets) <= 100


def test_the_limits_must_be_positive():
    with pytest.raises(ValueError, match="max_unauthenticated_connections 0"):
        CoordinatorConfig(
            secret_file="s",
            run_dir=".",
            membership=MembershipConfig(world_size=1, ranks_per_node=1),
            max_unauthenticated_connections=0,
        )
    with pytest.raises(ValueError, match="max_messages_per_s 0"):
        CoordinatorConfig(
            secret_file="s",
            run_dir=".",
            membership=MembershipConfig(world_size=1, ranks_per_node=1),
            max_messages_per_s=0,
        )


def test_the_connection_cap_grows_with_the_job_so_its_own_start_is_never_refused():
    from launcher.coordinator import DEFAULT_CONNECTION_CAP, CoordinatorConfig
    from launcher.membership import MembershipConfig
    from launcher.policy import ElasticConfig

    def cap(world: int, **kw) -> int:
        membership = MembershipConfig(world_size=world, ranks_per_node=8, **kw)
        config = CoordinatorConfig(secret_file="s", run_dir="r", membership=membership)
        return config.connection_cap()

    assert cap(64) == DEFAULT_CONNECTION_CAP
    assert cap(16384) == 4 * 16384, "every rank, agent and spare of a 16k job may connect at once"
    assert cap(1024, elastic=ElasticConfig(min_ranks=512, max_ranks=4096)) == 4 * 4096
    explicit = CoordinatorConfig(
        secret_file="s",
        run_dir="r",
        membership=MembershipConfig(world_size=16384, ranks_per_node=8),
        max_unauthenticated_connections=10,
    )
    assert explicit.connection_cap() == 10
