"""p2p-run jobs of emulated nodes on this machine, for tests, benchmarks and the demo.

One ``p2p-run`` process per node, as on a real cluster: node 0 starts the coordinator on a port
the OS picks, the others join it. :class:`LocalJob` starts them, reads what the job wrote (its
event log, each node's output) and always takes every process of the job down.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TextIO

from launcher.events import read_events
from launcher.lifetime import alive, die_with_parent

START_TIMEOUT_S = 60.0


class Hosts(Protocol):
    """Where each node of a :class:`LocalJob` runs, when not all on this machine's loopback
    (``bench.netns.Network``: a network namespace per node)."""

    def address(self, node: int) -> str:
        """The address ``node``'s processes listen on."""
        ...

    def command(self, node: int, argv: list[str]) -> list[str]:
        """``argv`` run on ``node``."""
        ...


class JobStartFailed(RuntimeError):
    """Node 0's p2p-run exited before its coordinator was up (its log says why)."""


class JobTimeout(TimeoutError):
    """A job outlived its deadline (it was killed)."""


class LocalJob:
    """A p2p-run job on this machine: ``nnodes`` p2p-run processes, outputs in ``run_dir``.

    Args:
        run_dir: The job's run directory (event log, secret, one ``p2p-run-<n>.log`` per node).
            An earlier job's run directory is emptied first: it would hand out that job's
            coordinator address, event log, fault markers and results.
        nnodes, nproc_per_node: The job's shape.
        spares: Hot spares per node.
        script, script_args: What every rank runs.
        launcher_args: Further p2p-run flags (the same on every node).
        env: Extra environment for every process of the job.
        heartbeat_interval_s, heartbeat_timeout_s, ack_timeout_s: p2p-run's settings.
        hosts: Where the nodes run (default: all on 127.0.0.1).
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        nnodes: int,
        nproc_per_node: int,
        spares: Sequence[int],
        script: str,
        script_args: Sequence[str] = (),
        launcher_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        heartbeat_interval_s: float = 0.5,
        heartbeat_timeout_s: float = 3.0,
        ack_timeout_s: float = 10.0,
        hosts: Hosts | None = None,
    ) -> None:
        if len(spares) != nnodes:
            raise ValueError(f"spares lists {len(spares)} nodes, the job has {nnodes}")
        self.run_dir = Path(run_dir)
        if any((self.run_dir / name).exists() for name in ("coordinator.json", "events.jsonl")):
            shutil.rmtree(self.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.script, self.script_args = script, list(script_args)
        self.env = {**os.environ, **(env or {})}
        self.nodes: list[subprocess.Popen[bytes]] = []
        self._logs: list[TextIO] = []
        self.started_t = time.monotonic()
        common = [
            "--nnodes",
            str(nnodes),
            "--nproc-per-node",
            str(nproc_per_node),
            "--run-dir",
            str(self.run_dir),
            "--heartbeat-interval",
            str(heartbeat_interval_s),
            "--heartbeat-timeout",
            str(heartbeat_timeout_s),
            "--ack-timeout",
            str(ack_timeout_s),
            *launcher_args,
        ]
        self._common = common
        self.hosts = hosts
        self.host = "127.0.0.1" if hosts is None else hosts.address(0)
        """Where the coordinator listens (node 0)."""
        try:
            self._start([*common, "--node-rank", "0", "--coordinator", f"{self.host}:0"], spares[0])
            self.port = self._wait_for_coordinator()["port"]
            for node in range(1, nnodes):
                address = f"{self.host}:{self.port}"
                self._start(
                    [*common, "--node-rank", str(node), "--coordinator", address], spares[node]
                )
        except BaseException:
            self.kill_everything()
            raise

    def add_node(self, node_rank: int, spares: int = 0) -> None:
        """Start one more node's p2p-run, joining the running job (elastic jobs grow into it)."""
        address = f"{self.host}:{self.port}"
        self._start(
            [*self._common, "--node-rank", str(node_rank), "--coordinator", address], spares
        )

    def _start(self, args: list[str], spares: int) -> None:
        log = open(self.run_dir / f"p2p-run-{len(self.nodes)}.log", "w")  # noqa: SIM115
        self._logs.append(log)
        cmd = [sys.executable, "-m", "launcher.cli", *args, "--spares", str(spares)]
        if self.hosts is not None:  # announced by address, not by the name it resolves to
            cmd = [*cmd, "--local-addr", self.hosts.address(len(self.nodes))]
        cmd = [*cmd, self.script, *self.script_args]
        if self.hosts is not None:
            cmd = self.hosts.command(len(self.nodes), cmd)
        self.nodes.append(
            subprocess.Popen(
                cmd,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                # Whatever ends the process that runs the job (a test, a bench), its nodes
                # end with it: SIGTERM, on which p2p-run ends its processes.
                preexec_fn=die_with_parent(signal.SIGTERM),
            )
        )

    def coordinator_info(self) -> dict[str, Any] | None:
        """What the coordinator published (``port``, ``store_port``, ``pid``), once it has."""
        path = self.run_dir / "coordinator.json"
        return json.loads(path.read_text()) if path.exists() else None

    def _wait_for_coordinator(self) -> dict[str, Any]:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            info = self.coordinator_info()
            if info:
                return info
            if self.nodes[0].poll() is not None:
                raise JobStartFailed(f"p2p-run of node 0 exited: {self.output(0)[-2000:]}")
            time.sleep(0.02)
        raise JobTimeout(f"the coordinator did not start within {START_TIMEOUT_S:.0f}s")

    def events(self, name: str | None = None, **match: Any) -> list[dict[str, Any]]:
        """Events of the job's log (of one ``name``, with fields equal to ``match``)."""
        return [
            e
            for e in read_events(self.run_dir)
            if (name is None or e["event"] == name) and all(e.get(k) == v for k, v in match.items())
        ]

    def pid_of(self, rank: int) -> int:
        """Pid of the process started as ``rank``."""
        (started,) = self.events("process_started", rank=rank, role="rank")
        return int(started["pid"])

    def all_pids(self) -> list[int]:
        """Every process of the job this machine knows of."""
        pids = [e["pid"] for e in self.events("process_started")]
        pids += [e["pid"] for e in self.events("forkserver_ready")]
        info = self.coordinator_info()
        return pids + ([info["pid"]] if info else []) + [n.pid for n in self.nodes]

    def wait(
        self,
        timeout_s: float,
        on_poll: Callable[[list[dict[str, Any]]], None] | None = None,
        poll_s: float = 0.5,
    ) -> list[int]:
        """Exit codes of the p2p-run processes once all have ended.

        Args:
            timeout_s: Deadline for the whole job.
            on_poll: Called with the event log every ``poll_s`` while it runs (progress).
            poll_s: Polling interval.

        Raises:
            JobTimeout: still running after ``timeout_s`` (the job is then killed).
        """
        deadline = time.monotonic() + timeout_s
        while any(n.poll() is None for n in self.nodes):
            if time.monotonic() > deadline:
                self.kill_everything()
                raise JobTimeout(
                    f"the job in {self.run_dir} still ran after {timeout_s:g} s and was killed; "
                    f"see {self.run_dir}/p2p-run-*.log and events.jsonl"
                )
            if on_poll is not None:
                on_poll(self.events())
            try:
                self.nodes[0].wait(timeout=poll_s if on_poll else 0.05)
            except subprocess.TimeoutExpired:
                pass
        return [n.returncode for n in self.nodes]

    def output(self, node: int = 0) -> str:
        """What p2p-run of ``node`` and its processes printed."""
        for log in self._logs:
            if not log.closed:
                log.flush()
        return (self.run_dir / f"p2p-run-{node}.log").read_text()

    def kill_everything(self) -> None:
        """SIGKILL every process of the job that is still alive; close the logs."""
        for pid in self.all_pids():
            if alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for n in self.nodes:
            try:
                n.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for log in self._logs:
            log.close()
