"""``p2p-bench rendezvous``: what forming one gloo group costs the job's rendezvous store.

A gloo group forms by every member writing its address to the store and reading every other
member's (gloo's ``createAndConnectAllPairs``): N^2 reads per group, all answered by the one
thread of the coordinator's store. Two ways, measured in one run at each size:

- torch's default: each address is one ``wait`` and one ``get`` (two requests), and each address
  carries one pair number per member, so a group moves N^3 bytes;
- the engine's (:data:`recovery.comms.GLOO_ENVIRONMENT`, set for every group it makes): a member
  reads the addresses with one ``multi_get`` per 128 members, and an address is the same few
  hundred bytes at any size;
- the engine's from 512 ranks, or with ``p2p-run --lazy-gloo`` (:mod:`recovery.gloo_pairs`): a
  member reads only the addresses of the pairs it connects while the group forms, its two ring
  neighbours (:data:`bench.scale_model.LAZY_PAIRS`), each with gloo's ``wait`` and ``get``;
  pairs first used later read theirs then, outside the rendezvous.

The store is the real one (:class:`launcher.store.StoreServer` in a process of its own, an HMAC
on every frame), the members are emulated: ``--clients`` processes of real
:class:`launcher.store_client.SignedStore` clients issue exactly gloo's requests for addresses of
exactly gloo's size (:func:`address_bytes`; the test suite checks both against real gloo groups).
Every member writes its address; then members' reads are replayed until ``--min-requests``
requests were served (fewer members than the group has, or some more than once), and the
group's figures are scaled to its N members: the store thread's work is the same for every
member, so its CPU time grows with the members that read. ``store_cpu_s`` is the store
process's CPU time (what bounds the store at scale, where thousands of clients keep it busy);
``wall_s`` is the replay's elapsed time with ``--clients`` clients on this host, scaled the
same way. Members arriving at different times,
whose reads poll for addresses not written yet, are not modelled.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import platform
import socket
import time
from concurrent.futures import ProcessPoolExecutor
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

from bench.bench_reports import HostInfo, RendezvousPattern, RendezvousReport, RendezvousSize
from bench.control_plane_bench import process_cpu_s
from bench.flags import count
from bench.report_dir import add_out_dir, command_line, finish_with_table
from bench.scale_model import GLOO_BATCH, LAZY_PAIRS

#: Bytes of a gloo TCP address: a ``sockaddr_storage`` and a sequence number.
GLOO_SOCKADDR_BYTES = 136
_JOB = "rendezvous-bench"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``p2p-bench rendezvous``."""
    p.add_argument(
        "--ranks",
        type=count(2),
        nargs="+",
        default=[256, 512, 1024, 2048],
        help="members of the group (default 256 512 1024 2048)",
    )
    p.add_argument("--clients", type=count(1), default=4, help="client processes (default 4)")
    p.add_argument(
        "--min-requests",
        type=count(1),
        default=20_000,
        help="requests replayed per size and way, at least (default 20,000)",
    )
    add_out_dir(p, "rendezvous")
    p.add_argument("--json", action="store_true", help="print one JSON object")


#: The three ways, by name: the address carries pair numbers (torch's default only), the reads.
WAYS = ("default", "engine", "lazy")


def address_bytes(members: int, *, engine: bool) -> int:
    """The size of one member's address as gloo writes it: its host name, its socket address
    and, unless the rank is the sequence number, one pair number per member."""
    host = len(socket.gethostname().encode())
    return 8 + host + 8 + GLOO_SOCKADDR_BYTES + (0 if engine else 8 * members)


def reads_per_member(members: int, way: str) -> int:
    """Requests one member makes to read the addresses it needs (once they are all written)."""
    if way == "lazy":
        return 2 * LAZY_PAIRS
    return math.ceil(members / GLOO_BATCH) if way == "engine" else 2 * members


def _needed(member: int, members: int, way: str) -> list[int]:
    """The members whose addresses ``member`` reads."""
    if way == "lazy":
        return [(member + d) % members for d in (-1, 1)][:LAZY_PAIRS]
    return list(range(members))


def _serve(secret: bytes, conn: Connection) -> None:
    """The store's process: serve until the bench says stop."""
    from launcher.store import StoreServer

    with StoreServer(secret, _JOB, "127.0.0.1") as server:
        conn.send(server.port)
        conn.recv()


def _read(
    port: int, secret: bytes, prefix: str, members: int, way: str, first: int, times: int
) -> None:
    """Replay the reads of ``times`` members from ``first`` on (one client, one request at a
    time)."""
    from launcher.store_client import SignedStore

    store = SignedStore("127.0.0.1", port, secret, _JOB, timedelta(seconds=120))
    try:
        for member in range(first, first + times):
            keys = [f"{prefix}{i}" for i in _needed(member % members, members, way)]
            if way == "engine":
                for start in range(0, members, GLOO_BATCH):
                    store.multi_get(keys[start : start + GLOO_BATCH])
            else:
                for key in keys:  # gloo's wait_get: a wait, then a get
                    store.wait([key])
                    store.get(key)
    finally:
        store.close()


def _measure(
    pool: ProcessPoolExecutor,
    port: int,
    pid: int,
    secret: bytes,
    members: int,
    way: str,
    args: argparse.Namespace,
) -> RendezvousPattern:
    from launcher.store_client import SignedStore

    prefix = f"{way}{members}/"
    size = address_bytes(members, engine=way != "default")
    per_member = reads_per_member(members, way)
    writer = SignedStore("127.0.0.1", port, secret, _JOB, timedelta(seconds=120))
    cpu0, t0 = process_cpu_s(pid), time.perf_counter()
    try:
        for i in range(members):
            writer.set(f"{prefix}{i}", os.urandom(size))
    finally:
        writer.close()
    cpu1, t1 = process_cpu_s(pid), time.perf_counter()
    replayed = max(args.clients, math.ceil(args.min_requests / per_member))
    shares = [replayed // args.clients + (c < replayed % args.clients) for c in range(args.clients)]
    firsts = [sum(shares[:c]) for c in range(args.clients)]
    jobs = [
        pool.submit(_read, port, secret, prefix, members, way, first, n)
        for first, n in zip(firsts, shares, strict=True)
        if n > 0
    ]
    for job in jobs:
        job.result()
    cpu2, t2 = process_cpu_s(pid), time.perf_counter()
    scale = members / replayed
    return RendezvousPattern(
        address_bytes=size,
        requests=members * (1 + per_member),
        reply_mb=members * len(_needed(0, members, way)) * size / 1e6,
        store_cpu_s=(cpu1 - cpu0) + (cpu2 - cpu1) * scale,
        wall_s=(t1 - t0) + (t2 - t1) * scale,
        replayed_members=replayed,
    )


def measure(args: argparse.Namespace) -> RendezvousReport:
    """Run the benchmark; returns its report."""
    import torch

    secret = os.urandom(32)
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    server = ctx.Process(target=_serve, args=(secret, theirs), daemon=True)
    server.start()
    try:
        if not ours.poll(60):
            raise RuntimeError("the rendezvous store did not start within 60 s")
        port = ours.recv()
        assert server.pid is not None
        sizes = []
        with ProcessPoolExecutor(args.clients, mp_context=ctx) as pool:
            for n in args.ranks:
                ways = {w: _measure(pool, port, server.pid, secret, n, w, args) for w in WAYS}
                sizes.append(RendezvousSize(n, ways["default"], ways["engine"], ways["lazy"]))
    finally:
        ours.send("stop")
        server.join(10)
        if server.is_alive():
            server.kill()
            server.join()
    return RendezvousReport(
        sizes=sizes,
        clients=args.clients,
        machine=HostInfo(os.cpu_count(), platform.python_version(), torch.__version__),
        command=command_line(args),
    )


def run(args: argparse.Namespace) -> int:
    """Entry point of ``p2p-bench rendezvous``."""
    report = measure(args)
    finish_with_table(args, report.to_json(), _table(report))
    return 0


def _table(report: RendezvousReport) -> str:
    lines = [
        "one gloo group's rendezvous through the authenticated store "
        f"({report.clients} clients; per group, scaled to its members)"
    ]
    header = ("members", "", "requests", "address B", "MB read", "store CPU s", "wall s")
    lines.append("  ".join(f"{h:>11}" for h in header))
    for s in report.sizes:
        for name, row in (("default", s.default), ("engine", s.engine), ("lazy", s.lazy)):
            if row is None:
                continue
            cells: list[Any] = [
                s.members,
                name,
                row.requests,
                row.address_bytes,
                f"{row.reply_mb:.1f}",
                f"{row.store_cpu_s:.2f}",
                f"{row.wall_s:.2f}",
            ]
            lines.append("  ".join(f"{c:>11}" for c in cells))
        lines.append(
            f"{'':>11}  store CPU, default / engine: {s.store_cpu_ratio:.0f}x"
            + (f", engine / lazy: {s.lazy_ratio:.0f}x" if s.lazy is not None else "")
        )
    return "\n".join(lines)
