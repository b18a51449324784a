"""Real p2p-run jobs on this machine for tests (``launcher.testing``), with test-friendly settings.

``start_job`` (a fixture in ``tests/conftest.py``) starts one; its teardown SIGKILLs whatever
is left of every job it started.
"""

from __future__ import annotations

import time
from pathlib import Path

from launcher.testing import LocalJob

WORKER = str(Path(__file__).parent / "launcher" / "scripts" / "engine_worker.py")
DEADLINE_S = 60.0


def wait_for(predicate, what: str, timeout_s: float = DEADLINE_S):
    """Poll ``predicate`` until it returns something truthy, or fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def running_in_session(sid: int) -> list[int]:
    """The processes of session ``sid`` that still run (zombies do not)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue  # ended meanwhile
        state, session = fields[0], int(fields[3])
        if session == sid and state != "Z":
            found.append(int(stat.parent.name))
    return found


class Job(LocalJob):
    """A job with a fast heartbeat (0.1 s, dead after 3 s) so faults are seen quickly."""

    def __init__(
        self,
        run_dir: Path,
        nnodes: int,
        nproc: int,
        spares,
        extra,
        launcher_args=(),
        script: str = WORKER,
        env=None,
    ):
        if script == WORKER and "--import-torch" not in extra:
            # The worker imports no torch: a node's fork server would import it for nothing.
            launcher_args = ["--start-method", "spawn", *launcher_args]
        super().__init__(
            run_dir,
            nnodes=nnodes,
            nproc_per_node=nproc,
            spares=spares,
            script=script,
            script_args=extra,
            launcher_args=launcher_args,
            env=env,
            heartbeat_interval_s=0.1,
            heartbeat_timeout_s=3.0,
            ack_timeout_s=10.0,
        )

    def wait_event(self, name: str, timeout_s: float = DEADLINE_S, **match):
        return wait_for(lambda: self.events(name, **match), f"event {name} {match}", timeout_s)

    def stop(self) -> list[int]:
        """Ask the ranks to finish; returns the exit codes of the p2p-run processes."""
        (self.run_dir / "stop").touch()
        return self.wait(DEADLINE_S)
