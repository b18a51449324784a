"""The Slurm tier: a real local cluster (slurmctld + three slurmd) for the whole session.

Skipped, with the reason in the summary, where the Slurm binaries are missing or the daemons
cannot start (``.ci/run`` installs them when it can). Jobs a test submits are cancelled at its
end whatever happened, and nodes a test took down are brought back.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from tests.slurm import cluster

REPO = Path(__file__).resolve().parents[2]
DEADLINE_S = 150.0


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """The running cluster; skips the tier loudly when there cannot be one."""
    root = tmp_path_factory.mktemp("slurm")
    try:
        running = cluster.start(root)
    except cluster.Unavailable as e:
        warnings.warn(f"Slurm tier skipped: {e}", stacklevel=1)
        pytest.skip(f"SLURM TIER SKIPPED: {e}")
    try:
        yield running
    finally:
        running.stop()


class Jobs:
    """Submits batch jobs to the cluster with this checkout's p2p-run on PATH."""

    def __init__(self, cluster_: cluster.Cluster, tmp: Path) -> None:
        self.cluster = cluster_
        self.shared = tmp / "runs"
        self.shared.mkdir()
        bindir = str(Path(sys.executable).parent)
        self.env = {
            **cluster_.env,
            "PATH": f"{bindir}:{cluster_.env.get('PATH', '')}",
            "PYTHONPATH": str(REPO),
            "P2P_SHARED": str(self.shared),
        }
        self.ids: list[str] = []
        self.helpers: list[subprocess.Popen] = []

    def submit(self, script: str, *sbatch_args: str, **env: str) -> str:
        """``sbatch`` a script (run from the repository root); returns the job id."""
        out = subprocess.run(
            ["sbatch", "--parsable", "-o", str(self.shared / "slurm-%j.out"), *sbatch_args, script],
            env={**self.env, **env},
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0, out.stderr
        job_id = out.stdout.strip().split(";")[0]
        self.ids.append(job_id)
        return job_id

    def popen(self, cmd: list[str], **env: str) -> subprocess.Popen:
        """A helper command (e.g. ``srun --jobid``) that teardown ends if it is still running."""
        proc = subprocess.Popen(
            cmd,
            env={**self.env, **env},
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.helpers.append(proc)
        return proc

    def run_dir(self, job_id: str) -> Path:
        return self.shared / job_id

    def wait_done(self, job_id: str, timeout_s: float = DEADLINE_S) -> dict[str, str]:
        """Wait until the job has left the queue; returns its ``scontrol show job`` fields."""
        wait_for(
            lambda: not self.cluster.run("squeue", "-h", "-j", job_id, check=False).strip(),
            f"job {job_id} to end",
            timeout_s,
            lambda: self.output(job_id),
        )
        return self.info(job_id)

    def info(self, job_id: str) -> dict[str, str]:
        text = self.cluster.run("scontrol", "show", "job", "-o", job_id)
        return dict(f.split("=", 1) for f in text.split() if "=" in f)

    def output(self, job_id: str) -> str:
        path = self.shared / f"slurm-{job_id}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def events(self, job_id: str, name: str | None = None, **match) -> list[dict]:
        path = self.run_dir(job_id) / "events.jsonl"
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue  # a line being written
            if (name is None or e.get("event") == name) and all(
                e.get(k) == v for k, v in match.items()
            ):
                out.append(e)
        return out

    def wait_event(self, job_id: str, name: str, timeout_s: float = DEADLINE_S, **match):
        return wait_for(
            lambda: self.events(job_id, name, **match),
            f"event {name} {match} of job {job_id}",
            timeout_s,
            lambda: self.output(job_id),
        )

    def steps(self, job_id: str) -> dict[str, str]:
        """``{node: step id}`` of the job's running steps."""
        out = self.cluster.run("squeue", "-h", "-s", "-j", job_id, "-o", "%i %N", check=False)
        return {n: i for i, n in (line.split() for line in out.splitlines() if line.strip())}

    def teardown(self) -> None:
        for job_id in self.ids:
            self.cluster.run("scancel", job_id, check=False)
        for proc in self.helpers:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(
            self.cluster.run("squeue", "-h", "-j", j, check=False).strip() for j in self.ids
        ):
            time.sleep(0.2)
        self.cluster.resume_all()


def wait_for(predicate, what: str, timeout_s: float = DEADLINE_S, context=lambda: ""):
    """Poll ``predicate`` until truthy, or fail naming ``what`` (and the job's output)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}\n{context()}")


@pytest.fixture
def jobs(slurm_cluster, tmp_path):
    """Submit jobs; every one still queued or running is cancelled at the test's end."""
    j = Jobs(slurm_cluster, tmp_path)
    try:
        yield j
    finally:
        j.teardown()
