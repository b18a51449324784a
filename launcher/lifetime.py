"""Child processes that end with the process that started them, however it ends.

A process that exits normally, on Ctrl-C or on SIGTERM ends its children itself; one that is
SIGKILLed (the OOM killer, a job's hard limit, a test run's timeout) cannot. The kernel can:
``PR_SET_PDEATHSIG`` has it signal the child when the thread that started it ends. Every process
this project starts asks for it: ranks, spares and coordinators under ``p2p-run``, the nodes of
a test's or a bench's job, the bench's coordinators and its baseline's ``torchrun``. A rank
forked by :mod:`launcher.local` is the child of a fork server that outlives the process that
asked for it: it watches that process instead (:func:`end_with`).
"""

from __future__ import annotations

import ctypes
import functools
import os
import select
import signal
import threading
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl  # looked up here, not in a forked child


def _end_with_parent(signum: int, parent: int) -> None:
    """In a child of ``parent``: be sent ``signum`` when the parent ends. A parent already gone
    (the child adopted by another) sends it at once."""
    _prctl(_PR_SET_PDEATHSIG, signum)
    if os.getppid() != parent:
        os.kill(os.getpid(), signum)


def die_with_parent(signum: int = signal.SIGKILL) -> Callable[[], None]:
    """A ``preexec_fn`` (it runs in the child between fork and exec) that makes a child of this
    process end with it: SIGKILL by default, SIGTERM for a child that ends children of its own
    on it (``p2p-run``, ``torchrun``)."""
    return functools.partial(_end_with_parent, signum, os.getpid())


def end_with(pid: int) -> None:
    """SIGKILL this process when process ``pid``, not its parent, ends: a daemon thread waits
    on ``pid``'s pidfd. A ``pid`` already gone ends this process at once."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGKILL)
        raise

    def wait() -> None:
        waiter = select.poll()  # readable once the process has ended
        waiter.register(pidfd, select.POLLIN)
        waiter.poll()
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=wait, name=f"end-with-{pid}", daemon=True).start()


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:\tZ") for line in f)
    except FileNotFoundError:
        return False


def ancestors(pid: int | None = None) -> list[int]:
    """The processes above ``pid`` (default: this one), its parent first."""
    chain: list[int] = []
    pid = os.getpid() if pid is None else pid
    while pid > 1:
        try:
            with open(f"/proc/{pid}/stat") as f:
                # The command name, in parentheses, may hold spaces: the fields follow it.
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, IndexError, ValueError):
            break
        chain.append(pid)
    return chain
