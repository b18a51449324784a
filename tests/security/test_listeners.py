"""Abuse of the real listeners over real loopback sockets: oversized and half-sent frames,
squatted identities, floods and garbage, against the coordinator, a rank's client and the
data-cache peer server."""

from __future__ import annotations

import os
import socket
import time

import msgpack
import pytest
import zmq

from dataload.cache import CacheConfig, open_or_build
from dataload.peer_fetch import SegmentServer, fetch_cache, pack_request
from launcher import protocol
from launcher.client import ClientConfig, ControlClient
from launcher.coordinator import Coordinator, CoordinatorConfig
from launcher.membership import MembershipConfig
from tests.security.conftest import dealer

SECRET = b"0123456789abcdef0123456789abcdef"


@pytest.fixture
def secret_file(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(SECRET)
    path.chmod(0o600)
    return str(path)


@pytest.fixture
def coordinator(tmp_path, secret_file):
    c = Coordinator(
        CoordinatorConfig(
            secret_file=secret_file,
            run_dir=str(tmp_path),
            host_store=False,
            membership=MembershipConfig(world_size=2, ranks_per_node=1),
        )
    )
    yield c
    c.close()


def _hello(
    ctx, port: int, run: bytes, identity: str = "agent/1"
) -> tuple[zmq.Socket, protocol.Codec]:
    """A hello from a process that already learned the run nonce (the challenge that teaches
    it is tested in test_sessions.py, with the coordinator serving in a thread)."""
    codec = protocol.Codec(SECRET, "p2p-job", identity)
    codec.run = run
    s = dealer(ctx, identity.encode(), port)
    s.send_multipart(
        codec.encode(protocol.HELLO, {"role": "agent", "node": 1, "pid": 5, "world_size": 2})
    )
    return s, codec


def _welcomed(sock: zmq.Socket, codec: protocol.Codec, timeout_s: float = 10.0) -> bool:
    """Whether the hello ``codec`` sent on ``sock`` is welcomed (its drain answers the
    coordinator's challenge with the run nonce, as every process's does)."""
    reader = codec
    deadline = time.monotonic() + timeout_s
    while sock.poll(max(0.0, deadline - time.monotonic()) * 1000):
        if any(m.type == protocol.WELCOME for m in reader.drain(sock)):
            return True
    return False


def test_an_oversized_frame_is_refused_before_it_is_buffered(coordinator, ctx):
    big = dealer(ctx, b"rank/0", coordinator.port)
    big.send_multipart([b"", b"x" * (8 * protocol.MAX_FRAME_BYTES)])
    coordinator.serve(stop_after_s=0.5)
    # libzmq closed the connection at the frame header: the coordinator never received it.
    assert coordinator.dropped == 0
    real, real_codec = _hello(ctx, coordinator.port, coordinator.codec.run)
    coordinator.serve(stop_after_s=1.0)
    assert _welcomed(real, real_codec), "the coordinator still serves a real peer"


def test_half_sent_frames_and_raw_garbage_do_not_wedge_the_coordinator(coordinator, ctx):
    raws = []
    for payload in (
        os.urandom(4096),
        # a ZMTP 3 greeting, then a frame header announcing 8 GiB that never comes
        b"\xff"
        + b"\0" * 8
        + b"\x7f\x03\x00NULL"
        + b"\0" * 16
        + b"\0" * 32
        + b"\x06"
        + (8 << 30).to_bytes(8, "big"),
    ):
        raw = socket.create_connection(("127.0.0.1", coordinator.port))
        raw.sendall(payload)
        raws.append(raw)
    try:
        coordinator.serve(stop_after_s=0.5)
        real, real_codec = _hello(ctx, coordinator.port, coordinator.codec.run)
        coordinator.serve(stop_after_s=1.0)
        assert _welcomed(real, real_codec)
    finally:
        for raw in raws:
            raw.close()


def test_a_squatted_identity_never_locks_out_the_real_peer(coordinator, ctx):
    squatter = dealer(ctx, b"agent/1", coordinator.port)
    squatter.send_multipart([b"no", b"secret"])
    coordinator.serve(stop_after_s=0.5)
    assert coordinator.dropped == 1, "the squatter's connection holds agent/1"
    real, real_codec = _hello(ctx, coordinator.port, coordinator.codec.run)
    coordinator.serve(stop_after_s=1.0)
    assert "agent/1" in coordinator.membership.procs
    assert _welcomed(real, real_codec), "the real agent took its identity over and was answered"


def test_a_flood_of_garbage_sockets_leaves_real_peers_served(coordinator, ctx):
    flood = [dealer(ctx, f"rank/{i}".encode(), coordinator.port) for i in range(100)]
    for s in flood:
        for _ in range(20):
            s.send_multipart([os.urandom(32), os.urandom(64)], zmq.NOBLOCK)
    real, real_codec = _hello(ctx, coordinator.port, coordinator.codec.run)
    deadline = time.monotonic() + 30
    while "agent/1" not in coordinator.membership.procs and time.monotonic() < deadline:
        coordinator.serve(stop_after_s=0.5)
    assert coordinator.membership.procs.keys() == {"agent/1"}, "only the real hello changed state"
    assert coordinator.dropped > 0
    assert _welcomed(real, real_codec)


def test_a_ranks_client_survives_hostile_frames(tmp_path, secret_file, ctx):
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    client = ControlClient(
        ClientConfig(
            coordinator=f"127.0.0.1:{port}",
            job_id="p2p-job",
            secret_file=secret_file,
            identity="rank/0/0",
            role="rank",
            node=0,
        ),
        rank=0,
    )
    try:
        assert router.poll(10_000)
        ident = router.recv_multipart()[0]
        coord = protocol.Codec(SECRET, "p2p-job", "coordinator")
        forger = protocol.Codec(b"wrong", "p2p-job", "coordinator")
        rank_like = protocol.Codec(SECRET, "p2p-job", "rank/1/0")
        hostile = [
            [b"x"],
            [os.urandom(32), os.urandom(300)],
            forger.encode(protocol.SHUTDOWN, {"code": 1, "reason": "forged"}),
            rank_like.encode(protocol.SHUTDOWN, {"code": 1, "reason": "not the coordinator"}),
            coord.encode(protocol.WELCOME, {"store_port": "not an int"}),
        ]
        for frames in hostile:
            router.send_multipart([ident, *frames])
        with pytest.raises(protocol.Rejected):
            coord.decode([b"\0" * 32, msgpack.packb({})])  # proof the codec rejects garbage
        router.send_multipart([ident, *coord.encode(protocol.WELCOME, {"store_port": 1234})])
        assert client.store_address(timeout_s=10) == ("127.0.0.1", 1234)
        assert client.inbox.empty(), "no hostile frame reached the rank"
    finally:
        client.close()
        router.close(linger=0)


def _cache(tmp_path, name: str) -> CacheConfig:
    return CacheConfig(directory=str(tmp_path / name), segment_samples=4)


def _build(tmp_path):
    def make():
        def fill(out):
            out[:] = (os.getpid() % 7) + 1

        return "uint8", (16,), 40, fill

    return open_or_build(_cache(tmp_path, "node0"), "fp", make)


def test_the_peer_server_answers_only_signed_in_range_requests(tmp_path, ctx):
    server = SegmentServer(_build(tmp_path), SECRET)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(server.address)
    try:
        hostile = [
            [b"", msgpack.packb({"what": "header"})],  # unsigned (was answered before)
            [b"", *pack_request(b"wrong", {"what": "header"})],
            [b"", *pack_request(SECRET, {"segment": -1})],  # no negative wrap-around
            [b"", *pack_request(SECRET, {"segment": 10})],
            [b"", *pack_request(SECRET, {"segment": True})],
            [b"", *pack_request(SECRET, {"segment": [1]})],
            [b"", os.urandom(16), os.urandom(16)],
            [os.urandom(8)],
        ]
        for frames in hostile:
            dealer.send_multipart(frames)
        assert not dealer.poll(1000), "nothing is sent back to a refused request"
        big = ctx.socket(zmq.DEALER)
        big.setsockopt(zmq.LINGER, 0)
        big.connect(server.address)
        big.send_multipart([b"", b"x" * (47 << 20)])  # refused at the frame header
        big.close(linger=0)
        assert server.dropped == len(hostile)
        dealer.send_multipart([b"", *pack_request(SECRET, {"segment": 9})])
        assert dealer.poll(10_000), "a signed, in-range request is still answered"
        fetched = fetch_cache(_cache(tmp_path, "node1"), server.address, SECRET, "fp")
        assert len(fetched) == 40
    finally:
        dealer.close(linger=0)
        server.close()


def test_idle_connections_are_closed_and_never_starve_a_new_agent(coordinator, ctx):
    idle = [socket.create_connection(("127.0.0.1", coordinator.port)) for _ in range(200)]
    try:
        real, real_codec = _hello(ctx, coordinator.port, coordinator.codec.run)
        coordinator.serve(stop_after_s=1.0)
        assert _welcomed(real, real_codec), "a new agent is served beside 200 idle connections"
        # A connection that never completes its handshake is closed by the coordinator.
        idle[0].settimeout(protocol.HANDSHAKE_MS / 1000 * 6)
        try:
            while idle[0].recv(4096):
                pass  # the coordinator's greeting; then the close
            closed = True
        except ConnectionResetError:
            closed = True
        except TimeoutError:
            closed = False
        assert closed, "an idle half-open connection is closed after HANDSHAKE_MS"
    finally:
        for s in idle:
            s.close()


def test_an_agent_survives_hostile_frames_before_its_welcome(tmp_path, secret_file, ctx):
    import threading

    from launcher.agent import Agent, AgentConfig, AgentError

    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    coord = protocol.Codec(SECRET, "p2p-job", "coordinator")
    sent = []

    def fake_coordinator():
        if not router.poll(20_000):
            return
        ident = router.recv_multipart()[0]
        hostile = [
            [b"x"],
            [os.urandom(32), os.urandom(100)],
            protocol.Codec(b"wrong", "p2p-job", "coordinator").encode(protocol.SHUTDOWN, {}),
            protocol.Codec(SECRET, "p2p-job", "rank/0/0").encode(protocol.SHUTDOWN, {}),
            coord.encode(protocol.SHUTDOWN, {"code": "two", "reason": ["x"]}),
        ]
        for frames in hostile:
            router.send_multipart([ident, *frames])
        router.send_multipart(
            [ident, *coord.encode(protocol.SHUTDOWN, {"code": 2, "reason": "the real answer"})]
        )
        sent.append(len(hostile))

    thread = threading.Thread(target=fake_coordinator, daemon=True)
    thread.start()
    agent = Agent(
        AgentConfig(
            node_rank=0,
            nnodes=1,
            nproc_per_node=1,
            spares=0,
            command=("true",),
            coordinator=f"127.0.0.1:{port}",
            job_id="p2p-job",
            secret_file=secret_file,
            run_dir=str(tmp_path),
            welcome_timeout_s=20,
        )
    )
    with pytest.raises(AgentError, match="the real answer"):
        agent.run()
    thread.join(timeout=10)
    assert sent == [5] and agent.codec.drops.total == 5, "every hostile frame was dropped"
    router.close(linger=0)
