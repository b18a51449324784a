"""A node's ranks and spares forked from one warm interpreter (``p2p-run --start-method``).

Importing torch is most of a rank's start: about 3 s of CPU here, and far more where thousands
of processes read the same site-packages from a shared file system at once. Under
``--start-method forkserver`` (the default) the agent starts, for a command of the form
``python [options] script.py args`` or ``python [options] -m module args``, one fork server per
node with that interpreter and those options (:mod:`launcher._forkserver_main`); it imports
torch (and FSDP, DTensor, dynamo) once, and every rank and spare is forked from it and then runs
the script as the interpreter would have: the same ``sys.argv``, ``sys.path[0]``, ``__main__``,
environment, descriptors, working directory and exit code. The server creates no process group
and no CUDA context, so a forked process starts as clean as a fresh interpreter; its
``random`` and NumPy generators are seeded afresh (torch's default generator has a fixed seed
in a fresh interpreter too). A replacement spare is then ready in milliseconds instead of
seconds.

What differs from a fresh interpreter: ``/proc/<pid>/cmdline`` (``ps``) names the server's
command, and the processes of a node share one string-hash seed. Any other program, ``-c``,
``-i``, a zip or a folder as the script, or ``--start-method spawn`` starts each process with
``exec`` as torchrun does. A server that cannot start (an interpreter too old, say) is reported
once and the node falls back to ``spawn``.

The server is a child of the agent and dies with it; the processes it forks die with it. Losing
it is losing the node, as losing the agent is.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any, Protocol

from launcher import _forkserver_main
from launcher.lifetime import die_with_parent

logger = logging.getLogger(__name__)

#: What the server imports before it forks (FSDP brings DTensor; the first ``fully_shard``
#: imports dynamo; the engine's checkpoints use DCP). torch only: a module of the job's own
#: could be shadowed by a file beside its script, which the server does not see.
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "torch._dynamo",
    "torch.distributed.checkpoint",
)

#: torchrun's names; ``fork`` (torchrun forks from its agent) forks from the fork server here.
START_METHODS = ("forkserver", "spawn", "fork")

#: How long the server gets to import :data:`PRELOAD`.
_READY_TIMEOUT_S = 300.0
# Both waits below run in the agent's event loop, which also sends the node's heartbeats: each
# stays well under the 3 s after which a silent node is lost (--heartbeat-timeout's default).
# Both take milliseconds from a server that runs; one that hangs costs a second per process.
#: How long a fork request may go unanswered (the process is then spawned fresh instead).
_REPLY_TIMEOUT_S = 1.0
#: How long an exit the pidfd shows may go unreported by the server (counted as code 1 then).
_EXIT_REPORT_TIMEOUT_S = 1.0

_INTERPRETER = re.compile(r"python(\d+(\.\d+)*)?")
#: Interpreter options that take no argument (several may share one dash: ``-uB``).
_FLAGS = set("bBdEIOPqsSuv")
_WITH_ARGUMENT = ("-W", "-X", "--check-hash-based-pycs")


def start_method(text: str) -> str:
    """``--start-method``'s value, checked."""
    if text not in START_METHODS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a start method: choose one of {', '.join(START_METHODS)}"
        )
    return "forkserver" if text == "fork" else text


def split_python_command(command: Sequence[str]) -> tuple[list[str], list[str]] | None:
    """Split ``python [options] script.py args`` (or ``-m module args``) into the interpreter
    with its options and what it runs; ``None`` for a command a fork server cannot run."""
    if not command or not _is_python(command[0]):
        return None
    interpreter = [command[0]]
    i = 1
    while i < len(command):
        arg = command[i]
        if arg in _WITH_ARGUMENT:
            interpreter += command[i : i + 2]
            i += 2
        elif arg.startswith(("-W", "-X")):
            interpreter.append(arg)
            i += 1
        elif arg == "-m" or (arg.startswith("-") and arg.endswith("m") and _flags(arg[1:-1])):
            if arg != "-m":
                interpreter.append(arg[:-1])
            return (interpreter, ["-m", *command[i + 1 :]]) if i + 1 < len(command) else None
        elif arg.startswith("-") and _flags(arg[1:]):
            interpreter.append(arg)
            i += 1
        elif arg == "--":
            return _script(interpreter, command[i + 1 :])
        elif arg.startswith("-"):
            return None  # -c, -i, -x, - (stdin), --help...: a fresh interpreter's business
        else:
            return _script(interpreter, command[i:])
    return None


def _is_python(program: str) -> bool:
    if _INTERPRETER.fullmatch(os.path.basename(program)):
        return True
    found = shutil.which(program)
    return found is not None and os.path.realpath(found) == os.path.realpath(sys.executable)


def _flags(letters: str) -> bool:
    return bool(letters) and set(letters) <= _FLAGS


def _script(interpreter: list[str], entry: Sequence[str]) -> tuple[list[str], list[str]] | None:
    if not entry:
        return None
    try:
        with open(entry[0], "rb") as f:
            head = f.read(4)
    except OSError:
        return None  # missing, or a folder: the interpreter says what is wrong
    if head == b"PK\x03\x04":
        return None  # a zip application
    return interpreter, list(entry)


class ChildProcess(Protocol):
    """What the agent uses of a process it started: ``subprocess.Popen`` or
    :class:`ForkedProcess`."""

    pid: int
    stdout: IO[bytes] | None
    stderr: IO[bytes] | None
    returncode: int | None

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, signum: int) -> None: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


class ForkServerError(RuntimeError):
    """The fork server could not start, or stopped answering."""


class ForkServer:
    """One fork server, and the processes forked from it.

    Args:
        interpreter: The interpreter and its options, from :func:`split_python_command`.
        env: The environment the server imports in: the one every process shares (variables
            read when a module is imported, such as ``OMP_NUM_THREADS``, must be set here).
        preload: The modules it imports once.
    """

    def __init__(
        self,
        interpreter: Sequence[str],
        env: Mapping[str, str],
        preload: Sequence[str] = PRELOAD,
    ) -> None:
        self.interpreter = list(interpreter)
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock.settimeout(_REPLY_TIMEOUT_S)  # reads wait in select(): this bounds sends
        script = _forkserver_main.__file__
        try:
            self._proc = subprocess.Popen(
                [*self.interpreter, script, str(theirs.fileno()), *preload],
                env=dict(env),
                pass_fds=(theirs.fileno(),),
                preexec_fn=die_with_parent(),
            )
        except BaseException:
            self._sock.close()
            raise
        finally:
            theirs.close()
        self.pid = self._proc.pid
        self.ready = False
        self.preloaded: list[str] = []
        self._exits: dict[int, int] = {}
        self._requests = 0
        self._closed = False
        self._gone = False
        """The server closed its end, or its socket failed: it reports nothing more."""

    def wait_ready(self, timeout_s: float = _READY_TIMEOUT_S, wake_fd: int | None = None) -> bool:
        """Wait until the server has imported its modules. ``False``: ``wake_fd`` became
        readable first (a signal came).

        Raises:
            ForkServerError: The server exited, did not get ready within ``timeout_s``, or
                its imports loaded the CUDA driver.
        """
        if self.ready:
            return True
        deadline = time.monotonic() + timeout_s
        while True:
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                raise ForkServerError(
                    f"the fork server did not finish its imports within {timeout_s:.0f}s"
                )
            waiter = select.poll()
            waiter.register(self._sock, select.POLLIN)
            if wake_fd is not None:
                waiter.register(wake_fd, select.POLLIN)
            ready = {fd for fd, _ in waiter.poll(left_s * 1000)}
            if self._sock.fileno() in ready:
                doc, _ = self._receive(None, "its imports")
                if "unsafe" in doc:
                    raise ForkServerError(f"the fork server is not used: {doc['unsafe']}")
                if "ready" in doc:
                    self.ready = True
                    self.preloaded = [str(m) for m in doc["ready"]]
                    for name, error in dict(doc.get("failed", {})).items():
                        logger.info("the fork server could not import %s: %s", name, error)
                    return True
            elif ready:
                return False

    def spawn(
        self,
        entry: Sequence[str],
        *,
        env: Mapping[str, str],
        stdout: Any = None,
        stderr: Any = None,
        pass_fds: Sequence[int] = (),
    ) -> ForkedProcess:
        """Fork a process that runs ``entry`` (from :func:`split_python_command`), with
        ``subprocess.Popen``'s meaning of ``stdout``, ``stderr`` (``None``, ``DEVNULL``,
        ``PIPE`` or a file) and ``pass_fds``; ``env`` is its whole environment.

        Raises:
            ForkServerError: The server refused, or did not answer within 1 s.
        """
        assert self.ready, "wait_ready() first"
        sent: list[int] = []  # descriptors sent, in the order of targets
        targets: list[int] = []
        ours: list[int] = []  # closed once sent
        pipes: dict[int, IO[bytes]] = {}
        try:
            for target, how in ((1, stdout), (2, stderr)):
                if how is None:
                    continue
                if how == subprocess.DEVNULL:
                    fd = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
                    ours.append(fd)
                elif how == subprocess.PIPE:
                    read, fd = os.pipe()
                    pipes[target] = open(read, "rb", buffering=0)  # noqa: SIM115  # the caller's
                    ours.append(fd)
                else:
                    fd = how.fileno()
                sent.append(fd)
                targets.append(target)
            for fd in pass_fds:
                sent.append(fd)
                targets.append(fd)
            self._requests += 1
            request = {
                "spawn": {
                    "id": self._requests,
                    "entry": list(entry),
                    "env": dict(env),
                    "cwd": os.getcwd(),
                    "fds": targets,
                }
            }
            try:
                socket.send_fds(self._sock, [json.dumps(request).encode()], sent)
            except TimeoutError:  # a server that reads nothing, its socket's buffer full
                raise ForkServerError("the fork server did not take the request in time") from None
            except OSError as e:
                self._gone = True
                raise ForkServerError(f"the fork server is gone ({e})") from None
        except BaseException:
            for pipe in pipes.values():
                pipe.close()
            raise
        finally:
            for fd in ours:
                os.close(fd)
        try:
            pid, pidfd = self._started(self._requests)
        except BaseException:
            for pipe in pipes.values():
                pipe.close()
            raise
        return ForkedProcess(self, pid, pidfd, pipes.get(1), pipes.get(2))

    def _started(self, request: int) -> tuple[int, int]:
        """The pid and pidfd of the process started for ``request``."""
        deadline = time.monotonic() + _REPLY_TIMEOUT_S
        while True:
            doc, fds = self._receive(deadline, "the process it started")
            if doc.get("id") == request:
                if "started" in doc and fds:
                    for fd in fds[1:]:
                        os.close(fd)
                    return int(doc["started"]), fds[0]
                for fd in fds:
                    os.close(fd)
                raise ForkServerError(
                    f"the fork server refused to start a process: {doc.get('refused')}"
                )
            self._unasked(doc, fds)

    def _unasked(self, doc: dict[str, Any], fds: list[int]) -> None:
        """A message no request waits for: an exit report (kept by :meth:`_receive`), or the
        answer to a request given up on, whose process nobody manages: it is killed."""
        if "started" in doc and fds:
            signal.pidfd_send_signal(fds[0], signal.SIGKILL)
        for fd in fds:
            os.close(fd)

    def fileno(self) -> int:
        """The socket to the server, readable when it has said something (:meth:`drain`);
        -1 once it is closed or gone (at its end of file it would always be readable)."""
        return -1 if self._closed or self._gone else self._sock.fileno()

    def drain(self) -> None:
        """Read what the server said unasked, without waiting."""
        with contextlib.suppress(ForkServerError):
            while not self._gone and select.select([self._sock], [], [], 0)[0]:
                self._unasked(*self._receive(None, "anything"))

    def _receive(
        self, deadline: float | None, waiting_for: str
    ) -> tuple[dict[str, Any], list[int]]:
        """The next message, with its descriptors; an exit report is also kept.

        Raises:
            ForkServerError: The server closed its end, or ``deadline`` passed.
        """
        if deadline is not None:
            left_s = deadline - time.monotonic()
            if left_s <= 0 or not select.select([self._sock], [], [], left_s)[0]:
                raise ForkServerError(f"the fork server did not report {waiting_for} in time")
        data, fds, _, _ = socket.recv_fds(self._sock, 1 << 16, 4)
        if not data:
            self._gone = True
            raise ForkServerError(f"the fork server exited (code {self._proc.poll()})")
        doc = json.loads(data)
        if "exited" in doc:
            self._exits[int(doc["exited"])] = int(doc["code"])
        return doc, fds

    @property
    def gone(self) -> bool:
        """The server has ended (or closed its end): it forks nothing more."""
        return self._gone or self._proc.poll() is not None

    def exit_code(self, pid: int, deadline: float) -> int | None:
        """The exit code of ``pid``, which has ended, once the server reports it (``None``:
        not by ``deadline``). A server that is gone reports nothing more: its children died
        with it, by the SIGKILL it leaves them."""
        while pid not in self._exits and not self._closed:
            try:
                self._receive(deadline, f"the exit of process {pid}")
            except ForkServerError:
                if not self._gone:
                    return None
                break
        return self._exits.pop(pid, -signal.SIGKILL)

    def close(self, timeout_s: float = 5.0) -> None:
        """End the server: it exits when its socket closes, and any process it forked that
        still runs dies with it; SIGKILL after ``timeout_s``. The exits it reported until
        then are kept for :meth:`exit_code`."""
        if self._closed:
            return
        self.drain()
        self._closed = True
        self._sock.close()
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


class ForkedProcess:
    """A process forked by a :class:`ForkServer`, with the part of ``subprocess.Popen``'s
    interface the agent uses. Signals go through its pidfd: a pid the server reaped and the
    system reused is never signalled."""

    def __init__(
        self,
        server: ForkServer,
        pid: int,
        pidfd: int,
        stdout: IO[bytes] | None,
        stderr: IO[bytes] | None,
    ) -> None:
        self.pid = pid
        self.pidfd = pidfd
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None
        self._server = server

    def _ended(self, timeout_s: float | None) -> bool:
        waiter = select.poll()
        waiter.register(self.pidfd, select.POLLIN)
        return bool(waiter.poll(None if timeout_s is None else timeout_s * 1000))

    def poll(self) -> int | None:
        """The exit code, ``None`` while it runs."""
        if self.returncode is None and self._ended(0):
            self._collect()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for it to end (as ``Popen.wait``; ``subprocess.TimeoutExpired`` after
        ``timeout`` seconds) and return its exit code."""
        if self.returncode is None:
            if not self._ended(timeout):
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
            self._collect()
        assert self.returncode is not None
        return self.returncode

    def _collect(self) -> None:
        code = self._server.exit_code(self.pid, time.monotonic() + _EXIT_REPORT_TIMEOUT_S)
        if code is None:
            # It has ended (its pidfd says so); how is lost. A failure, not a crash of the node.
            logger.warning(
                "the fork server did not report the exit code of process %d within %.0fs: "
                "counted as 1",
                self.pid,
                _EXIT_REPORT_TIMEOUT_S,
            )
            code = 1
        self.returncode = code
        os.close(self.pidfd)
        self.pidfd = -1

    def send_signal(self, signum: int) -> None:
        """Send ``signum`` unless it has ended."""
        if self.returncode is None:
            try:
                signal.pidfd_send_signal(self.pidfd, signum)
            except ProcessLookupError:
                pass  # ended, not yet collected

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
