"""Where the processes' standard streams go: torchrun's ``--log-dir``, ``--redirects``,
``--tee`` and ``--local-ranks-filter``, with torchrun's meanings.

By default every process a node starts writes to p2p-run's own stdout and stderr.
``--redirects`` sends a stream to a file instead, ``<node folder>/<process>/stdout.log`` (and
``stderr.log``), where the node folder is ``<log-dir>/<job-id>/node<N>_<start time>`` (one per
p2p-run, so a rerun never overwrites the last run's logs); ``--tee`` sends it to both, the
console's copy prefixed line by line with the process's name (``[rank3]:``, as torchrun
prefixes with ``--role`` and the local rank). ``--local-ranks-filter`` keeps only the listed
local ranks on the console: a filtered stream that is kept in a file is not shown, one that is
not is discarded. Each takes torchrun's form: ``3`` (both streams, every process), ``1``
(stdout), ``2`` (stderr), ``0`` (none), or per local rank, ``0:3,1:2``. A spare's local rank
is its slot after the node's ranks until it takes a rank; from then on its console lines are
named and filtered as that rank's (:meth:`Streams.moved`).

Tee'd streams reach the agent through pipes that its event loop polls beside everything else
(:class:`Streams`): no thread is added, and a process's last lines are read after it exits.
"""

from __future__ import annotations

import json
import os
import select
import stat
import string
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from launcher.config import setting
from launcher.forkserver import ChildProcess

#: Where torchrun reads its console prefix template from.
LINE_PREFIX_ENV = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"
#: torchrun's stream bits.
OUT, ERR = 1, 2
STREAM_NAMES = {OUT: "stdout", ERR: "stderr"}
#: A tee'd line longer than this reaches the console in pieces (the read buffer stays bounded).
_LINE_LIMIT_BYTES = 64 * 1024
_READ_BYTES = 64 * 1024
#: The most one pipe is read before the agent's loop goes on (1 MiB: a few milliseconds).
_TURN_BYTES = 16 * _READ_BYTES
#: Console output waiting for a console that does not keep up (a terminal paused with Ctrl-S, a
#: pipe nobody reads) is kept up to this much per stream, the oldest lines dropped first: the
#: agent never blocks on its console, since the same loop sends the node's heartbeats.
CONSOLE_BACKLOG_BYTES = 4 * 1024 * 1024


def parse_streams(text: str, flag: str) -> tuple[int, dict[int, int]]:
    """torchrun's stream selection: ``3`` for every process, or ``0:1,1:2`` per local rank.

    Returns:
        The streams (``OUT | ERR`` bits) of every process, and those given per local rank
        (the processes not listed then get none).

    Raises:
        ValueError: ``text`` is neither form.
    """
    fix = f"{flag} takes 0 (none), 1 (stdout), 2 (stderr) or 3 (both), or per local rank 0:3,1:2"
    text = text.strip()
    if text in ("0", "1", "2", "3"):
        return int(text), {}
    per_rank: dict[int, int] = {}
    for part in text.split(","):
        rank, sep, bits = part.strip().partition(":")
        if not sep or not rank.isdigit() or bits not in ("0", "1", "2", "3"):
            raise ValueError(f"{flag} {text!r}: {fix}")
        if int(rank) in per_rank:
            raise ValueError(f"{flag} {text!r}: local rank {rank} is given twice")
        per_rank[int(rank)] = int(bits)
    return 0, per_rank


def parse_local_ranks(text: str) -> frozenset[int]:
    """``--local-ranks-filter``'s ``0,1,2`` (empty: every local rank is shown).

    Raises:
        ValueError: not comma-separated integers.
    """
    if not text.strip():
        return frozenset()
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() for p in parts):
        raise ValueError(f"--local-ranks-filter {text!r} is not a list of local ranks like 0,1,2")
    return frozenset(int(p) for p in parts)


@dataclass(frozen=True, slots=True)
class Route:
    """Where one stream of one process goes."""

    file: bool
    """Into the process's log file."""
    console: bool
    """To p2p-run's console."""
    tee: bool
    """Tee'd: its console lines carry the process's name (``[rank3]:``), as torchrun's do."""


@dataclass(frozen=True, slots=True, kw_only=True)
class OutputConfig:
    """Where the processes' streams go (the flags torchrun has for it)."""

    log_dir: str | None = setting(
        None,
        flag=("--log-dir", "--log_dir"),
        help="base directory of the processes' log files (--redirects, --tee): each node "
        "writes under <log-dir>/<job-id>/node<N>_<start time>/ (default <run-dir>/logs)",
    )
    redirects: str = setting(
        "0",
        flag=("--redirects", "-r"),
        help="send streams to log files instead of the console, as torchrun's: 3 both, "
        "1 stdout, 2 stderr, or per local rank 0:3,1:2 (default {default})",
    )
    tee: str = setting(
        "0",
        flag=("--tee", "-t"),
        help="send streams to log files and to the console, each line prefixed with the "
        "process's name ([rank3]:); torchrun's form, as --redirects (default {default})",
    )
    local_ranks_filter: str = setting(
        "",
        flag=("--local-ranks-filter", "--local_ranks_filter"),
        help="show only these local ranks' output on the console (e.g. 0,1); log files keep "
        "everything",
    )
    role: str = setting(
        "rank",
        flag="--role",
        help="the name a rank's console prefix starts with ([rank3]:; default {default})",
    )
    line_prefix: str | None = setting(
        None,
        flag="--log-line-prefix-template",
        help="the console prefix of tee'd lines, with ${role_name}, ${rank} (global) and "
        "${local_rank}, as torchrun's (default: $" + LINE_PREFIX_ENV + ", else [<role><rank>]:)",
    )

    def __post_init__(self) -> None:
        parse_streams(self.redirects, "--redirects")
        parse_streams(self.tee, "--tee")
        parse_local_ranks(self.local_ranks_filter)
        if not self.role or any(c in self.role for c in "/\n[]") or self.role.isspace():
            raise ValueError(f"--role {self.role!r} must be a plain name such as rank")
        if self.line_prefix is not None and ("\n" in self.line_prefix or "\r" in self.line_prefix):
            raise ValueError(
                "--log-line-prefix-template (or $" + LINE_PREFIX_ENV + ") must be one line, "
                "such as '[${role_name}${rank}]:'"
            )

    def header(self, name: str, local_rank: int, rank: int | None) -> bytes:
        """What each tee'd console line of process ``name`` starts with: ``[name]:``, or
        the template filled in as torchrun fills it (a spare's ``${rank}`` is its name until
        it takes a rank)."""
        if self.line_prefix is None:
            return f"[{name}]:".encode()
        fields = {"role_name": self.role, "rank": name if rank is None else rank}
        template = string.Template(self.line_prefix)
        return template.safe_substitute(fields, local_rank=local_rank).encode()

    def routes(self, local_rank: int) -> dict[int, Route]:
        """Where each stream of the process in local slot ``local_rank`` goes (torchrun's
        rules: a tee'd stream is also a redirected one; the filter hides the console's)."""
        every, per_rank = parse_streams(self.redirects, "--redirects")
        tee_every, tee_per_rank = parse_streams(self.tee, "--tee")
        tee = tee_per_rank.get(local_rank, tee_every)
        redirected = per_rank.get(local_rank, every) | tee
        shown = parse_local_ranks(self.local_ranks_filter)
        on_console = not shown or local_rank in shown
        routes = {}
        for stream in (OUT, ERR):
            teed, file = bool(tee & stream), bool(redirected & stream)
            routes[stream] = Route(file=file, console=on_console and (teed or not file), tee=teed)
        return routes

    def shown(self, local_rank: int) -> bool:
        """Whether ``--local-ranks-filter`` lets local rank ``local_rank`` on the console."""
        shown = parse_local_ranks(self.local_ranks_filter)
        return not shown or local_rank in shown

    def writes_files(self) -> bool:
        """Whether any process writes a log file."""
        specs = [parse_streams(self.redirects, "--redirects"), parse_streams(self.tee, "--tee")]
        return any(every or any(per_rank.values()) for every, per_rank in specs)


#: The largest error file read (torchrun's ``@record`` writes the exception and its traceback).
_ERROR_FILE_BYTES = 256 * 1024


def error_file(log_dir: str | None, run_dir: str, name: str, identity: str) -> Path:
    """Where process ``name`` (``identity``) records the exception that ends it
    (``TORCHELASTIC_ERROR_FILE``, written by torch's ``@record``): beside its log files, as
    torchrun puts it, else under ``<run-dir>/errors``. Any file left there by an earlier run
    is removed, so that an exit is never blamed on an old error."""
    if log_dir is not None:
        path = Path(log_dir) / name / "error.json"
    else:
        path = Path(run_dir) / "errors" / (identity.replace("/", "-") + ".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    return path


def read_error_file(path: Path, limit_chars: int) -> str:
    """The exception a process recorded at ``path`` (``"ValueError: bad lr"``), on one line
    and at most ``limit_chars`` long; empty if it recorded none or the file is not torch's."""
    try:
        with open(path, "rb") as f:
            data = f.read(_ERROR_FILE_BYTES + 1)
    except OSError:
        return ""
    if len(data) > _ERROR_FILE_BYTES:
        return ""
    try:
        message = json.loads(data).get("message")
    except (ValueError, AttributeError):
        return ""
    if isinstance(message, dict):  # {"message": "...", "extraInfo": {...}}
        message = message.get("message")
    if not isinstance(message, str):
        return ""
    line = " ".join(message.split())
    return line if len(line) <= limit_chars else line[: limit_chars - 3] + "..."


def node_log_dir(base: Path, job_id: str, node_rank: int) -> Path:
    """Make this node's folder of log files, one per p2p-run (``node<N>_<start time>``,
    with ``_2``, ``_3``, ... after it when a run started the same second)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    parent = base / job_id
    parent.mkdir(parents=True, exist_ok=True)
    for n in range(1, 1000):
        path = parent / (f"node{node_rank}_{stamp}" + (f"_{n}" if n > 1 else ""))
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"{parent}: 999 log folders of node {node_rank} started at {stamp}")


class Console:
    """One of p2p-run's console streams, written only as fast as it takes the bytes.

    A terminal or a pipe is written through a descriptor of its own opened non-blocking (the
    one p2p-run inherited is shared with the processes that print to the console directly,
    whose writes must keep blocking); a regular file never holds a write up. Writes are whole
    lines of up to ``PIPE_BUF`` bytes, which a pipe takes whole or not at all, so lines dropped
    for a console that does not keep up never leave half a line behind them.

    Args:
        fd: The console's descriptor (p2p-run's stdout or stderr).
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._own = False
        mode = os.fstat(fd).st_mode
        if stat.S_ISCHR(mode) or stat.S_ISFIFO(mode):
            try:
                self.fd = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
                self._own = True
            except OSError:  # written when poll says it takes bytes, PIPE_BUF at a time
                pass
        self._poll = select.poll()
        self._poll.register(self.fd, select.POLLOUT)
        self.backlog = bytearray()
        self.dropped_bytes = 0
        self.broken = False
        self._at_line_start = True
        """The console's last byte ended a line (only a line over ``PIPE_BUF`` leaves one
        open)."""

    @property
    def waiting(self) -> bool:
        """Whether bytes wait for the console to take them."""
        return bool(self.backlog) and not self.broken

    def write(self, data: bytes) -> None:
        """Queue ``data`` and write what the console takes now."""
        if self.broken:
            return
        self.backlog += data
        excess = len(self.backlog) - CONSOLE_BACKLOG_BYTES
        if excess > 0:
            cut = self.backlog.find(b"\n", excess)
            cut = len(self.backlog) if cut < 0 else cut + 1
            del self.backlog[:cut]
            self.dropped_bytes += cut
        self.flush()

    def flush(self) -> None:
        """Write what the console takes now, without blocking."""
        while self.waiting and self._poll.poll(0):
            if self.dropped_bytes:
                self.backlog[:0] = (b"" if self._at_line_start else b"\n") + (
                    f"p2p-run: {self.dropped_bytes} bytes of the processes' output were not "
                    "shown: the console did not keep up (log files keep everything)\n"
                ).encode()
                self.dropped_bytes = 0
            chunk = self.backlog[: select.PIPE_BUF]
            if (end := chunk.rfind(b"\n")) >= 0:
                chunk = chunk[: end + 1]
            try:
                written = os.write(self.fd, chunk)
            except BlockingIOError:
                return
            except OSError:  # the console is gone (p2p-run ... | head): nothing to show
                self.broken = True
                self.backlog.clear()
                return
            self._at_line_start = self.backlog[written - 1 : written] == b"\n"
            del self.backlog[:written]

    def close(self, timeout_s: float) -> None:
        """Write what waits, for at most ``timeout_s`` (the rest is dropped)."""
        deadline = time.monotonic() + timeout_s
        while self.waiting and (left_s := deadline - time.monotonic()) > 0:
            self._poll.poll(int(left_s * 1000) + 1)
            self.flush()
        if self._own:
            os.close(self.fd)


@dataclass(slots=True)
class _Pipe:
    """One stream the agent reads: its pipe's read end, its log file and its console."""

    fd: int
    name: str
    file: BinaryIO | None
    console: Console
    shown: bool
    tee: bool
    header: bytes
    partial: bytearray = field(default_factory=bytearray)

    @property
    def prefix(self) -> bytes:
        return self.header if self.tee else b""


class Streams:
    """The agent's side of its processes' streams: what each is started with, and the pipes
    it reads (tee'd streams, and a spare's under ``--local-ranks-filter``).

    Args:
        config: Where streams go.
        log_dir: This node's folder of log files (``None``: no file is needed).
        console: The descriptors of the console's stdout and stderr (p2p-run's own by
            default).
    """

    def __init__(
        self,
        config: OutputConfig,
        log_dir: str | None,
        console: dict[int, int] | None = None,
    ) -> None:
        self.config = config
        self.log_dir = log_dir
        fds = console or {OUT: sys.stdout.fileno(), ERR: sys.stderr.fileno()}
        self._console_fds = fds
        self._consoles: dict[int, Console] = {}
        """Opened when a pipe first needs one."""
        self._pipes: dict[int, _Pipe] = {}

    def start(
        self,
        name: str,
        local_rank: int,
        popen: Callable[..., ChildProcess],
        *,
        rank: int | None = None,
        movable: bool = False,
    ) -> ChildProcess:
        """Start process ``name`` with ``popen(stdout=..., stderr=...)``, its streams routed.

        Args:
            name: The process's name: its folder of log files and its console prefix.
            local_rank: Its local slot (a spare's comes after the node's ranks).
            rank: Its global rank (``None``: a spare).
            popen: Starts it, given ``subprocess.Popen``'s ``stdout`` and ``stderr``.
            movable: A process that may take another rank (:meth:`moved`): a spare, or any
                rank of a job that may resize. Under ``--local-ranks-filter`` its console
                then follows that rank's, so its streams come through the agent.
        """
        movable = movable and bool(parse_local_ranks(self.config.local_ranks_filter))
        routes = self.config.routes(local_rank)
        args: dict[str, Any] = {}
        piped: dict[int, BinaryIO | None] = {}  # the streams read here, with their files
        handed: list[BinaryIO] = []  # the files the child writes itself
        try:
            for stream, route in routes.items():
                key = STREAM_NAMES[stream]
                file = self._open(name, stream) if route.file else None
                if (route.tee and (route.console or movable)) or (file is None and movable):
                    args[key] = subprocess.PIPE
                    piped[stream] = file
                elif file is not None:
                    args[key] = file
                    handed.append(file)
                else:
                    args[key] = None if route.console else subprocess.DEVNULL
            proc = popen(**args)
        except BaseException:
            for f in piped.values():
                if f is not None:
                    f.close()
            raise
        finally:
            for f in handed:  # the child has its own copies
                f.close()
        for stream, pipe in ((OUT, proc.stdout), (ERR, proc.stderr)):
            if pipe is None:
                continue
            fd = os.dup(pipe.fileno())  # the Popen's file object is closed: only fd is read
            pipe.close()
            os.set_blocking(fd, False)
            route = routes[stream]
            header = self.config.header(name, local_rank, rank)
            self._pipes[fd] = _Pipe(
                fd, name, piped[stream], self._console(stream), route.console, route.tee, header
            )
        return proc

    def moved(self, name: str, new_name: str, local_rank: int, rank: int) -> None:
        """Process ``name`` (a spare) has taken ``rank``, named ``new_name``, in local slot
        ``local_rank``: its console lines are named so, and shown as that slot's are."""
        for pipe in self._pipes.values():
            if pipe.name == name:
                pipe.name = new_name
                pipe.header = self.config.header(new_name, local_rank, rank)
                pipe.shown = self.config.shown(local_rank) and (pipe.tee or pipe.file is None)

    def fds(self) -> list[int]:
        """The pipes to poll for reading."""
        return list(self._pipes)

    def consoles_waiting(self) -> list[int]:
        """The console descriptors to poll for writing (bytes wait for them)."""
        return [c.fd for c in self._consoles.values() if c.waiting]

    def write_console(self, fd: int) -> None:
        """Console ``fd`` takes bytes: write what it takes."""
        for console in self._consoles.values():
            if console.fd == fd:
                console.flush()

    def __contains__(self, fd: object) -> bool:
        """Whether ``fd`` is a pipe read here."""
        return fd in self._pipes

    def read(self, fd: int) -> None:
        """Copy what pipe ``fd`` holds, up to ``_TURN_BYTES``, to its file and its console; at
        its end, close it. Bounded: a process that writes faster than this copies must not
        keep the agent's loop (and its heartbeats) here; the loop comes back for the rest."""
        pipe = self._pipes[fd]
        for _ in range(_TURN_BYTES // _READ_BYTES):
            try:
                data = os.read(fd, _READ_BYTES)
            except (BlockingIOError, InterruptedError):
                return
            if not data:
                self._close(pipe)
                return
            if pipe.file is not None:
                pipe.file.write(data)
                pipe.file.flush()
            if pipe.shown:
                self._to_console(pipe, data)

    def drain(self) -> None:
        """Read every pipe once more (a turn's worth each)."""
        for fd in list(self._pipes):
            self.read(fd)

    def close(self, console_timeout_s: float = 2.0) -> None:
        """Read what is left and close every pipe and file (a pipe a process's own child
        still holds open is closed on this side); give the console up to
        ``console_timeout_s`` to take what waits for it."""
        self.drain()
        for pipe in list(self._pipes.values()):
            self._close(pipe)
        for console in self._consoles.values():
            console.close(console_timeout_s)
        self._consoles.clear()

    # -- helpers ---------------------------------------------------------------------------------

    def _open(self, name: str, stream: int) -> BinaryIO:
        assert self.log_dir is not None, "a route to a file needs the node's log folder"
        folder = Path(self.log_dir) / name
        folder.mkdir(parents=True, exist_ok=True)
        return open(folder / f"{STREAM_NAMES[stream]}.log", "ab")

    def _console(self, stream: int) -> Console:
        if stream not in self._consoles:
            self._consoles[stream] = Console(self._console_fds[stream])
        return self._consoles[stream]

    def _to_console(self, pipe: _Pipe, data: bytes) -> None:
        pipe.partial += data
        lines = list(_lines(pipe.partial))
        if lines:
            pipe.console.write(b"".join(pipe.prefix + line for line in lines))

    def _close(self, pipe: _Pipe) -> None:
        del self._pipes[pipe.fd]
        if pipe.partial and pipe.shown:
            pipe.console.write(pipe.prefix + bytes(pipe.partial) + b"\n")
        os.close(pipe.fd)
        if pipe.file is not None:
            pipe.file.close()


def _lines(buffer: bytearray) -> Iterator[bytes]:
    """Take the complete lines out of ``buffer`` (and pieces of any over the limit)."""
    while True:
        end = buffer.find(b"\n")
        if end < 0:
            if len(buffer) < _LINE_LIMIT_BYTES:
                return
            end = _LINE_LIMIT_BYTES - 1
            yield bytes(buffer[: end + 1]) + b"\n"
        else:
            yield bytes(buffer[: end + 1])
        del buffer[: end + 1]
