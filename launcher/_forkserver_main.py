"""The fork server of a node: one interpreter that imports torch once, then forks the ranks.

Run by :class:`launcher.forkserver.ForkServer` as ``python [options] _forkserver_main.py FD
MODULE...`` with the interpreter and the options of the job's own command, so that every
process forked from it is the process ``python [options] script.py`` would have been, minus
the seconds of importing torch. This file imports nothing but the standard library at its top:
it runs under the job's interpreter, which need not be the one that runs ``p2p-run``.

Protocol, on the ``SOCK_SEQPACKET`` socket ``FD`` (one JSON document per message):

- server -> agent ``{"ready": [loaded...], "failed": {module: error}}`` once the preload is done,
  with ``"unsafe": why`` if it loaded the CUDA driver (the agent then does without it);
- agent -> server ``{"spawn": {"id", "entry", "env", "cwd", "fds"}}`` with the descriptors to
  install (numbers ``fds``, in order) attached as ``SCM_RIGHTS``; ``entry`` is
  ``[script, args...]`` or ``["-m", module, args...]``;
- server -> agent ``{"started": pid, "id"}`` with the child's pidfd attached, or
  ``{"refused": why, "id"}``;
- server -> agent ``{"exited": pid, "code": code}`` once it reaped a child (``code`` as
  ``Popen.returncode``: negative for a signal).

The server ends when the agent closes the socket or dies (``PR_SET_PDEATHSIG``, set by the
agent); its children end with it the same way, as they would end with the agent.
"""

from __future__ import annotations

import builtins
import ctypes
import json
import os
import select
import signal
import socket
import sys
import types
import warnings
from typing import Any

_MAX_MESSAGE_BYTES = 4 << 20
_MAX_FDS = 16
_PR_SET_PDEATHSIG = 1
_THIS = os.path.realpath(__file__)


class _Child:
    """What a forked child runs: the server's loop returns one in the child only."""

    def __init__(self, entry: list[str]) -> None:
        self.entry = entry


def _preload(modules: list[str]) -> tuple[list[str], dict[str, str]]:
    loaded: list[str] = []
    failed: dict[str, str] = {}
    for name in modules:
        try:
            __import__(name)
        except Exception as e:  # a module the job's interpreter lacks: the ranks import it
            failed[name] = f"{type(e).__name__}: {e}"
        else:
            loaded.append(name)
    return loaded, failed


def _cuda_driver() -> str:
    """The CUDA driver library this process has loaded (``""``: none). CUDA does not survive a
    fork: once a module has called into it, the children could not use the GPU."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                if os.path.basename(path).startswith("libcuda.so"):
                    return path
    except OSError:
        pass
    return ""


def _send(sock: socket.socket, doc: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(doc).encode()
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.send(data)


def _serve(sock: socket.socket) -> _Child:
    """Fork a child per request and report every exit, until the agent goes (then exit).
    Returns in a forked child only, with what it runs."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # its wake-up byte is what counts
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    poller.register(wake_r, select.POLLIN)
    while True:
        # No deadline: serving its agent is this process's whole life, and it ends with it.
        for fd, _ in poller.poll():
            if fd == wake_r:
                while True:
                    try:
                        if not os.read(wake_r, 4096):
                            break
                    except BlockingIOError:
                        break
                _reap(sock)
                continue
            try:
                data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE_BYTES, _MAX_FDS)
            except ConnectionError:
                data, fds = b"", []
            if not data:
                sys.exit(0)  # the agent closed its end: the node is done
            child = _fork(sock, data, fds, (wake_r, wake_w))
            if child is not None:
                return child


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _fork(sock: socket.socket, data: bytes, fds: list[int], wake: tuple[int, int]) -> _Child | None:
    request = None
    try:
        spec = json.loads(data)["spawn"]
        request = spec.get("id")
        entry = [str(a) for a in spec["entry"]]
        env = {str(k): str(v) for k, v in spec["env"].items()}
        cwd = str(spec["cwd"])
        targets = [int(t) for t in spec["fds"]]
        if not entry:
            raise ValueError("nothing to run")
        if len(targets) != len(fds):
            raise ValueError(f"{len(fds)} descriptors came for {len(targets)} targets")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        for fd in fds:
            os.close(fd)
        _send(sock, {"refused": f"a malformed request: {e}", "id": request})
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        with warnings.catch_warnings():
            # Python 3.12+ warns of fork() in a process with threads: torch's import leaves one,
            # idle on a futex, that the child neither inherits nor needs.
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
    except OSError as e:  # out of processes or memory: this request fails, the server serves on
        pid = -1
        _send(sock, {"refused": f"fork failed: {e}", "id": request})
    if pid == 0:
        _become_child(sock, fds, targets, env, cwd, wake)
        return _Child(entry)
    for fd in fds:
        os.close(fd)
    if pid > 0:
        pidfd = os.pidfd_open(pid)
        try:
            _send(sock, {"started": pid, "id": request}, [pidfd])
        finally:
            os.close(pidfd)
    return None


def _become_child(
    sock: socket.socket,
    fds: list[int],
    targets: list[int],
    env: dict[str, str],
    cwd: str,
    wake: tuple[int, int],
) -> None:
    """In the forked child: end with the server, restore what a fresh interpreter has, and put
    the descriptors, environment and directory it was given in place."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    server = os.getppid()
    prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != server:  # the server died before the request took effect
        os._exit(128 + signal.SIGKILL)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for fd in wake:
        os.close(fd)
    os.close(sock.detach())
    # Above every target first, so that no dup2 below overwrites a descriptor still needed.
    floor = max([*targets, *fds, 2]) + 1
    moved = []
    for fd in fds:
        if fd < floor:
            above = _dup_above(fd, floor)
            os.close(fd)
            fd = above
        moved.append(fd)
    for fd, target in zip(moved, targets):
        os.dup2(fd, target)  # inheritable, as Popen's pass_fds are
        os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for stream in (sys.stdout, sys.stderr):
        # A fresh interpreter buffers lines only on a terminal.
        stream.reconfigure(line_buffering=stream.isatty())  # type: ignore[union-attr]
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        # Seeded when the server imported it: every child would draw the same numbers.
        np_random.seed()


def _dup_above(fd: int, floor: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_DUPFD, floor)


def _main_module(path: str | None) -> types.ModuleType:
    """A fresh ``__main__``, as the interpreter makes for a script (``path``) or ``-m``."""
    main = types.ModuleType("__main__")
    vars(main).update(__builtins__=builtins, __annotations__={})
    if path is not None:
        import importlib.machinery

        main.__file__ = path
        main.__cached__ = None  # type: ignore[attr-defined]
        main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    sys.modules["__main__"] = main
    return main


def _run(entry: list[str]) -> None:
    """Run ``entry`` as ``python [options] *entry`` runs it."""
    prepend = not (sys.flags.isolated or getattr(sys.flags, "safe_path", False))
    orig = getattr(sys, "orig_argv", None)  # Python 3.10+: the interpreter's own command line
    if orig is not None:
        server = next(i for i, a in enumerate(orig) if os.path.realpath(a) == _THIS)
        sys.orig_argv = [*orig[:server], *entry]
    if entry[0] == "-m":
        sys.argv = ["-m", *entry[2:]]
        if prepend:
            sys.path.insert(0, os.getcwd())
        _main_module(None)
        _as_uncaught(_run_module, entry[1])
        return
    path = entry[0]
    sys.argv = list(entry)
    if prepend:
        sys.path.insert(0, os.path.dirname(os.path.realpath(path)))
    try:
        with open(path, "rb") as f:
            source = f.read()
    except OSError as e:
        print(f"{sys.executable}: can't open file {path!r}: {e}", file=sys.stderr)
        sys.exit(2)
    code = compile(source, path, "exec", dont_inherit=True)
    _as_uncaught(exec, code, _main_module(path).__dict__)


def _run_module(name: str) -> None:
    import runpy

    runpy._run_module_as_main(name)  # type: ignore[attr-defined]  # what -m runs


def _as_uncaught(run: Any, *args: Any) -> None:
    """Call ``run``; an exception it raises is reported as the interpreter reports an uncaught
    one (``sys.excepthook``, exit code 1), without this file's frames."""
    try:
        run(*args)
    except (SystemExit, KeyboardInterrupt):
        raise  # the interpreter's own handling: an exit code, or death by SIGINT
    except BaseException as e:
        tb = e.__traceback__
        while tb is not None and os.path.realpath(tb.tb_frame.f_code.co_filename) == _THIS:
            tb = tb.tb_next
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        sys.exit(1)


def main() -> None:
    if sys.path and os.path.realpath(sys.path[0] or ".") == os.path.dirname(_THIS):
        sys.path.pop(0)  # this folder must not shadow what the preload or the ranks import
    sock = socket.socket(fileno=int(sys.argv[1]))
    # Ctrl-C reaches the whole process group: the agent decides what happens, not this process.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    loaded, failed = _preload(sys.argv[2:])
    doc: dict[str, Any] = {"ready": loaded, "failed": failed}
    driver = _cuda_driver()
    if driver:
        doc["unsafe"] = (
            f"its imports loaded the CUDA driver ({driver}): a process forked from it could "
            "not use the GPU"
        )
    _send(sock, doc)
    child = _serve(sock)
    _run(child.entry)


if __name__ == "__main__":
    main()
