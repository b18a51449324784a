"""Emulated nodes as hosts of their own, so that a fault can partition one from the others.

Each node of a :class:`Network` is a Linux network namespace with one interface (:data:`IFACE`)
on a bridge in this machine's namespace, an address ``10.R.0.(n+1)/24``, a host name of its own
(its processes run in a UTS namespace of their own) and an ``/etc/hosts`` naming every node (``ip
netns exec`` binds ``/etc/netns/<name>/hosts`` over it). Everything a real host does then works as
on a cluster: the coordinator listens on node 0's address, a standby advertises its host name,
gloo binds to the address its host name resolves to, and nothing reaches another node through
loopback.

:meth:`Network.partition` takes a node's link down: its packets go nowhere, no connection is
reset, and its processes run on unaware, which is what a switch failure or a cut cable looks
like and what a SIGSTOP (a hang) is not. :meth:`Network.heal` brings it back.

Namespaces need root (CAP_NET_ADMIN) and iproute2: :func:`unavailable` says why not where they
cannot be made, and the benches and tests that need them refuse or skip with that reason.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The interface of a node's namespace (the same name in each).
IFACE = "veth0"
#: Set in the environment of every process of a node started in a namespace: the node's
#: namespace, so that a fault fired inside the node knows it may take the link down.
ENV_NETNS = "P2P_BENCH_NETNS"
_ETC_NETNS = Path("/etc/netns")
_IP_TIMEOUT_S = 30.0


def _ip(*args: str) -> None:
    """Run ``ip`` (iproute2); a failure is a RuntimeError naming the command and what it said."""
    r = subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=_IP_TIMEOUT_S, check=False
    )
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip() or r.returncode}")


def partition_this_node() -> None:
    """Cut the node this process runs on off the others (from inside its namespace).

    Raises:
        RuntimeError: this process runs in no namespace of a :class:`Network`.
    """
    if not os.environ.get(ENV_NETNS):
        raise RuntimeError("a partition needs the job's nodes in network namespaces")
    _ip("link", "set", IFACE, "down")


def unavailable() -> str | None:
    """Why no network namespace can be made here (``None``: they can)."""
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "iproute2's ip and util-linux's unshare are needed"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    name = f"p2p-probe-{os.getpid()}"
    try:
        _ip("netns", "add", name)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        return f"cannot make a network namespace: {e}"
    _ip("netns", "del", name)
    return None


@dataclass(frozen=True, slots=True)
class Node:
    """One node's namespace."""

    netns: str
    host: str
    """Its host name, which its ``/etc/hosts`` maps to ``address``."""
    address: str
    outer: str
    """Its link's end on the bridge."""


class Network:
    """``num_nodes`` namespaces on one bridge; a context manager that removes them all.

    Raises:
        RuntimeError: a namespace, link or address could not be made (what is made is removed).
    """

    def __init__(self, num_nodes: int) -> None:
        tag = f"{os.getpid() % 100000}{random.randrange(100)}"
        self.bridge = f"p2pbr{tag}"[:15]
        subnet = f"10.{random.randrange(64, 250)}.0"
        self.nodes = [
            Node(f"p2p-{tag}-n{n}", f"p2p-node{n}", f"{subnet}.{n + 1}", f"p2p{tag}n{n}"[:15])
            for n in range(num_nodes)
        ]
        self._made: list[Node] = []
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            hosts = "127.0.0.1 localhost\n" + "".join(f"{n.address} {n.host}\n" for n in self.nodes)
            for node in self.nodes:
                self._made.append(node)
                (_ETC_NETNS / node.netns).mkdir(parents=True, exist_ok=True)
                (_ETC_NETNS / node.netns / "hosts").write_text(hosts)
                _ip("netns", "add", node.netns)
                _ip("link", "add", node.outer, "type", "veth", "peer", "name", IFACE, "netns",
                    node.netns)  # fmt: skip
                _ip("link", "set", node.outer, "master", self.bridge)
                _ip("link", "set", node.outer, "up")
                _ip("-n", node.netns, "addr", "add", f"{node.address}/24", "dev", IFACE)
                _ip("-n", node.netns, "link", "set", IFACE, "up")
                _ip("-n", node.netns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def address(self, node: int) -> str:
        """``node``'s address."""
        return self.nodes[node].address

    def command(self, node: int, argv: list[str]) -> list[str]:
        """``argv`` run on ``node``: in its namespace, under its host name (same pid: each
        step execs the next)."""
        n = self.nodes[node]
        rename = f'hostname "$0" && export {ENV_NETNS}={n.netns} && exec "$@"'
        return ["ip", "netns", "exec", n.netns, "unshare", "--uts", "sh", "-c", rename, n.host,
                *argv]  # fmt: skip

    def partition(self, node: int) -> None:
        """Cut ``node`` off: its interface goes down, as :func:`partition_this_node` does from
        inside it (its processes are not told; a peer's packets go unanswered)."""
        _ip("-n", self.nodes[node].netns, "link", "set", IFACE, "down")

    def heal(self, node: int) -> None:
        """Bring ``node``'s interface back up (its connections carry on where they stalled)."""
        _ip("-n", self.nodes[node].netns, "link", "set", IFACE, "up")

    def partitioned(self) -> list[int]:
        """The nodes whose interface is down."""
        out = []
        for n, node in enumerate(self.nodes):
            r = subprocess.run(
                ["ip", "-n", node.netns, "-o", "link", "show", IFACE],
                capture_output=True,
                text=True,
                timeout=_IP_TIMEOUT_S,
                check=False,
            )
            flags = r.stdout.split("<", 1)[-1].split(">", 1)[0].split(",")
            if r.returncode == 0 and "UP" not in flags:
                out.append(n)
        return out

    def close(self) -> None:
        """Remove every namespace, link and hosts file made (what is gone already is skipped)."""
        for node in self._made:
            for args in (("link", "del", node.outer), ("netns", "del", node.netns)):
                try:
                    _ip(*args)
                except (RuntimeError, OSError, subprocess.TimeoutExpired):
                    pass  # not made, or gone with the namespace
            shutil.rmtree(_ETC_NETNS / node.netns, ignore_errors=True)
        self._made = []
        try:
            _ip("link", "del", self.bridge)
        except (RuntimeError, OSError, subprocess.TimeoutExpired):
            pass

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Healer:
    """Heals each node a ``partition`` fault cut off once the job has gone on without it: a
    generation completed after the partition. Its processes then find a job that replaced them
    (what a partition that heals looks like), which must not let them act.

    Called with the job's event log at every poll of the run (``LocalJob.wait``'s ``on_poll``).
    """

    def __init__(self, net: Network) -> None:
        self.net = net
        self.healed: dict[int, float] = {}
        """node -> the event-log time of the generation after which it was healed."""

    def __call__(self, events: list[dict[str, Any]]) -> None:
        cuts = {
            int(e["fault"].split("node=", 1)[1].split("@", 1)[0]): e["t"]
            for e in events
            if e["event"] == "fault_injected" and str(e.get("fault", "")).startswith("partition:")
        }
        for node, t_cut in cuts.items():
            if node in self.healed:
                continue
            after = [
                e["t"] for e in events if e["event"] == "generation_complete" and e["t"] > t_cut
            ]
            if after:
                self.net.heal(node)
                self.healed[node] = min(after)
