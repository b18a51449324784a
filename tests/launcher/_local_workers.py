"""Per-rank functions for tests/launcher/test_local.py (importable by the ranks)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def say(word: str) -> int:
    print(f"{word} from rank {os.environ['RANK']}", file=sys.stderr, flush=True)
    return int(os.environ["RANK"])


def stuck_in_a_wait() -> None:
    time.sleep(300)


def say_alone(word: str) -> None:
    print(f"{word} from a process of its own", file=sys.stderr, flush=True)


def env_value(name: str) -> str | None:
    return os.environ.get(name)


def stuck_with_a_pid_file(folder: str) -> None:
    written = Path(folder) / f"rank{os.environ['RANK']}.tmp"
    written.write_text(str(os.getpid()))
    written.rename(written.with_suffix(".pid"))
    time.sleep(300)


if __name__ == "__main__":
    # A parent of ranks for a test to SIGKILL: its ranks write their pids into argv[1].
    from launcher.local import WorkerGroupConfig, run_local
    from tests.launcher import _local_workers

    stuck = WorkerGroupConfig(world_size=2, backend="none", timeout_s=300)
    run_local(_local_workers.stuck_with_a_pid_file, stuck, (sys.argv[1],))
