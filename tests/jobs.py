"""Real p2p-run jobs on this machine for tests: several emulated nodes, every process cleaned up.

``start_job`` (a fixture in ``tests/conftest.py``) starts one; its teardown SIGKILLs whatever
is left of every job it started.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from launcher.events import read_events

WORKER = str(Path(__file__).parent / "launcher" / "scripts" / "engine_worker.py")
EXAMPLE = str(Path(__file__).parents[1] / "examples" / "train.py")
DEADLINE_S = 60.0


def alive(pid: int) -> bool:
    """Running (zombies count as gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:\tZ") for line in f)
    except FileNotFoundError:
        return False


def wait_for(predicate, what: str, timeout_s: float = DEADLINE_S):
    """Poll ``predicate`` until it returns something truthy, or fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


class Job:
    """A p2p-run job of several emulated nodes (one p2p-run process per node)."""

    def __init__(
        self,
        run_dir: Path,
        nnodes: int,
        nproc: int,
        spares: list[int],
        extra: list[str],
        launcher_args: list[str] = (),
        script: str = WORKER,
        env: dict[str, str] | None = None,
    ):
        self.run_dir = run_dir
        self.script = script
        self.env = {**os.environ, **(env or {})}
        self.nodes: list[subprocess.Popen] = []
        self._logs: list = []
        common = [
            "--nnodes",
            str(nnodes),
            "--nproc-per-node",
            str(nproc),
            "--run-dir",
            str(run_dir),
            "--heartbeat-interval",
            "0.1",
            "--heartbeat-timeout",
            "3",
            "--ack-timeout",
            "10",
            *launcher_args,
        ]
        self.nodes.append(
            self._start(
                [
                    *common,
                    "--node-rank",
                    "0",
                    "--coordinator",
                    "127.0.0.1:0",
                    "--spares",
                    str(spares[0]),
                ],
                extra,
            )
        )
        info = wait_for(lambda: self._coordinator_info(), "the coordinator's address")
        self.port = info["port"]
        for node in range(1, nnodes):
            self.nodes.append(
                self._start(
                    [
                        *common,
                        "--node-rank",
                        str(node),
                        "--coordinator",
                        f"127.0.0.1:{self.port}",
                        "--spares",
                        str(spares[node]),
                    ],
                    extra,
                )
            )

    def _start(self, args: list[str], extra: list[str]) -> subprocess.Popen:
        log = open(self.run_dir / f"p2p-run-{len(self.nodes)}.log", "w")  # noqa: SIM115
        self._logs.append(log)
        return subprocess.Popen(
            [sys.executable, "-m", "launcher.cli", *args, self.script, *extra],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def _coordinator_info(self):
        path = self.run_dir / "coordinator.json"
        return json.loads(path.read_text()) if path.exists() else None

    def events(self, name: str | None = None, **match):
        return [
            e
            for e in read_events(self.run_dir)
            if (name is None or e["event"] == name) and all(e.get(k) == v for k, v in match.items())
        ]

    def wait_event(self, name: str, timeout_s: float = DEADLINE_S, **match):
        return wait_for(lambda: self.events(name, **match), f"event {name} {match}", timeout_s)

    def pid_of(self, rank: int) -> int:
        (started,) = self.events("process_started", rank=rank, role="rank")
        return started["pid"]

    def all_pids(self) -> list[int]:
        pids = [e["pid"] for e in self.events("process_started")]
        pids += [e["pid"] for e in self.events("coordinator_started") if "pid" in e]
        info = self._coordinator_info()
        return pids + ([info["pid"]] if info else []) + [n.pid for n in self.nodes]

    def wait(self, timeout_s: float = DEADLINE_S) -> list[int]:
        """Exit codes of the p2p-run processes once all have ended (fails after the deadline)."""
        deadline = time.monotonic() + timeout_s
        codes = []
        for n in self.nodes:
            try:
                codes.append(n.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"the job in {self.run_dir} still ran after {timeout_s:.0f}s; see "
                    f"{self.run_dir}/p2p-run-*.log and events.jsonl"
                ) from None
        return codes

    def output(self, node: int = 0) -> str:
        """What p2p-run of ``node`` and its processes printed."""
        return (self.run_dir / f"p2p-run-{node}.log").read_text()

    def stop(self) -> list[int]:
        """Ask the ranks to finish; returns the exit codes of the p2p-run processes."""
        (self.run_dir / "stop").touch()
        return [n.wait(timeout=DEADLINE_S) for n in self.nodes]

    def kill_everything(self) -> None:
        for pid in self.all_pids():
            if alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for n in self.nodes:
            n.wait(timeout=10)
        for log in self._logs:
            log.close()
