"""The per-job secret in a run directory that every node shares: created once, never half-read.

Node 0 writes a new secret to a file of its own and links it into place (``os.link`` fails when
the name exists, so the first link wins and a reader never sees a partly written file); every
other node waits for that file with a deadline. The secret's format and checks are
:func:`launcher.protocol.write_secret` and :func:`launcher.protocol.read_secret`.
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

from launcher import protocol

SECRET_FILE = "secret"
OPERATOR_KEY_FILE = "operator.key"
"""The operator's credential in the run directory (mode 0600, made with the secret by node 0):
only a ``scale`` signed with it resizes the job; the ranks' secret alone does not."""
_POLL_S = 0.1


def create_once(path: Path) -> bytes:
    """The job's secret at ``path``: made now if no node made it yet, else the one there.

    Raises:
        ValueError: the file there is not a usable secret (the message says why).
    """
    if not path.exists():
        # A name of this creator alone (threads share a pid): write_secret creates exclusively.
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(8)}.tmp")
        try:
            protocol.write_secret(str(tmp))
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass  # another process linked its secret first: that one is the job's
        finally:
            tmp.unlink(missing_ok=True)
    return protocol.read_secret(str(path))


def wait_for(path: Path, timeout_s: float, flag: str = "--join-timeout") -> bytes:
    """Wait until ``path`` holds the job's secret (node 0 creates it), at most ``timeout_s``.

    Raises:
        TimeoutError: it did not appear in time (one line naming the file and the fixes).
        ValueError: it appeared but is not a usable secret.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if path.exists():
            return protocol.read_secret(str(path))
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"secret file {path} did not appear within {timeout_s:.0f}s ({flag}): node 0 "
                "creates it in the run directory, which every node must share (--run-dir); or "
                "give every node the same --secret-file"
            )
        time.sleep(_POLL_S)
