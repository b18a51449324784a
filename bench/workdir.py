"""Where the benches' runs keep their files (``--work-dir``).

A run's folder (an engine run, its fault-free reference, a checkpoint-restart run, a resize's
checkpoint) always starts empty: a folder left by an earlier run of a bench (it holds
:data:`RUN_MARK`) is emptied first, so a work dir given again never feeds a run another run's
checkpoints or results; a folder there that a bench did not make is refused, never deleted.
Without ``--work-dir`` the command works in a temporary folder, removed when it ends unless a run
failed (then its logs are what the user needs, and the folder is named on stderr).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from bench.errors import UsageError

WORK_DIR_HELP = (
    "where runs keep their files; a run's folder left there by an earlier run is emptied "
    "(default: a temporary folder, removed at the end unless a run failed)"
)
#: The file that marks a folder as a bench run's, which a later run may empty.
RUN_MARK = ".p2p-bench-run"


def fresh_run_dir(path: str | Path) -> Path:
    """An empty folder for one run at ``path``, marked as a bench run's.

    Raises:
        UsageError: ``path`` holds files and is not an earlier bench run's folder.
    """
    path = Path(path)
    if path.is_dir() and any(path.iterdir()):
        if not (path / RUN_MARK).exists():
            raise UsageError(
                f"{path} holds files that no p2p-bench run left there ({RUN_MARK} is missing): "
                "give the runs a folder of their own, or empty this one"
            )
        shutil.rmtree(path)
    elif path.exists() and not path.is_dir():
        raise UsageError(f"{path} is a file, where a run's folder goes: give the runs another")
    path.mkdir(parents=True, exist_ok=True)
    (path / RUN_MARK).touch()
    return path


def temporary_work_dir(args: argparse.Namespace) -> Path | None:
    """Give a command that takes ``--work-dir`` and was given none a temporary one.

    Returns:
        The temporary folder (for :func:`finish_work_dir`), or ``None`` when there is none to
        remove: the command takes no work dir, or the user chose one.
    """
    if not hasattr(args, "work_dir") or args.work_dir:
        return None
    args.work_dir = tempfile.mkdtemp(prefix=f"p2p-bench-{args.command}-")
    return Path(args.work_dir)


def finish_work_dir(work: Path, code: int) -> None:
    """Remove the temporary work dir, or keep it when the command failed (``code`` 1) and say
    where: its runs' logs explain the failure."""
    if code == 1 and work.exists():
        print(f"p2p-bench: the runs' files (logs, events) are kept in {work}", file=sys.stderr)
        return
    shutil.rmtree(work, ignore_errors=True)
