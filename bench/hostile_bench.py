"""``p2p-bench hostile``: the coordinator under hostile and broken peers.

A real coordinator runs in a child process (so its peak RSS is its own) while a legitimate agent
says hello and heartbeats, and the bench throws at it, by kind: random frames, frames signed
with a wrong secret, signed documents with wrong types (a list or map as ``type``), replays of
the agent's own captured frames, a previous run's hello and scale (same secret, another run
nonce), a resize signed with the job secret but not the operator key, oversized frames, a
squatter on a real identity, then a flood of ``--flood-sockets`` sockets each sending
``--flood-frames`` frames plus one oversized frame. Reported: messages tried by kind, crashes,
state changes from unauthenticated input, resizes accepted without the operator key, the
coordinator's peak RSS, whether the legitimate agent was ever taken for lost, whether the
squatted identity's real owner was answered and whether the squatter received anything.
``--json`` prints one object; ``--out-dir`` (default ``reports/hostile-<time>``) gets
report.json and report.md.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import resource
import tempfile
import time
from collections.abc import Callable
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import msgpack
import zmq

from bench.errors import BenchFailed
from bench.flags import count
from bench.report_dir import add_out_dir, finish_with_table
from bench.reports import HostileReport
from launcher import protocol

_JOB = "p2p-job"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``p2p-bench hostile``."""
    p.add_argument("--flood-sockets", type=count(1), default=400, help="sockets in the flood")
    p.add_argument("--flood-frames", type=count(1), default=50, help="garbage frames per socket")
    p.add_argument("--per-kind", type=count(1), default=500, help="messages tried per kind")
    p.add_argument(
        "--oversized-mb", type=count(1), default=256, help="size of each oversized frame (MiB)"
    )
    add_out_dir(p, "hostile")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _vm_hwm_mb() -> float:
    # VmHWM is this process image's peak RSS (ru_maxrss would carry the pre-exec fork's).
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _coordinator(
    run_dir: str,
    secret_file: str,
    port_q: mp.Queue[int],
    result_q: mp.Queue[dict[str, Any]],
    stop_evt: Event,
) -> None:
    from launcher.coordinator import Coordinator, CoordinatorConfig
    from launcher.membership import MembershipConfig

    c = Coordinator(
        CoordinatorConfig(
            secret_file=secret_file,
            run_dir=run_dir,
            host_store=False,
            membership=MembershipConfig(world_size=2, ranks_per_node=1),
        )
    )
    port_q.put(c.port)
    try:
        while not stop_evt.is_set() and c.exit_code is None:
            c.serve(stop_after_s=0.2)
        result_q.put(
            {
                "procs": sorted(c.membership.procs),
                "requested_size": c.membership.requested_size,
                "refused_connections": c.gate.refused,
                "over_quota": c.over_quota,
                "dropped": c.dropped,
                "peak_rss_mb": _vm_hwm_mb(),
                "exit_code": c.exit_code,
            }
        )
    finally:
        c.close()


def _dealer(ctx: zmq.Context[Any], routing: str, port: int) -> zmq.Socket[bytes]:
    s: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, routing.encode())
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 0)
    s.connect(f"tcp://127.0.0.1:{port}")
    return s


def _signed(secret: bytes, doc: dict[str, Any]) -> list[bytes]:
    import hashlib
    import hmac

    payload = msgpack.packb(doc)
    return [hmac.new(secret, payload, hashlib.sha256).digest(), payload]


def _join(sock: zmq.Socket[bytes], codec: protocol.Codec, timeout_s: float = 60.0) -> bool:
    """Read ``sock`` until the coordinator welcomes ``codec``'s hello (its challenge is answered
    on the way: the codec learns the run nonce and says hello again)."""
    deadline = time.monotonic() + timeout_s
    while (left_s := deadline - time.monotonic()) > 0:
        if sock.poll(math.ceil(left_s * 1000)) and any(
            m.type == protocol.WELCOME for m in codec.drain(sock)
        ):
            return True
    return False


def measure(args: argparse.Namespace) -> HostileReport:
    """Run the attack and return the figures."""
    tmp = tempfile.mkdtemp(prefix="p2p-hostile-")
    secret_file = os.path.join(tmp, "secret")
    secret = protocol.write_secret(secret_file)
    mpctx = mp.get_context("spawn")
    port_q, result_q, stop_evt = mpctx.Queue(), mpctx.Queue(), mpctx.Event()
    child = mpctx.Process(
        target=_coordinator, args=(tmp, secret_file, port_q, result_q, stop_evt), daemon=True
    )
    child.start()
    port = port_q.get(timeout=60)
    ctx = zmq.Context()
    tried: dict[str, int] = {}
    squatter = _dealer(ctx, "agent/1", port)  # the real agent/1's predictable name
    squatter.send_multipart([b"squat", b"x"])
    agent = protocol.Codec(secret, _JOB, "agent/0")
    legit = _dealer(ctx, protocol.routing_id("agent/0"), port)
    agent_hello = {"role": "agent", "node": 0, "pid": os.getpid(), "world_size": 2}
    legit.send_multipart(agent.encode(protocol.HELLO, agent_hello))
    if not _join(legit, agent):
        raise BenchFailed("the legitimate agent was never welcomed")
    hello = agent.encode(protocol.HELLO, agent_hello)  # captured, with this run's nonce
    beats = [agent.encode(protocol.HEARTBEAT, {})]
    legit.send_multipart(hello)
    legit.send_multipart(beats[0])
    attacker = _dealer(ctx, "rank/0/0", port)
    other_run = protocol.Codec(secret, _JOB, "rank/0/0")
    other_run.run = os.urandom(protocol.RUN_NONCE_BYTES)  # a previous run reusing the secret
    operator = _dealer(ctx, protocol.routing_id("operator/1"), port)
    no_key = protocol.Codec(secret, _JOB, "operator/1")  # the job secret, not the operator key
    no_key.run = agent.run
    wrong = os.urandom(32)
    big = b"\0" * (args.oversized_mb << 20)
    replayed: list[tuple[str, dict[str, Any]]] = [
        (protocol.HELLO, {"role": "rank", "node": 0, "pid": 1, "rank": 0}),
        (protocol.SCALE, {"size": 1}),
    ]
    kinds: dict[str, Callable[[int], list[bytes]]] = {
        "random frames": lambda i: [os.urandom(32), os.urandom(i % 300)],
        "wrong secret": lambda i: _signed(wrong, {"v": 2, "type": "scale", "body": {"size": 1}}),
        "list or map type": lambda i: _signed(
            secret,
            {"v": 2, "job": _JOB, "type": [["hello"], {"a": 1}][i % 2], "sender": "rank/0/0"},
        ),
        "wrong field types": lambda i: _signed(
            secret,
            {"v": 2, "job": _JOB, "type": "hello", "sender": "rank/0/0", "gen": "0", "seq": i},
        ),
        "a previous run's hello and scale": lambda i: other_run.encode(*replayed[i % 2]),
    }
    for kind, make in kinds.items():
        for i in range(args.per_kind):
            attacker.send_multipart(make(i), zmq.NOBLOCK)
        tried[kind] = args.per_kind
    for _ in range(args.per_kind):
        operator.send_multipart(no_key.encode(protocol.SCALE, {"size": 1}), zmq.NOBLOCK)
    tried["scale without the operator key"] = args.per_kind
    for _ in range(args.per_kind):
        legit.send_multipart(hello)  # replays of the agent's own captured frames
        legit.send_multipart(beats[0])
    tried["replays"] = 2 * args.per_kind
    flood = [_dealer(ctx, f"rank/{i}/0", port) for i in range(args.flood_sockets)]
    real_squatted = protocol.Codec(secret, _JOB, "agent/1")
    real = _dealer(ctx, protocol.routing_id("agent/1"), port)
    real.send_multipart(
        real_squatted.encode(
            protocol.HELLO, {"role": "agent", "node": 1, "pid": os.getpid(), "world_size": 2}
        )
    )
    t0 = time.monotonic()
    for s in flood:
        s.send_multipart([b"\0" * 32, big], copy=False)  # refused at the frame header
        for _ in range(args.flood_frames):
            s.send_multipart([os.urandom(32), os.urandom(64)])
    tried["flood frames"] = args.flood_sockets * args.flood_frames
    tried["oversized frames"] = args.flood_sockets
    # The legitimate agent keeps beating through the flood; the real agent/1 answers the
    # coordinator's challenge (its drain) and is welcomed.
    real_answered = False
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        legit.send_multipart(agent.encode(protocol.HEARTBEAT, {}))
        if real.poll(200):
            real_answered |= any(m.type == protocol.WELCOME for m in real_squatted.drain(real))
        if real_answered and time.monotonic() - t0 > 3:
            break
    squatter_received = 0
    while squatter.poll(0):
        squatter.recv_multipart()
        squatter_received += 1
    flood_s = time.monotonic() - t0
    stop_evt.set()
    result = result_q.get(timeout=60)
    child.join(timeout=30)
    for s in [squatter, legit, attacker, operator, real, *flood]:
        s.close(linger=0)
    ctx.term()
    from launcher.events import read_events

    events = read_events(tmp)
    lost = [
        e for e in events if e.get("identity") in ("agent/0", "agent/1") and "lost" in e["event"]
    ]
    return HostileReport(
        tried_by_kind=tried,
        tried_total=sum(tried.values()),
        crashes=0 if child.exitcode == 0 and result["exit_code"] is None else 1,
        state_changes_from_unauthenticated=len(set(result["procs"]) - {"agent/0", "agent/1"}),
        resizes_without_operator_key=int(result["requested_size"] is not None),
        members=result["procs"],
        dropped=result["dropped"],
        peak_coordinator_rss_mb=round(result["peak_rss_mb"], 1),
        flood_sockets=args.flood_sockets,
        flood_s=round(flood_s, 2),
        legit_lost_events=len(lost),
        squatted_identity_answered=real_answered,
        squatter_messages_received=squatter_received,
        refused_connections=result["refused_connections"],
        over_quota=result["over_quota"],
    )


def run(args: argparse.Namespace) -> int:
    """Entry point of ``p2p-bench hostile``."""
    r = measure(args)
    md = "\n".join(
        [
            "| kind | messages tried |",
            "|---|---:|",
            *(f"| {k} | {v:,} |" for k, v in r.tried_by_kind.items()),
            "",
            f"crashes: {r.crashes}; state changes from unauthenticated input: "
            f"{r.state_changes_from_unauthenticated}; peak coordinator RSS under a "
            f"{r.flood_sockets}-socket flood: {r.peak_coordinator_rss_mb} MB; legitimate "
            f"agent taken for lost: {r.legit_lost_events}; squatted identity's owner "
            f"answered: {r.squatted_identity_answered}; messages the squatter received: "
            f"{r.squatter_messages_received}; resizes without the operator key: "
            f"{r.resizes_without_operator_key}",
        ]
    )
    finish_with_table(args, r.to_json(), md, markdown=True)
    return 0 if r.passed else 1
