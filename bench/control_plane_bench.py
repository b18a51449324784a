"""``p2p-bench control-plane``: a real coordinator against thousands of emulated ranks.

The coordinator is the real one (its own process, real ROUTER socket, HMAC on every message).
Ranks, spares and node agents are emulated: each is a real DEALER socket with its own identity,
codec and heartbeat schedule, many of them multiplexed over a few worker processes so 2,048 fit
on a 2-core machine. Measured, per size, in one run:

- coordinator CPU share at the configured heartbeat interval (steady state, after the first
  generation);
- ``detect_ms``: a real child process is SIGKILLed; its emulated agent sees the exit through a
  pidfd and reports it; the time runs from the kill to the coordinator's fault decision (both
  clocks are CLOCK_MONOTONIC on one machine);
- ``generation_ms``: from that decision until every rank acknowledged the new generation;
- ``hang_detect_s``: a rank stops heartbeating; from its last heartbeat to the decision, next to
  the configured timeout;
- the takeover (unless ``--no-takeover``), last: a standby coordinator (the real one, its own
  process, ``--standby-of``) starts next to the active one, which mirrors the membership to it
  and tells every member where it is. Every emulated member then keeps a second socket, to the
  standby, through the real :class:`launcher.link.CoordinatorLinks` (the term rule included);
  the emulated agents answer the standby's vote as real agents do. Once every member is
  connected to it (counted in ``/proc/net/tcp``), the active coordinator is SIGKILLed.
  ``takeover_ms`` runs, per member (``takeover_members`` of them, all of which must switch
  within a deadline), from the kill until it adopted the standby and sent it a heartbeat;
  ``election_ms`` from the kill to the standby's ``takeover`` event. Both include the silence
  the standby waits for before it asks for votes (``--takeover-timeout``, 1 s by default).
  Afterwards, for one heartbeat timeout, the standby must stay up, every member must obey it,
  every agent must hear its heartbeats, and a member it loses counts as an unexpected fault.

The standby starts after the other trials, so the figures above them are taken as before, with
no standby to mirror to.

The emulated ranks do not train, so the trials are, to the coordinator, recoveries in a row that
never get the training past a step: the bench gives it a ``--max-restarts`` budget that covers
every trial (a real job keeps its default). Emulating the ranks' per-step ``replicated`` reports
instead would load the coordinator with work that is not being measured. ``unexpected_faults``
counts the members either coordinator took for lost without the bench having stopped them.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.errors import BenchFailed, UsageError
from bench.flags import count, heartbeats, positive
from bench.report_dir import add_out_dir, command_line, finish_with_table
from bench.reports import ControlPlaneReport, ControlPlaneSize, Takeover

if TYPE_CHECKING:
    from launcher.coordinator import CoordinatorConfig

RANKS_PER_NODE = 8


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``p2p-bench control-plane``."""
    p.add_argument(
        "--ranks",
        type=int,
        nargs="+",
        default=[256, 1024, 2048],
        help="job sizes to measure (default 256 1024 2048)",
    )
    p.add_argument("--workers", type=count(1), default=4, help="processes hosting emulated ranks")
    p.add_argument("--heartbeat-interval", type=positive, default=0.5, help="seconds (default 0.5)")
    p.add_argument("--heartbeat-timeout", type=positive, default=3.0, help="seconds (default 3)")
    p.add_argument("--exits", type=count(0), default=10, help="process-exit trials per size")
    p.add_argument("--hangs", type=count(0), default=2, help="missed-heartbeat trials per size")
    p.add_argument("--cpu-window", type=positive, default=5.0, help="seconds of steady state")
    p.add_argument(
        "--takeover-timeout",
        type=positive,
        default=1.0,
        help="the standby coordinator's silence limit before it asks for votes (default 1)",
    )
    p.add_argument("--no-takeover", action="store_true", help="no standby coordinator, no takeover")
    add_out_dir(p, "control-plane")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


def _emulate(conn: Any, spec: dict[str, Any]) -> None:
    """A worker process: many emulated members, one poll loop.

    Each member keeps the links a real one keeps (:class:`launcher.link.CoordinatorLinks`):
    one socket to the active coordinator, one more to each standby it learns of, the term rule
    on everything received. An agent answers a standby's vote as a real agent does; every
    member that learns of a takeover heartbeats the new coordinator at once and records when.
    """
    import zmq

    from launcher import protocol
    from launcher.agent import decide_vote
    from launcher.client import HELLO_RETRY_S
    from launcher.link import CoordinatorLinks

    # Each member's switch is recorded here; thousands of "now obeys" lines would say no more.
    logging.getLogger("launcher.link").setLevel(logging.ERROR)
    secret = protocol.read_secret(spec["secret_file"])
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 16384)
    members: dict[str, dict[str, Any]] = {}
    by_sock: dict[zmq.Socket[bytes], dict[str, Any]] = {}
    poller = zmq.Poller()
    interval = spec["interval"]
    beats = 0

    def watch(m: dict[str, Any], s: zmq.Socket[bytes]) -> None:
        s.setsockopt(zmq.LINGER, 0)
        by_sock[s] = m
        poller.register(s, zmq.POLLIN)

    def connect_standbys(m: dict[str, Any], addresses: Any) -> None:
        for address in addresses[:8] if isinstance(addresses, list) else []:
            if isinstance(address, str) and (s := m["links"].add(address)) is not None:
                watch(m, s)

    def add(identity: str, role: str, node: int, rank: int | None, phase: float) -> None:
        links = CoordinatorLinks(
            ctx, identity, protocol.Codec(secret, spec["job_id"], identity), [spec["address"]]
        )
        m = {
            "id": identity,
            "role": role,
            "node": node,
            "links": links,
            "next": time.monotonic() + phase * interval,
            "silent": False,
            "last": 0.0,
            "heard": time.monotonic(),  # the last message from the active coordinator
            "voted_for": None,
            "generation": 0,  # the newest generation the active coordinator sent
            "switched": None,  # when it heartbeat a coordinator that took over
            "beat": {},  # an agent echoes the active coordinator's last heartbeat, as a real one
            "told": False,
            # As a real client: a hello goes again until a welcome answers it (a hello or its
            # challenge lost in a flood of thousands would otherwise keep it out for good).
            "hello": {"role": role, "node": node, "pid": os.getpid()},
            "next_hello": time.monotonic() + HELLO_RETRY_S,
            "welcomed": False,
        }
        for s in links.sockets.values():
            watch(m, s)
        if rank is not None:
            m["hello"]["rank"] = rank
        links.send(protocol.HELLO, m["hello"])
        members[identity] = m

    def remove(m: dict[str, Any]) -> None:
        for s in m["links"].sockets.values():
            poller.unregister(s)
            del by_sock[s]
            s.close(linger=0)
        m["links"].sockets.clear()
        del members[m["id"]]

    def vote(m: dict[str, Any], sock: zmq.Socket[bytes], msg: Any) -> None:
        # As launcher.agent.Agent._vote: yes only when this node lost the active one too.
        links = m["links"]
        address = links.address_of(sock)
        granted, binding = decide_vote(
            msg,
            term=links.term,
            silent_s=time.monotonic() - m["heard"],
            generation=m["generation"],
            voted_for=m["voted_for"],
        )
        granted = granted and address is not None
        if granted and binding:
            m["voted_for"] = (msg.term, msg.sender)
            links.adopt(msg.term, None)
        if address is not None:
            body = {"granted": granted, **({"pre": True} if msg.body.get("pre") else {})}
            links.send_to(address, protocol.VOTED, body)

    todo = spec["members"]
    for i, (identity, role, node, rank) in enumerate(todo):
        add(identity, role, node, rank, i / max(1, len(todo)))
    poller.register(conn.fileno(), zmq.POLLIN)
    spares_made = 0
    while True:
        now = time.monotonic()
        due = min((m["next"] for m in members.values() if not m["silent"]), default=now + 1)
        for item, _ in poller.poll(math.ceil(max(0.0, due - now) * 1000)):
            if item == conn.fileno():
                cmd = conn.recv()
                if cmd[0] == "stop":
                    for m in list(members.values()):
                        remove(m)
                    ctx.term()
                    return
                if cmd[0] == "count":
                    conn.send(beats)
                if cmd[0] == "members":
                    conn.send(
                        [
                            {
                                "id": m["id"],
                                "role": m["role"],
                                "silent": m["silent"],
                                "links": len(m["links"].sockets),
                                "active": m["links"].active,
                                "switched": m["switched"],
                                "told": m["told"],
                                "heard": m["heard"],
                            }
                            for m in members.values()
                        ]
                    )
                if cmd[0] == "hang":
                    m = members[cmd[1]]
                    m["silent"] = True
                    conn.send(m["last"])
                if cmd[0] == "exit":
                    victim, agent = members[cmd[1]], members[cmd[2]]
                    child = subprocess.Popen(["sleep", "600"])
                    pidfd = os.pidfd_open(child.pid)
                    victim["silent"] = True
                    t0 = time.monotonic()
                    child.kill()
                    waiter = select.poll()  # select() cannot take fds above 1024
                    waiter.register(pidfd, select.POLLIN)
                    waiter.poll(10_000)
                    code = child.wait()
                    os.close(pidfd)
                    agent["links"].send(
                        protocol.EXITED,
                        {"identity": victim["id"], "pid": child.pid, "code": code, "role": "rank"},
                    )
                    remove(victim)
                    conn.send(t0)
                continue
            owner = by_sock.get(item)
            if owner is None:
                continue  # a member removed while this batch of events was pending
            m = owner
            links = m["links"]
            received = links.receive(item)
            if received.takeover and m["switched"] is None:
                m["beat"] = {}  # the last one was the replaced coordinator's
                links.send(protocol.HEARTBEAT)
                beats += 1
                m["switched"] = m["last"] = time.monotonic()
                # The takeover message itself, or a later one of the new term (it was lost).
                m["told"] = any(msg.type == protocol.TAKEOVER for msg in received.messages)
            for msg in received.messages:
                if msg.type == protocol.VOTE:
                    if m["role"] == "agent":
                        vote(m, item, msg)
                    continue
                m["heard"] = time.monotonic()
                m["generation"] = max(m["generation"], msg.generation)
                if msg.type == protocol.HEARTBEAT and "beat" in msg.body:
                    m["beat"] = {"beat": msg.body["beat"]}
                elif msg.type == protocol.GENERATION:
                    # A rank that forms the generation at once acknowledges it and says nothing
                    # else (``arrived`` goes only where forming takes a while).
                    links.send(protocol.ACK, {"generation": msg.body["generation"]}, msg.generation)
                elif msg.type == protocol.SPAWN_SPARE:
                    spares_made += 1
                    add(f"spare/{m['node']}/x{spares_made}", "spare", m["node"], None, 0)
                elif msg.type == protocol.STANDBYS:
                    connect_standbys(m, msg.body["addresses"])
                elif msg.type == protocol.WELCOME:
                    m["welcomed"] = True
                    connect_standbys(m, msg.body.get("standbys", []))
        now = time.monotonic()
        for m in members.values():
            if not m["welcomed"] and not m["silent"] and m["next_hello"] <= now:
                m["links"].send(protocol.HELLO, m["hello"])
                m["next_hello"] = now + HELLO_RETRY_S
            if not m["silent"] and m["next"] <= now:
                m["links"].send(protocol.HEARTBEAT, m["beat"])
                beats += 1
                m["last"] = now
                m["next"] = now + interval


def process_cpu_s(pid: int) -> float:
    """CPU seconds process ``pid`` used so far (user and system, from ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _established(port: int) -> int:
    """TCP connections up on ``127.0.0.1:port``, counted on its listening side."""
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "01":  # ESTABLISHED
            count += 1
    return count


def _takeover(
    args: argparse.Namespace,
    run_dir: str,
    coord: subprocess.Popen[bytes],
    standby: subprocess.Popen[bytes],
    conns: list[Any],
    events: Callable[..., list[dict[str, Any]]],
    wait: Callable[..., dict[str, Any]],
) -> Takeover:
    """SIGKILL the active coordinator; per member, the time until it heartbeat the standby."""
    info = Path(run_dir) / "coordinator-1.json"
    end = time.monotonic() + 60
    while not info.exists():
        if time.monotonic() > end or standby.poll() is not None:
            raise BenchFailed("the standby coordinator did not start")
        time.sleep(0.05)
    address = json.loads(info.read_text())["address"]
    wait("standby_joined", identity="coordinator/1")

    def members() -> list[dict[str, Any]]:
        for c in conns:
            c.send(("members",))
        return [m for c in conns for m in c.recv()]

    # The members the active coordinator has: not the ones the bench stopped or hung, nor any
    # it took for lost on its own (those are counted as unexpected faults). Each must have
    # learnt of the standby and be connected to it before the kill.
    end = time.monotonic() + 60
    while True:
        lost = {e["identity"] for e in events("fault")}
        live = [m for m in members() if not m["silent"] and m["id"] not in lost]
        linked = sum(1 for m in live if m["links"] == 2)
        connected = _established(int(address.rsplit(":", 1)[1]))
        if linked == len(live) and connected >= len(live):
            break
        if time.monotonic() > end:
            raise BenchFailed(
                f"of {len(live)} members, {linked} learnt of the standby coordinator and "
                f"{connected} connected to it within 60s"
            )
        time.sleep(0.1)
    ids = {m["id"] for m in live}

    killed_at = time.monotonic()
    coord.kill()
    coord.wait()
    limit = max(60.0, 20 * args.takeover_timeout)
    while True:
        now = {m["id"]: m for m in members() if m["id"] in ids}
        late = sorted(i for i in ids if now.get(i, {}).get("switched") is None)
        if not late:
            break
        if time.monotonic() > killed_at + limit:
            raise BenchFailed(
                f"{len(late)} of {len(ids)} members did not switch to the standby coordinator "
                f"within {limit:.0f}s of the active one's kill (first: {', '.join(late[:3])})"
            )
        time.sleep(0.2)
    took = wait("takeover", timeout=limit, source="coordinator/1")
    switched = [(m["switched"] - killed_at) * 1e3 for m in now.values()]

    # The standby is the coordinator now: it stays up, heartbeats every agent and hears every
    # member (one that it did not would be a fault within a heartbeat timeout: counted).
    time.sleep(args.heartbeat_timeout)  # the observation window itself
    if standby.poll() is not None:
        raise BenchFailed(f"the standby coordinator exited (code {standby.returncode})")
    after = [m for m in members() if m["id"] in ids]
    elsewhere = [m["id"] for m in after if m["active"] != address]
    unheard = [m["id"] for m in after if m["role"] == "agent" and m["heard"] <= m["switched"]]
    if elsewhere or unheard:
        raise BenchFailed(
            f"after the takeover {len(elsewhere)} members obey another coordinator than "
            f"{address} and {len(unheard)} agents heard nothing from it"
        )
    return Takeover(
        takeover_ms_p50=_pct(switched, 50),
        takeover_ms_p99=_pct(switched, 99),
        takeover_timeout_s=args.takeover_timeout,
        takeover_members=len(switched),
        takeover_votes=len(took["votes"]),
        # Members that switched on a later message of the new term: the takeover message
        # itself did not reach them (should be 0).
        takeover_not_told=sum(1 for m in now.values() if not m["told"]),
        election_ms=(took["t"] - killed_at) * 1e3,
    )


def _start_coordinator(settings: CoordinatorConfig) -> subprocess.Popen[bytes]:
    """The real coordinator process, given its configuration as p2p-run gives it."""
    from launcher.config import dump, write_private
    from launcher.coordinator import config_file
    from launcher.lifetime import die_with_parent

    path = config_file(settings.run_dir, settings.node)
    write_private(path, dump(settings))
    command = [sys.executable, "-m", "launcher.coordinator", "--config", str(path)]
    return subprocess.Popen(command, preexec_fn=die_with_parent())


def _measure_size(n: int, args: argparse.Namespace) -> ControlPlaneSize:
    import multiprocessing

    from launcher import protocol
    from launcher.coordinator import CoordinatorConfig
    from launcher.events import EventTail
    from launcher.membership import MembershipConfig

    nodes = n // RANKS_PER_NODE
    with tempfile.TemporaryDirectory(prefix="p2p-cp-bench-") as tmp:
        secret = os.path.join(tmp, "secret")
        protocol.write_secret(secret)
        settings = CoordinatorConfig(
            secret_file=secret,
            run_dir=tmp,
            host_store=False,
            membership=MembershipConfig(
                world_size=n,
                ranks_per_node=RANKS_PER_NODE,
                heartbeat_timeout_s=args.heartbeat_timeout,
                spare_wait_s=600,
                ack_timeout_s=60,
                max_restarts=args.exits + args.hangs + 1,
            ),
        )
        coord = _start_coordinator(settings)
        standby: subprocess.Popen[bytes] | None = None
        procs, conns = [], []
        try:
            info_path = Path(tmp) / "coordinator.json"
            deadline = time.monotonic() + 60
            while not info_path.exists():
                if time.monotonic() > deadline or coord.poll() is not None:
                    raise BenchFailed("the coordinator did not start")
                time.sleep(0.05)
            port = json.loads(info_path.read_text())["port"]
            ctx = multiprocessing.get_context("spawn")
            spares = args.exits + 1
            for w in range(args.workers):
                members: list[tuple[str, str, int, int | None]] = []
                for node in range(w, nodes, args.workers):
                    members.append((f"agent/{node}", "agent", node, None))
                    for local in range(RANKS_PER_NODE):
                        r = node * RANKS_PER_NODE + local
                        members.append((f"rank/{r}", "rank", node, r))
                for s in range(w, spares, args.workers):
                    members.append((f"spare/{s % nodes}/{s}", "spare", s % nodes, None))
                parent, child = ctx.Pipe()
                p = ctx.Process(
                    target=_emulate,
                    args=(
                        child,
                        {
                            "members": members,
                            "address": f"127.0.0.1:{port}",
                            "secret_file": secret,
                            "job_id": "p2p-job",
                            "interval": args.heartbeat_interval,
                        },
                    ),
                    daemon=True,
                )
                p.start()
                procs.append(p)
                conns.append(parent)

            log = EventTail(tmp)

            def events(name: str, **match: Any) -> list[dict[str, Any]]:
                return [
                    e
                    for e in log.read()
                    if e["event"] == name and all(e.get(k) == v for k, v in match.items())
                ]

            def wait(name: str, timeout: float = 120, **match: Any) -> dict[str, Any]:
                end = time.monotonic() + timeout
                while time.monotonic() < end:
                    found = events(name, **match)
                    if found:
                        return found[0]
                    time.sleep(0.02)
                joined = len(events("rank_joined"))
                raise BenchFailed(
                    f"no {name} {match} within {timeout:.0f}s ({joined} of {n} ranks joined)"
                )

            # Every member says hello at once: the first generation waits for the last of them.
            wait("generation_complete", timeout=120 * max(1.0, n / 2048), generation=1)

            def beats() -> int:
                for c in conns:
                    c.send(("count",))
                return sum(c.recv() for c in conns)

            b0, c0, t0 = beats(), process_cpu_s(coord.pid), time.monotonic()
            time.sleep(args.cpu_window)  # the measurement window itself
            window = time.monotonic() - t0
            cpu_share = (process_cpu_s(coord.pid) - c0) / window
            beat_rate = (beats() - b0) / window

            detect, generation, hang = [], [], []
            gen = 1
            for trial in range(args.exits):
                node = (trial * 7 + 1) % nodes
                rank = node * RANKS_PER_NODE + trial % RANKS_PER_NODE
                conns[node % args.workers].send(("exit", f"rank/{rank}", f"agent/{node}"))
                killed_at = conns[node % args.workers].recv()
                fault = wait("fault", identity=f"rank/{rank}")
                # The generation that replaces it (a member of the emulation missing its
                # heartbeats on a loaded machine would start one of its own: counted below).
                end = time.monotonic() + 120
                while True:
                    after = [
                        e
                        for e in events("generation_started")
                        if e["generation"] > gen and e["t"] >= fault["t"]
                    ]
                    if after:
                        break
                    if time.monotonic() > end:
                        raise BenchFailed(f"no generation after the fault of rank {rank}")
                    time.sleep(0.02)
                started = after[0]
                gen = started["generation"]
                done = wait("generation_complete", generation=gen)
                detect.append((fault["t"] - killed_at) * 1e3)
                generation.append((done["t"] - started["t"]) * 1e3)
            for trial in range(args.hangs):
                node = (trial * 5 + 3) % nodes
                rank = node * RANKS_PER_NODE + (trial + 4) % RANKS_PER_NODE
                conns[node % args.workers].send(("hang", f"rank/{rank}"))
                last_beat = conns[node % args.workers].recv()
                fault = wait("fault", timeout=args.heartbeat_timeout * 10, identity=f"rank/{rank}")
                hang.append(fault["t"] - last_beat)
            takeover: Takeover | None = None
            if not args.no_takeover:
                standby = _start_coordinator(
                    replace(
                        settings,
                        standby_of=f"127.0.0.1:{port}",
                        node="1",
                        advertise="127.0.0.1",
                        takeover_timeout_s=args.takeover_timeout,
                    )
                )
                takeover = _takeover(args, tmp, coord, standby, conns, events, wait)
            # Faults of members the bench did not stop, before the takeover or after it, decided
            # by either coordinator (should be 0; else the machine was too loaded for the
            # emulation to keep its heartbeats) ...
            unexpected = len(events("fault")) - args.exits - len(hang)
            if takeover is not None:
                # ... of which the standby decided after it took over (none is expected then).
                takeover.unexpected_faults = len(events("fault", source="coordinator/1"))
            return ControlPlaneSize(
                ranks=n,
                coordinator_cpu_share=cpu_share,
                heartbeats_per_s=beat_rate,
                heartbeats_per_s_configured=(n + nodes) / args.heartbeat_interval,
                detect_ms_p50=_pct(detect, 50),
                detect_ms_p99=_pct(detect, 99),
                generation_ms_p50=_pct(generation, 50),
                generation_ms_p99=_pct(generation, 99),
                hang_detect_s_p50=_pct(hang, 50),
                hang_detect_s_max=max(hang) if hang else float("nan"),
                heartbeat_timeout_s=args.heartbeat_timeout,
                exit_trials=len(detect),
                unexpected_faults=unexpected,
                takeover=takeover,
            )
        finally:
            for c in conns:
                try:
                    c.send(("stop",))
                except (BrokenPipeError, OSError):
                    pass
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
            for proc in (coord, standby):
                if proc is not None:
                    proc.kill()
                    proc.wait()


def run(args: argparse.Namespace) -> int:
    """Entry point of ``p2p-bench control-plane``."""
    for n in args.ranks:
        if n < RANKS_PER_NODE * 2 or n % RANKS_PER_NODE:
            raise UsageError(
                f"--ranks {n}: use a multiple of {RANKS_PER_NODE} of at least {2 * RANKS_PER_NODE}"
            )
    heartbeats(args.heartbeat_interval, args.heartbeat_timeout)
    sizes = [_measure_size(n, args) for n in args.ranks]
    report = ControlPlaneReport(
        heartbeat_interval_s=args.heartbeat_interval,
        heartbeat_timeout_s=args.heartbeat_timeout,
        takeover_timeout_s=None if args.no_takeover else args.takeover_timeout,
        sizes=sizes,
        command=command_line(args),
    )
    finish_with_table(args, report.to_json(), _table(report, args))
    return 0


def _table(report: ControlPlaneReport, args: argparse.Namespace) -> str:
    lines = [
        f"heartbeat every {args.heartbeat_interval}s, timeout {args.heartbeat_timeout}s"
        + ("" if args.no_takeover else f", takeover after {args.takeover_timeout}s of silence")
    ]
    header = (
        "ranks",
        "coord CPU",
        "beats/s (configured)",
        "exit detect ms p50/p99",
        "generation ms p50/p99",
        "hang detect s",
        "takeover ms p50/p99",
    )
    lines.append("  ".join(f"{h:>22}" for h in header))
    for s in report.sizes:
        took = s.takeover
        cells = (
            f"{s.ranks}",
            f"{s.coordinator_cpu_share * 100:.1f} %",
            f"{s.heartbeats_per_s:.0f} ({s.heartbeats_per_s_configured:.0f})",
            f"{s.detect_ms_p50:.1f} / {s.detect_ms_p99:.1f}",
            f"{s.generation_ms_p50:.1f} / {s.generation_ms_p99:.1f}",
            f"{s.hang_detect_s_p50:.2f}",
            f"{took.takeover_ms_p50:.0f} / {took.takeover_ms_p99:.0f}" if took else "-",
        )
        lines.append("  ".join(f"{c:>22}" for c in cells))
    return "\n".join(lines)
