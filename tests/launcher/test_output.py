"""Where the processes' streams go: torchrun's --log-dir, --redirects, --tee and
--local-ranks-filter, from their rules to p2p-run's console and files."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from launcher.output import ERR, OUT, OutputConfig, Route, Streams, parse_streams

CHATTY = str(Path(__file__).parent / "scripts" / "chatty.py")
C = Route(file=False, console=True, tee=False)  # p2p-run's own console
D = Route(file=False, console=False, tee=False)  # discarded
F = Route(file=True, console=False, tee=False)  # the log file only
T = Route(file=True, console=True, tee=True)  # both, console lines prefixed
H = Route(file=True, console=False, tee=True)  # tee'd, but filtered off the console


@pytest.mark.parametrize(
    "text, parsed",
    [("0", (0, {})), ("3", (3, {})), ("0:1,1:2", (0, {0: 1, 1: 2})), (" 2:3 ", (0, {2: 3}))],
)
def test_stream_selections_read_as_torchrun_reads_them(text, parsed):
    assert parse_streams(text, "--tee") == parsed


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tee": "4"}, "--tee '4': --tee takes 0 (none), 1 (stdout)"),
        ({"redirects": "0:1,x:2"}, "--redirects '0:1,x:2'"),
        ({"redirects": "0:1,0:2"}, "--redirects '0:1,0:2': local rank 0 is given twice"),
        ({"local_ranks_filter": "0,one"}, "--local-ranks-filter '0,one' is not a list"),
        ({"role": "a/b"}, "--role 'a/b' must be a plain name"),
    ],
)
def test_bad_selections_are_refused_with_the_flag_named(kwargs, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        OutputConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, local_rank, out, err",
    [
        ({}, 0, C, C),  # the default: p2p-run's own console
        ({"redirects": "3"}, 0, F, F),
        ({"redirects": "1"}, 1, F, C),
        ({"tee": "3"}, 0, T, T),
        ({"tee": "2", "redirects": "1"}, 0, F, T),  # a tee'd stream is also redirected
        ({"redirects": "0:3,1:2"}, 1, C, F),
        ({"redirects": "0:3"}, 1, C, C),  # a rank not listed gets none
        ({"tee": "3", "local_ranks_filter": "0"}, 0, T, T),
        ({"tee": "3", "local_ranks_filter": "0"}, 1, H, H),  # kept in files, not shown
        ({"local_ranks_filter": "0"}, 1, D, D),  # neither shown nor kept: as torchrun
        ({"tee": "1", "local_ranks_filter": "1"}, 0, H, D),
    ],
)
def test_routes_follow_torchruns_rules(kwargs, local_rank, out, err):
    assert OutputConfig(**kwargs).routes(local_rank) == {OUT: out, ERR: err}


def test_files_are_needed_only_when_a_stream_goes_to_one():
    assert not OutputConfig().writes_files()
    assert not OutputConfig(local_ranks_filter="0").writes_files()
    assert OutputConfig(tee="0:0,3:2").writes_files()
    assert OutputConfig(redirects="1").writes_files()


class _Console:
    """p2p-run's stdout and stderr for a test: regular files, which never hold a write up."""

    def __init__(self, folder: Path) -> None:
        self.paths = {OUT: folder / "console.out", ERR: folder / "console.err"}
        self.fds = {k: os.open(p, os.O_WRONLY | os.O_CREAT, 0o600) for k, p in self.paths.items()}

    def read(self, stream: int) -> bytes:
        return self.paths[stream].read_bytes()

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


def _agent(tmp_path: Path, **config: Any):
    """An agent of a 1-node job, in this process, whose coordinator is never there."""
    from launcher.agent import Agent, AgentConfig
    from launcher.secret import create_once

    create_once(tmp_path / "secret")
    defaults = dict(nproc_per_node=1, command=("true",), run_dir=str(tmp_path), spares=0)
    return Agent(
        AgentConfig(
            node_rank=0,
            nnodes=1,
            coordinator="127.0.0.1:1",
            job_id="j",
            secret_file=str(tmp_path / "secret"),
            **{**defaults, **config},
        )
    )


def _serve(streams: Streams, deadline_s: float = 60.0) -> None:
    """The agent's part: read the pipes and write the consoles until every pipe has closed."""
    deadline = time.monotonic() + deadline_s
    while streams.fds():
        consoles = streams.consoles_waiting()
        left_s = deadline - time.monotonic()
        assert left_s > 0, "the child's pipes went silent without closing"
        readable, writable, _ = select.select(streams.fds(), consoles, [], left_s)
        for fd in readable:
            streams.read(fd)
        for fd in writable:
            streams.write_console(fd)


def _start(streams: Streams, name: str, local_rank: int, code: str) -> subprocess.Popen[bytes]:
    return streams.start(
        name, local_rank, functools.partial(subprocess.Popen, [sys.executable, "-c", code])
    )


def test_tee_copies_every_byte_to_the_file_and_prefixed_lines_to_the_console(tmp_path):
    """A real child writing through real pipes: more than a pipe holds, a line longer than
    the console's line limit, and a last line with no newline."""
    console = _Console(tmp_path)
    streams = Streams(OutputConfig(tee="3"), str(tmp_path), console.fds)
    code = (
        "import sys\n"
        "sys.stdout.write(''.join(f'{i:07d}\\n' for i in range(40000)))\n"
        "sys.stdout.write('y' * 100000 + '\\n')\n"
        "sys.stderr.write('a warning\\nno newline')\n"
    )
    proc = _start(streams, "rank7", 0, code)
    assert len(streams.fds()) == 2
    _serve(streams)
    assert proc.wait(timeout=30) == 0
    streams.close()
    console.close()
    expected_out = "".join(f"{i:07d}\n" for i in range(40000)) + "y" * 100000 + "\n"
    assert (tmp_path / "rank7" / "stdout.log").read_text() == expected_out
    assert (tmp_path / "rank7" / "stderr.log").read_text() == "a warning\nno newline"
    out_lines = console.read(OUT).split(b"\n")
    assert out_lines[0] == b"[rank7]:0000000" and out_lines[39999] == b"[rank7]:0039999"
    # The long line reaches the console in bounded pieces, each prefixed.
    pieces = out_lines[40000:-1]
    assert len(pieces) == 2 and all(p.startswith(b"[rank7]:y") for p in pieces)
    assert sum(len(p) - len(b"[rank7]:") for p in pieces) == 100000
    assert console.read(ERR) == b"[rank7]:a warning\n[rank7]:no newline\n"


def test_a_stream_sent_to_a_file_reaches_only_the_file(tmp_path):
    console = _Console(tmp_path)
    config = OutputConfig(redirects="1", local_ranks_filter="0")
    streams = Streams(config, str(tmp_path), console.fds)
    proc = _start(streams, "spare0-3", 2, "import sys; print('out'); print('err', file=sys.stderr)")
    assert streams.fds() == [] and proc.wait(timeout=30) == 0
    assert (tmp_path / "spare0-3" / "stdout.log").read_text() == "out\n"
    assert not (tmp_path / "spare0-3" / "stderr.log").exists()  # filtered out: discarded
    streams.close()
    console.close()
    assert console.read(OUT) == console.read(ERR) == b""


def test_a_prefix_template_is_filled_in_as_torchrun_fills_it():
    config = OutputConfig(line_prefix="[${role_name}${rank}|${local_rank}|${host}] ", role="t")
    assert config.header("t3", 1, 3) == b"[t3|1|${host}] ", "an unknown name is left as is"
    assert config.header("spare0-5", 2, None) == b"[tspare0-5|2|${host}] "
    assert OutputConfig().header("rank3", 1, 3) == b"[rank3]:"
    with pytest.raises(ValueError, match="must be one line"):
        OutputConfig(line_prefix="${rank}\n")


def test_a_spare_that_takes_a_rank_gets_that_ranks_prefix(tmp_path):
    console = _Console(tmp_path)
    config = OutputConfig(tee="1", line_prefix="${rank}:${local_rank}> ")
    streams = Streams(config, str(tmp_path), console.fds)
    proc = _start(streams, "spare0-3", 2, "print('restored'); print('step 5')")
    streams.moved("spare0-3", "rank1", 1, 5)  # before a line of it is read
    _serve(streams)
    assert proc.wait(timeout=30) == 0
    streams.close()
    console.close()
    assert console.read(OUT) == b"5:1> restored\n5:1> step 5\n"


@pytest.mark.parametrize("resizes", [False, True])
def test_a_rank_renumbered_into_the_filtered_slot_is_shown_when_the_job_can_resize(
    tmp_path, resizes
):
    """--local-ranks-filter 0: rank 1 (slot 1) is hidden. A job that may shrink can renumber
    it rank 0 (rank 0 lost, no spare); its lines must then reach the console as rank 0's,
    so its streams come through the agent from the start. A fixed-size job never renumbers:
    its hidden ranks write their files themselves."""
    agent = _agent(
        tmp_path,
        nproc_per_node=2,
        command=(sys.executable, "-c", "print('restored step 5')"),
        resizes=resizes,
        output=OutputConfig(tee="3", local_ranks_filter="0"),
        log_dir=str(tmp_path / "logs"),
    )
    console = _Console(tmp_path)
    agent.streams = Streams(agent.config.output, agent.config.log_dir, console.fds)
    try:
        agent._spawn("rank", 1, 1)
        (child,) = agent.children.values()
        assert bool(agent.streams.fds()) == resizes
        agent._assigned(child, 0)  # before a line of it is read
        _serve(agent.streams)
        assert child.proc.wait(timeout=30) == 0
    finally:
        for child in agent.children.values():
            child.channel.close()
            os.close(child.pidfd)
        agent.streams.close()
        console.close()
    assert console.read(OUT) == (b"[rank0]:restored step 5\n" if resizes else b"")
    assert (tmp_path / "logs" / "rank1" / "stdout.log").read_text() == "restored step 5\n"


LINES = 160000  # 8 MiB of 52-byte lines: twice the console's backlog


def test_a_console_nobody_reads_never_holds_up_the_agent_or_the_ranks(tmp_path):
    """A terminal paused with Ctrl-S or a pipe nobody reads: the agent, whose loop also sends
    the heartbeats, must not block on it, and the ranks must not block on their pipes."""
    read_end, write_end = os.pipe()
    streams = Streams(OutputConfig(tee="1"), str(tmp_path), {OUT: write_end, ERR: write_end})
    code = f"import sys\nfor i in range({LINES}): sys.stdout.write(f'{{i:051d}}\\n')"
    proc = _start(streams, "rank0", 0, code)
    _serve(streams)  # the child's 8 MiB all read, with the console taking none of it
    assert proc.wait(timeout=30) == 0
    # Every byte is in the file; the console keeps a bounded backlog of the latest lines.
    log = (tmp_path / "rank0" / "stdout.log").read_bytes()
    assert log == b"".join(b"%051d\n" % i for i in range(LINES))
    (waiting,) = streams.consoles_waiting()
    # Now the console reads again: it gets what the pipe held, a note, then the latest lines.
    os.set_blocking(read_end, False)
    shown = bytearray()

    def drain() -> None:
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(read_end, 1 << 16):
                shown.extend(chunk)

    while streams.consoles_waiting():
        drain()  # the console reads what the pipe holds, and so makes room
        _, writable, _ = select.select([], streams.consoles_waiting(), [], 10)
        assert writable == [waiting], "the console never took more"
        streams.write_console(waiting)
    drain()
    streams.close()
    lines = bytes(shown).split(b"\n")
    (note,) = [i for i, line in enumerate(lines) if line.startswith(b"p2p-run:")]
    assert b"bytes of the processes' output were not shown" in lines[note]
    prefix = b"[rank0]:"
    assert lines[0] == prefix + b"%051d" % 0 and lines[-2] == prefix + b"%051d" % (LINES - 1)
    before, after = lines[:note], lines[note + 1 : -1]
    # Whole lines only, in order, with a gap where the dropped ones were.
    numbers = [int(line.removeprefix(prefix)) for line in before + after]
    assert numbers == sorted(numbers) and len(numbers) < LINES
    assert numbers[len(before)] > numbers[len(before) - 1] + 1
    os.close(read_end)
    os.close(write_end)


def test_a_console_that_is_gone_loses_nothing_from_the_files(tmp_path):
    read_end, write_end = os.pipe()
    os.close(read_end)  # p2p-run ... | head, after head has exited
    streams = Streams(OutputConfig(tee="3"), str(tmp_path), {OUT: write_end, ERR: write_end})
    proc = _start(streams, "rank0", 0, "for i in range(1000): print(i)")
    _serve(streams)
    assert proc.wait(timeout=30) == 0 and streams.consoles_waiting() == []
    streams.close()
    os.close(write_end)
    expected = "".join(f"{i}\n" for i in range(1000))
    assert (tmp_path / "rank0" / "stdout.log").read_text() == expected


def _p2p_run(tmp_path, *args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "launcher.cli", "--run-dir", str(tmp_path / "run"), *args],
        capture_output=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_torchtitans_launch_line_shows_rank_0_and_keeps_every_rank_in_files(tmp_path):
    # torchtitan's run_train.sh: --local-ranks-filter 0 --role rank --tee 3.
    flags = ["--nproc_per_node=2", "--local-ranks-filter", "0", "--role", "rank", "--tee", "3"]
    r = _p2p_run(tmp_path, "--standalone", *flags, "--log-dir", str(tmp_path / "logs"), CHATTY)
    assert r.returncode == 0, r.stderr
    assert r.stdout == b"[rank0]:step 1 loss 2.5 on rank 0\n[rank0]:done 0\n"
    (announced,) = [line for line in r.stderr.decode().splitlines() if "log files" in line]
    (node,) = (tmp_path / "logs" / "p2p-job").iterdir()
    assert announced.endswith(str(node)) and node.name.startswith("node0_")
    assert "[rank0]:a warning on rank 0" in r.stderr.decode()
    assert "rank 1" not in r.stdout.decode() + r.stderr.decode()
    rank1 = (node / "rank1" / "stdout.log").read_text().splitlines()
    assert rank1[0] == "step 1 loss 2.5 on rank 1" and rank1[-1] == "done 1"
    assert rank1[1:-1] == [f"{i:063d}" for i in range(16384)]
    assert (node / "rank1" / "stderr.log").read_text() == "a warning on rank 1\n"
    assert (node / "rank0" / "stdout.log").read_text().endswith("done 0")


@pytest.mark.slow
def test_torchruns_prefix_template_comes_from_its_environment_or_the_flag(tmp_path, monkeypatch):
    flags = ["--standalone", "--nproc-per-node", "2", "--tee", "1", "--local-ranks-filter", "1"]
    monkeypatch.setenv("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "${role_name}${local_rank}> ")
    r = _p2p_run(tmp_path, *flags, "--role", "trainer", CHATTY)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(b"trainer1> step 1 loss 2.5 on rank 1\ntrainer1> 0000")
    assert r.stdout.endswith(b"\ntrainer1> done 1\n")
    r = _p2p_run(tmp_path, *flags, "--log-line-prefix-template", "<${rank}> ", CHATTY)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(b"<1> step 1 loss"), "the flag wins over the environment"


@pytest.mark.slow
def test_redirected_ranks_say_nothing_on_the_console_and_a_rerun_keeps_the_last_logs(tmp_path):
    for _ in range(2):
        r = _p2p_run(tmp_path, "--standalone", "--nproc-per-node", "2", "-r", "3", CHATTY)
        assert r.returncode == 0, r.stderr
        (line,) = r.stderr.decode().splitlines()  # where the logs are, and nothing else
        assert r.stdout == b"" and "the processes' log files are in" in line
    nodes = sorted((tmp_path / "run" / "logs" / "p2p-job").iterdir())  # <run-dir>/logs
    assert len(nodes) == 2
    for node in nodes:
        assert (node / "rank0" / "stderr.log").read_text() == "a warning on rank 0\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tee", "5", CHATTY], "--tee '5': --tee takes 0 (none)"),
        (["--local-ranks-filter", "first", CHATTY], "--local-ranks-filter 'first'"),
        (["-m", "--no-python", "json.tool"], "--module and --no-python cannot both be given"),
        (["--no-python", "no-such-program"], "neither an executable file nor a program on PATH"),
    ],
)
def test_bad_output_flags_are_one_clear_line(tmp_path, args, message):
    r = _p2p_run(tmp_path, *args)
    lines = r.stderr.decode().strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and message in lines[0], r.stderr


@pytest.mark.slow
def test_no_python_runs_a_program_of_its_own_with_torchruns_environment(tmp_path):
    script = tmp_path / "train.sh"
    env = "$TORCHELASTIC_RUN_ID $TORCHELASTIC_RESTART_COUNT $TORCHELASTIC_MAX_RESTARTS"
    script.write_text(f'#!/bin/sh\necho "$RANK of $WORLD_SIZE/$ROLE_WORLD_SIZE $ROLE_NAME {env}"\n')
    script.chmod(0o755)
    flags = ["--nproc-per-node", "2", "--tee", "1", "--role", "trainer", "--max-restarts", "2"]
    r = _p2p_run(tmp_path, "--standalone", "--rdzv-id", "j7", *flags, "--no-python", str(script))
    assert r.returncode == 0, r.stderr
    # torch.distributed.is_torchelastic_launched() reads TORCHELASTIC_RUN_ID.
    assert sorted(r.stdout.decode().splitlines()) == [
        f"[trainer{rank}]:{rank} of 2/2 trainer j7 0 2" for rank in (0, 1)
    ]


@pytest.mark.slow
def test_a_virtual_local_rank_sees_only_its_own_device_as_device_0(tmp_path, monkeypatch):
    script = tmp_path / "train.sh"
    script.write_text('#!/bin/sh\necho "$RANK: $LOCAL_RANK $CUDA_VISIBLE_DEVICES"\n')
    script.chmod(0o755)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,7")
    flags = ["--standalone", "--nproc-per-node", "2", "--virtual-local-rank", "--no-python"]
    r = _p2p_run(tmp_path, *flags, str(script))
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.decode().splitlines()) == ["0: 0 3", "1: 0 7"]
    # A spare needs a device of its own too: one more process than devices is refused.
    r = _p2p_run(tmp_path, *flags, "--spares", "1", str(script))
    assert r.returncode == 2 and b"CUDA_VISIBLE_DEVICES lists 2" in r.stderr, r.stderr


@pytest.mark.slow
def test_a_spare_that_takes_rank_0_is_shown_as_rank_0(start_job):
    """torchtitan's view (--tee 3 --local-ranks-filter 0) must not go dark when rank 0 dies:
    the spare that takes its place prints as ``[rank0]:``, and only from then on."""
    flags = ["--tee", "3", "--local-ranks-filter", "0"]
    job = start_job(spares=(1, 0), extra=["--say"], launcher_args=flags)
    job.wait_event("generation_complete", generation=1)
    (spare,) = job.events("process_started", role="spare")
    os.kill(job.pid_of(0), signal.SIGKILL)
    job.wait_event("generation_complete", generation=2)
    assert job.stop() == [0, 0]
    console = (job.run_dir / "p2p-run-0.log").read_text().splitlines()
    said = [line for line in console if line.startswith("[")]
    assert said == [
        "[rank0]:rank/0/1 is rank 0 in generation 1",
        f"[rank0]:{spare['identity']} is rank 0 in generation 2",
    ]
    (logs,) = (job.run_dir / "logs" / "p2p-job").glob("node0_*")
    assert (logs / spare["name"] / "stdout.log").read_text() == (
        f"{spare['identity']} waits\n{spare['identity']} is rank 0 in generation 2\n"
    )
    assert "rank/0/2 is rank 1 in generation 2" in (logs / "rank1" / "stdout.log").read_text()


def test_a_process_tells_its_agent_each_rank_it_takes_once(tmp_path):
    """What :meth:`Agent._assigned` hears: a spare assigned, then a resize that renumbers."""
    from launcher import protocol
    from launcher.client import ClientConfig, ControlClient
    from launcher.secret import create_once

    create_once(tmp_path / "secret")
    with socket.socket() as s:  # no coordinator needed to tell the agent
        s.bind(("127.0.0.1", 0))
        nobody = f"127.0.0.1:{s.getsockname()[1]}"
    agent_end, child_end = socket.socketpair()
    config = ClientConfig(
        coordinator=nobody,
        job_id="j",
        secret_file=str(tmp_path / "secret"),
        identity="spare/0/3",
        role="spare",
        node=0,
        agent_fd=child_end.fileno(),
    )
    client = ControlClient(config)
    try:
        for rank in (3, 3, 2):
            client.took_rank(rank)
        agent_end.settimeout(10)
        lines = protocol.LocalLines()
        said: list[dict] = []
        while len(said) < 2:
            said += lines.feed(agent_end.recv(4096))
        assert said == [{"type": "assigned", "rank": 3}, {"type": "assigned", "rank": 2}]
        agent_end.setblocking(False)
        with pytest.raises(BlockingIOError):
            agent_end.recv(4096)  # the same rank again said nothing
    finally:
        client.close()
        agent_end.close()
        child_end.close()


def test_a_process_that_never_stops_writing_cannot_keep_the_agent_reading(tmp_path):
    """One read() is bounded: the loop it runs in also sends the node's heartbeats. (Short
    lines written 64 KiB at a time cost the writer one call, the reader a prefix per line.)"""
    from launcher import output

    streams = Streams(OutputConfig(redirects="0", tee="1"), str(tmp_path), _Console(tmp_path).fds)
    proc = _start(streams, "rank0", 0, "import sys\nwhile True: sys.stdout.write('x\\n' * 32768)")
    try:
        (fd,) = streams.fds()
        assert select.select([fd], [], [], 30)[0], "the writer never wrote"
        reader = threading.Thread(target=streams.read, args=(fd,), daemon=True)
        reader.start()
        reader.join(timeout=30)
        assert not reader.is_alive(), "read() kept reading a pipe that never empties"
        assert 0 < (tmp_path / "rank0" / "stdout.log").stat().st_size <= output._TURN_BYTES
    finally:
        proc.kill()
        proc.wait(timeout=30)
        streams.close()


def test_a_child_that_floods_its_channel_cannot_keep_the_agent_listening(tmp_path):
    """What a child says on its channel is read in the agent's loop now, not only at its
    exit: one read of it is bounded, and its garbage and bad ranks change nothing."""
    from launcher.agent import _Child

    agent = _agent(tmp_path)
    mine, theirs = socket.socketpair()
    mine.setblocking(False)
    flood = (
        "import os, sys\n"
        'junk = b\'{"type": "assigned", "rank": "three"}\\nnot json\\n\' * 1000\n'
        "while True: os.write(int(sys.argv[1]), junk)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", flood, str(theirs.fileno())], pass_fds=(theirs.fileno(),)
    )
    theirs.close()
    child = _Child("spare/0/1", "r", "spare", None, 1, proc, -1, mine, "spare0-1", tmp_path)
    try:
        assert select.select([mine], [], [], 30)[0], "the child never spoke"
        hearing = threading.Thread(target=agent._hear, args=(child,), daemon=True)
        hearing.start()
        hearing.join(timeout=30)
        assert not hearing.is_alive(), "_hear() kept reading a channel that never empties"
        assert child.name == "spare0-1" and not child.heard_all
    finally:
        proc.kill()
        proc.wait()
        mine.close()
        agent.events.close()


def test_the_error_torch_records_is_read_back_on_one_bounded_line(tmp_path, monkeypatch):
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    from launcher.output import error_file, read_error_file

    path = error_file(None, str(tmp_path), "rank3", "rank/1/4")
    assert path == tmp_path / "errors" / "rank-1-4.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    try:
        raise ValueError("bad lr:\n  -1")
    except ValueError as e:
        ErrorHandler().record_exception(e)  # what @record writes
    assert read_error_file(path, 500) == "ValueError: bad lr: -1"
    assert read_error_file(path, 12) == "ValueError: bad lr: -1"[:9] + "..."
    # Left by an earlier run: a new process's file starts out absent.
    assert error_file(str(tmp_path / "logs"), str(tmp_path), "rank3", "rank/1/4").parent.is_dir()
    assert not error_file(None, str(tmp_path), "rank3", "rank/1/4").exists()
    for junk in (b"not json", b"[1, 2]", b'{"message": 7}', b"{" + b" " * 300_000 + b"}"):
        path.write_bytes(junk)
        assert read_error_file(path, 500) == ""
    assert read_error_file(tmp_path / "missing.json", 500) == ""


@pytest.mark.slow
def test_a_rank_that_records_its_error_is_named_with_it_when_the_job_fails(tmp_path):
    script = str(Path(__file__).parent / "scripts" / "recorded_failure.py")
    r = _p2p_run(tmp_path, "--standalone", "--nproc-per-node", "1", "--redirects", "3", script)
    assert r.returncode == 1
    err = r.stderr.decode()
    (node,) = (tmp_path / "run" / "logs" / "p2p-job").iterdir()
    # The console shows nothing of the rank (redirected), but says why it failed.
    cause = "ValueError: learning rate -1 is negative (rank 0)"
    assert f"rank0 (rank/0/1) exited with code 1: {cause} (traceback: {node}" in err
    (last,) = [line for line in err.splitlines() if line.startswith("p2p-run: the job failed")]
    assert f"exited with code 1 ({cause}) and does not use the engine" in last
    assert "--env-store" not in last  # the hint is for a missing MASTER_PORT, not this
    recorded = json.loads((node / "rank0" / "error.json").read_text())
    assert "Traceback" in recorded["message"]["extraInfo"]["py_callstack"]
