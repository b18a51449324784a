"""Run a p2p-run job of several emulated nodes on this machine, and always take it down.

One ``p2p-run`` process per node, as on a real cluster: node 0 starts the coordinator on a port
the OS picks, the others join it. The demo, the benchmarks and the tests start jobs through
:class:`LocalJob`; :func:`run_example` runs the example training job to the end and collects
what its ranks wrote.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import probe
from bench.faults import Fault, to_env
from launcher.events import read_events
from launcher.protocol import ENV_INJECT, ENV_JOB_HOOKS, ENV_PROBE_DIR

#: The example training job (a checkout's ``examples/``; see README).
EXAMPLE = str(Path(__file__).resolve().parents[1] / "examples" / "train.py")
START_TIMEOUT_S = 60.0


class JobTimeout(TimeoutError):
    """A job outlived its deadline (it was killed)."""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:\tZ") for line in f)
    except FileNotFoundError:
        return False


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
    ) -> None:
        if len(spares) != nnodes:
            raise ValueError(f"spares lists {len(spares)} nodes, the job has {nnodes}")
        self.run_dir = Path(run_dir)
        if any((self.run_dir / name).exists() for name in ("coordinator.json", "events.jsonl")):
            shutil.rmtree(self.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.script, self.script_args = script, list(script_args)
        self.env = {**os.environ, **(env or {})}
        self.nodes: list[subprocess.Popen] = []
        self._logs: list[Any] = []
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
        try:
            self._start([*common, "--node-rank", "0", "--coordinator", "127.0.0.1:0"], spares[0])
            self.port = self._wait_for_coordinator()["port"]
            for node in range(1, nnodes):
                address = f"127.0.0.1:{self.port}"
                self._start(
                    [*common, "--node-rank", str(node), "--coordinator", address], spares[node]
                )
        except BaseException:
            self.kill_everything()
            raise

    def add_node(self, node_rank: int, spares: int = 0) -> None:
        """Start one more node's p2p-run, joining the running job (elastic jobs grow into it)."""
        address = f"127.0.0.1:{self.port}"
        self._start(
            [*self._common, "--node-rank", str(node_rank), "--coordinator", address], spares
        )

    def _start(self, args: list[str], spares: int) -> None:
        log = open(self.run_dir / f"p2p-run-{len(self.nodes)}.log", "w")  # noqa: SIM115
        self._logs.append(log)
        cmd = [sys.executable, "-m", "launcher.cli", *args, "--spares", str(spares)]
        self.nodes.append(
            subprocess.Popen(
                [*cmd, self.script, *self.script_args],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
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
                raise RuntimeError(f"p2p-run of node 0 exited: {self.output(0)[-2000:]}")
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
        return started["pid"]

    def all_pids(self) -> list[int]:
        """Every process of the job this machine knows of."""
        pids = [e["pid"] for e in self.events("process_started")]
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
                    f"the job in {self.run_dir} still ran after {timeout_s:.0f}s and was killed; "
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
            if _alive(pid):
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


@dataclass
class JobOutcome:
    """A finished job: exit codes, each rank's ``rank<r>.json``, the event log."""

    job: LocalJob
    codes: list[int]
    results: dict[int, dict[str, Any]]
    wall_s: float

    def events(self, name: str | None = None, **match: Any) -> list[dict[str, Any]]:
        """Events of the job's log."""
        return self.job.events(name, **match)


def example_args(model: str, steps: int, cache_dir: str, out: Path) -> list[str]:
    """The flags both example scripts take for a run of ``steps`` steps writing to ``out``."""
    return ["--model", model, "--steps", str(steps), "--cache-dir", cache_dir, "--out", str(out)]


def run_example(
    run_dir: Path,
    *,
    model: str = "tiny",
    steps: int = 8,
    cache_dir: str | None = None,
    script_args: Sequence[str] = (),
    **kwargs: Any,
) -> JobOutcome:
    """Run the example training job to its end (see :func:`run_script` for the rest).

    Its ranks write their results themselves (``examples/train.py --out``): every step's loss
    besides its batch, and the final state's digest.
    """
    run_dir = Path(run_dir)
    out = run_dir / "out"
    args = [*example_args(model, steps, cache_dir or str(run_dir / "cache"), out), *script_args]
    return run_script(run_dir, script=EXAMPLE, script_args=args, results_dir=out, **kwargs)


def run_script(
    run_dir: Path,
    *,
    script: str,
    script_args: Sequence[str] = (),
    faults: Sequence[Fault] = (),
    nnodes: int = 2,
    nproc_per_node: int = 2,
    spares: Sequence[int] = (1, 0),
    results_dir: Path | None = None,
    launcher_args: Sequence[str] = (),
    timeout_s: float = 600.0,
    on_poll: Callable[[list[dict[str, Any]]], None] | None = None,
    env: Mapping[str, str] | None = None,
    **job_kwargs: Any,
) -> JobOutcome:
    """Run a protected training script under p2p-run to its end with ``faults`` injected.

    The faults are armed in every rank through the engine's ``P2P_JOB_HOOKS``
    (:mod:`bench.probe`), so the script needs no line for them. Each rank's results
    (``rank<r>.json``) are read from ``results_dir`` when the script writes them itself, or
    else recorded by the probe: every step's batch and the final state's digest. ``env`` is
    more environment for every process; hooks in its ``P2P_JOB_HOOKS`` follow the probe.
    """
    run_dir = Path(run_dir)
    extra, env = dict(env or {}), {ENV_JOB_HOOKS: probe.HOOK}
    if extra.get(ENV_JOB_HOOKS):
        env[ENV_JOB_HOOKS] += f",{extra.pop(ENV_JOB_HOOKS)}"
    env.update(extra)
    if faults:
        env[ENV_INJECT] = to_env(list(faults))
    if results_dir is None:
        results_dir = run_dir / "probe"
        env[ENV_PROBE_DIR] = str(results_dir)
    t0 = time.monotonic()
    job = LocalJob(
        run_dir,
        nnodes=nnodes,
        nproc_per_node=nproc_per_node,
        spares=spares,
        script=script,
        script_args=script_args,
        launcher_args=launcher_args,
        env=env,
        **job_kwargs,
    )
    try:
        codes = job.wait(timeout_s, on_poll)
    finally:
        job.kill_everything()
    results = {
        int(p.stem.removeprefix("rank")): json.loads(p.read_text())
        for p in Path(results_dir).glob("rank*.json")
    }
    return JobOutcome(job, codes, results, time.monotonic() - t0)


def bitwise_differences(got: JobOutcome, want: JobOutcome) -> list[str]:
    """Where ``got`` differs from the fault-free ``want`` (empty: bitwise equal).

    Compares every rank's final state digest and, for every step a rank ran (redone steps
    included), its batch and loss.
    """
    problems = []
    if sorted(got.results) != sorted(want.results):
        problems.append(f"ranks {sorted(got.results)} finished, expected {sorted(want.results)}")
    for rank in sorted(set(got.results) & set(want.results)):
        a, b = got.results[rank], want.results[rank]
        if a.get("digest") != b.get("digest"):
            problems.append(f"rank {rank}'s final state differs")
        for step, record in a["steps"].items():
            if record != b["steps"].get(step):
                problems.append(f"rank {rank}, step {step} differs")
    return problems
