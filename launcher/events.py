"""The JSON-lines event log: every control-plane decision, with monotonic timestamps.

One object per line: ``{"t": <time.monotonic()>, "wall": <time.time()>, "event": <name>, ...}``.
``t`` is CLOCK_MONOTONIC, comparable across processes of one machine, which is what phase
timings need; ``wall`` is for people. Writers append whole lines with ``O_APPEND``, so several
processes (coordinator, agents, ranks) can share one file.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

EVENTS_FILE = "events.jsonl"


class EventLog:
    """Appends events to ``<run_dir>/events.jsonl`` (or nowhere when ``run_dir`` is None)."""

    def __init__(self, run_dir: str | os.PathLike[str] | None, source: str) -> None:
        self.source = source
        self._fd = None
        if run_dir is not None:
            # Private to this user (0700 directory, 0600 file), never written through a link.
            Path(run_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
            path = Path(run_dir) / EVENTS_FILE
            flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
            self._fd = os.open(path, flags, 0o600)

    def write(self, event: str, **fields: Any) -> None:
        """Append one event (a single ``write`` call, so lines from processes never mix)."""
        if self._fd is None:
            return
        record = {"t": time.monotonic(), "wall": time.time(), "event": event, "source": self.source}
        record.update(fields)
        os.write(self._fd, (json.dumps(record, default=str) + "\n").encode())

    def close(self) -> None:
        """Close the file."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_events(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All events of a run, in file order (unparseable lines are skipped)."""
    return read_json_lines(Path(run_dir) / EVENTS_FILE)


def read_json_lines(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The objects of a JSON-lines file, in order; a missing file is empty, and a line cut
    short by a writer that died mid-write is skipped."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


class EventTail:
    """A run's events as its log grows: each :meth:`read` parses only what was appended since
    the last one (a watcher that polls a log of tens of thousands of lines would otherwise
    parse all of it every time)."""

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.path = Path(run_dir) / EVENTS_FILE
        self.events: list[dict[str, Any]] = []
        """Every event read so far, in file order."""
        self._offset = 0
        self._partial = b""

    def read(self) -> list[dict[str, Any]]:
        """Read what was appended; returns :attr:`events` (a line still being written waits
        for its end; an unparseable one is skipped)."""
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return self.events
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        for line in lines:
            try:
                self.events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return self.events
