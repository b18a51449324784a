"""Signed checkpoint manifests: a cold checkpoint is read only if the job's secret vouches for it.

DCP reads a checkpoint's ``.metadata`` with pickle, so a crafted file under the checkpoint
directory would run code in every rank that loads it. After a checkpoint is complete, rank 0
writes ``manifest.json`` beside it: every file's name, size and SHA-256, with an HMAC-SHA256 of
that list under the job's secret (the file named by ``P2P_SECRET_FILE``). Before DCP opens
anything, every loading rank checks the manifest: the tag, and that the directory holds exactly
the listed files with the listed sizes and hashes. Anything else is refused with one line
saying why, before a byte of pickle is read.

A job run without a secret (no ``P2P_SECRET_FILE``, e.g. a single-process script) writes and
checks no manifest: it trusts its checkpoint directory, and says so once in the log.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from launcher.protocol import ENV_SECRET_FILE

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem  # untyped: the name documents what is passed

logger = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.json"
_DOMAIN = b"p2p-checkpoint-manifest\0"
_CHUNK_BYTES = 1 << 20
_warned_unsigned = False


class CheckpointRefused(ValueError):
    """A checkpoint's manifest is missing, forged, or does not match its files."""


def job_secret() -> bytes | None:
    """The job's secret, or None when this process runs outside ``p2p-run``."""
    from launcher import protocol

    path = os.environ.get(protocol.ENV_SECRET_FILE)
    return protocol.read_secret(path) if path else None


def _entries(fs: AbstractFileSystem, directory: str) -> dict[str, dict[str, int | str]]:
    out: dict[str, dict[str, int | str]] = {}
    for path in sorted(fs.find(directory)):
        name = path[len(directory.rstrip("/")) + 1 :]
        if name == MANIFEST_FILE:
            continue
        digest = hashlib.sha256()
        size = 0
        with fs.open(path, "rb") as f:
            while chunk := f.read(_CHUNK_BYTES):
                digest.update(chunk)
                size += len(chunk)
        out[name] = {"size": size, "sha256": digest.hexdigest()}
    return out


def _tag(secret: bytes, files: Mapping[str, object]) -> str:
    body = json.dumps(files, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(secret, _DOMAIN + body, hashlib.sha256).hexdigest()


def sign(fs: AbstractFileSystem, directory: str, secret: bytes) -> None:
    """Write ``manifest.json`` for the complete checkpoint in ``directory`` (one rank calls it)."""
    files = _entries(fs, directory)
    doc = {"version": 1, "files": files, "hmac_sha256": _tag(secret, files)}
    with fs.open(f"{directory.rstrip('/')}/{MANIFEST_FILE}", "w") as f:
        f.write(json.dumps(doc, sort_keys=True))


def verify(fs: AbstractFileSystem, directory: str, secret: bytes) -> None:
    """Check ``directory`` against its signed manifest before anything in it is deserialised.

    Raises:
        CheckpointRefused: one line naming the checkpoint and the reason.
    """
    where = f"checkpoint {directory}"
    try:
        with fs.open(f"{directory.rstrip('/')}/{MANIFEST_FILE}", "rb") as f:
            doc = json.loads(f.read(16 << 20))
    except FileNotFoundError:
        raise CheckpointRefused(
            f"refusing {where}: it has no signed {MANIFEST_FILE} (written by another job or "
            "tampered with); resume from a checkpoint this job's secret signed"
        ) from None
    except ValueError as e:
        raise CheckpointRefused(f"refusing {where}: unreadable {MANIFEST_FILE} ({e})") from None
    files = doc.get("files") if isinstance(doc, dict) else None
    tag = doc.get("hmac_sha256") if isinstance(doc, dict) else None
    if not isinstance(files, dict) or not isinstance(tag, str):
        raise CheckpointRefused(f"refusing {where}: malformed {MANIFEST_FILE}")
    if not hmac.compare_digest(tag, _tag(secret, files)):
        raise CheckpointRefused(
            f"refusing {where}: its {MANIFEST_FILE} is not signed with this job's secret "
            "(resume with --secret-file of the job that wrote it)"
        )
    actual = _entries(fs, directory)
    for name in sorted(set(files) | set(actual)):
        if name not in actual:
            raise CheckpointRefused(f"refusing {where}: {name} listed in the manifest is missing")
        if name not in files:
            raise CheckpointRefused(f"refusing {where}: {name} is not in its signed manifest")
        if actual[name] != files[name]:
            raise CheckpointRefused(
                f"refusing {where}: {name} does not match its signed size and hash"
            )


def sign_if_secret(fs: AbstractFileSystem, directory: str) -> None:
    """:func:`sign` with the job's secret, when the job has one."""
    secret = job_secret()
    if secret is not None:
        sign(fs, directory, secret)


_vouched: set[str] = set()


def verify_if_secret(fs: AbstractFileSystem, directory: str, cached: bool = False) -> None:
    """:func:`verify` with the job's secret; without one, note once that nothing is checked.

    Args:
        cached: Skip the check if this process verified ``directory`` a moment ago (in
            :func:`latest_vouched`), so a checkpoint is hashed once per load.
    """
    global _warned_unsigned
    secret = job_secret()
    if secret is not None:
        if cached and directory in _vouched:
            _vouched.discard(directory)
            return
        verify(fs, directory, secret)
    elif not _warned_unsigned:
        _warned_unsigned = True
        logger.warning(
            "no job secret (%s unset): loading checkpoints without a signed manifest check",
            ENV_SECRET_FILE,
        )


def latest_vouched(
    steps: list[int], locate: Callable[[int], tuple[AbstractFileSystem, str]]
) -> int:
    """The newest of ``steps`` (ascending) whose checkpoint passes :func:`verify_if_secret`.

    Args:
        steps: Complete checkpoints' steps, ascending (not empty).
        locate: ``step -> (fs, directory)``.

    Raises:
        CheckpointRefused: none passes (the newest one's reason).
    """
    first_error: CheckpointRefused | None = None
    for step in reversed(steps):
        fs, directory = locate(step)
        try:
            verify_if_secret(fs, directory)
        except CheckpointRefused as e:
            logger.warning("%s", e)
            first_error = first_error or e
            continue
        _vouched.add(directory)
        return step
    assert first_error is not None
    raise first_error
