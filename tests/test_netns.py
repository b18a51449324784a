"""Emulated nodes in network namespaces: reachable by host name, cut off and back, removed."""

from __future__ import annotations

import subprocess
import sys
from typing import cast

import pytest

from bench import netns
from bench.netns import Healer, Network

_SERVE = """
import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((socket.gethostname(), 6000))
s.listen()
print("listening", flush=True)
while True:
    c, _ = s.accept()
    c.sendall(socket.gethostname().encode())
    c.close()
"""
_ASK = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], 6000), timeout=2) as s:
        print(socket.gethostname(), "heard", s.recv(100).decode())
except OSError as e:
    print(type(e).__name__)
"""


@pytest.mark.skipif(netns.unavailable() is not None, reason=f"{netns.unavailable()}")
def test_nodes_reach_each_other_by_name_until_a_partition_and_after_it_heals():
    with Network(2) as net:
        server = subprocess.Popen(
            net.command(1, [sys.executable, "-c", _SERVE]), stdout=subprocess.PIPE, text=True
        )
        try:
            assert server.stdout is not None and server.stdout.readline() == "listening\n"

            def ask() -> str:
                cmd = net.command(0, [sys.executable, "-c", _ASK, net.nodes[1].host])
                return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout

            assert ask() == "p2p-node0 heard p2p-node1\n"
            net.partition(1)
            assert net.partitioned() == [1]
            assert ask() == "TimeoutError\n"  # no reset, no refusal: nothing answers
            net.heal(1)
            assert net.partitioned() == [] and ask() == "p2p-node0 heard p2p-node1\n"
        finally:
            server.kill()
            server.wait()
        names = [n.netns for n in net.nodes]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [n for n in names if n in listed]


def test_a_partitioned_node_heals_once_a_generation_completed_after_its_cut():
    class Net:
        def __init__(self) -> None:
            self.healed: list[int] = []

        def heal(self, node: int) -> None:
            self.healed.append(node)

    def event(name: str, t: float, **fields: object) -> dict:
        return {"event": name, "t": t, **fields}

    net = Net()
    healer = Healer(cast(Network, net))
    cut = event("fault_injected", 10.0, fault="partition:node=2@step=4:phase=forward")
    log = [event("generation_complete", 5.0, generation=1), cut]
    healer(log)
    assert net.healed == []
    log.append(event("generation_complete", 14.0, generation=2))
    healer(log)
    healer(log)
    assert net.healed == [2] and healer.healed == {2: 14.0}
