"""Per-rank functions for tests/launcher/test_local.py (importable by the ranks)."""

from __future__ import annotations

import os
import sys
import time


def say(word: str) -> int:
    print(f"{word} from rank {os.environ['RANK']}", file=sys.stderr, flush=True)
    return int(os.environ["RANK"])


def stuck_in_a_wait() -> None:
    time.sleep(300)


def say_alone(word: str) -> None:
    print(f"{word} from a process of its own", file=sys.stderr, flush=True)


def env_value(name: str) -> str | None:
    return os.environ.get(name)
