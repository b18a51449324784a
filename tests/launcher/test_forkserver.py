"""The fork server: a process forked from it is the process a fresh interpreter would be."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from launcher.forkserver import ForkServer, ForkServerError, split_python_command, start_method
from launcher.lifetime import alive
from tests.jobs import wait_for

PY = sys.executable

#: Prints what a script sees of its interpreter; the same from a fresh one and a forked one.
PROBE = """\
import json, os, random, sys
import numpy as np
doc = {
    "argv": sys.argv,
    "orig_argv": sys.orig_argv,
    "path0": sys.path[0],
    "globals": sorted(globals()),
    "name": __name__,
    "file": __file__,
    "loader": type(__loader__).__name__,
    "spec": __spec__ and [__spec__.name, __spec__.origin],
    "cwd": os.getcwd(),
    "env": os.environ.get("PROBE_VALUE"),
    "unbuffered": sys.stdout.write_through,
    "flags": list(sys.flags),
    "main_is_this": sys.modules["__main__"].__dict__ is globals(),
    "stdout_line_buffered": sys.stdout.line_buffering,
}
fd = int(os.environ.get("PROBE_FD", "-1"))
if fd >= 0:
    os.write(fd, b"through the passed descriptor")
print(json.dumps(doc))
print(json.dumps([random.random(), float(np.random.random())]), file=sys.stderr)
"""


@pytest.fixture(scope="module")
def server():
    fs = ForkServer([PY, "-u"], dict(os.environ), preload=["numpy", "json"])
    try:
        assert fs.wait_ready(60)
        assert fs.preloaded == ["numpy", "json"]
        yield fs
    finally:
        fs.close()
    assert not alive(fs.pid)


def _fresh(argv, env=None, **kwargs):
    return subprocess.run([PY, "-u", *argv], capture_output=True, env=env, timeout=60, **kwargs)


def _forked(server, entry, env=None, **kwargs):
    proc = server.spawn(
        entry,
        env=dict(os.environ if env is None else env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **kwargs,
    )
    out, err = proc.stdout.read(), proc.stderr.read()
    proc.stdout.close()
    proc.stderr.close()
    return proc.wait(30), out, err


@pytest.mark.parametrize(
    ("command", "split"),
    [
        ([PY, "-u", "{s}", "--lr", "3"], ([PY, "-u"], ["{s}", "--lr", "3"])),
        (["python3", "-m", "pkg.train", "-x"], (["python3"], ["-m", "pkg.train", "-x"])),
        (["python", "-um", "pkg"], (["python", "-u"], ["-m", "pkg"])),
        (
            ["python3.11", "-X", "dev", "-Werror", "-B", "{s}"],
            (["python3.11", "-X", "dev", "-Werror", "-B"], ["{s}"]),
        ),
        (["python", "--", "{s}"], (["python"], ["{s}"])),
        (["python", "-c", "print(1)"], None),
        (["python", "-i", "{s}"], None),
        (["python", "-"], None),
        (["python", "-m"], None),
        (["python"], None),
        (["python", "missing.py"], None),
        (["python", "{zip}"], None),
        (["bash", "{s}"], None),
        ([], None),
    ],
)
def test_which_commands_a_fork_server_runs(tmp_path, command, split):
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    with zipfile.ZipFile(tmp_path / "app.pyz", "w") as z:
        z.writestr("__main__.py", "pass\n")

    def fill(args):
        return [a.format(s=script, zip=tmp_path / "app.pyz") for a in args]

    expected = None if split is None else (fill(split[0]), fill(split[1]))
    assert split_python_command(fill(command)) == expected


def test_start_methods_are_torchruns_names():
    assert start_method("spawn") == "spawn"
    assert start_method("forkserver") == start_method("fork") == "forkserver"
    with pytest.raises(Exception, match="'thread' is not a start method: choose one of"):
        start_method("thread")


def test_a_forked_script_sees_what_a_fresh_interpreter_shows_it(server, tmp_path):
    script = tmp_path / "sub" / "probe.py"
    script.parent.mkdir()
    script.write_text(PROBE)
    env = {**os.environ, "PROBE_VALUE": "yes"}
    fresh = _fresh([str(script), "a", "--b"], env=env, cwd=tmp_path)
    assert fresh.returncode == 0, fresh.stderr
    read, write = os.pipe()
    try:
        code, out, err = _forked(
            server,
            [str(script), "a", "--b"],
            env={**env, "PROBE_FD": str(write)},
            pass_fds=(write,),
        )
        os.close(write)
        assert os.read(read, 100) == b"through the passed descriptor"
    finally:
        os.close(read)
    assert code == 0, err
    # The forked one runs from this process's directory, the fresh one from tmp_path.
    assert json.loads(out) == {**json.loads(fresh.stdout), "cwd": os.getcwd()}
    assert json.loads(out)["main_is_this"] and json.loads(out)["path0"] == str(script.parent)
    # Generators seeded afresh in every process, as in fresh interpreters.
    _, _, again = _forked(server, [str(script)])
    assert json.loads(err) != json.loads(again)


def test_a_module_runs_as_python_m_runs_it(server, tmp_path, monkeypatch):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "probe.py").write_text(PROBE)
    monkeypatch.chdir(tmp_path)
    fresh = _fresh(["-m", "pkg.probe", "x"])
    assert fresh.returncode == 0, fresh.stderr
    code, out, err = _forked(server, ["-m", "pkg.probe", "x"])
    assert code == 0, err
    assert json.loads(out) == json.loads(fresh.stdout)
    assert json.loads(out)["argv"] == [str(package / "probe.py"), "x"]


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ("import sys\nsys.exit(3)\n", 3),
        ("def f():\n    raise ValueError('boom')\n\nf()\n", 1),
        ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n", -signal.SIGKILL),
        ("raise KeyboardInterrupt\n", -signal.SIGINT),
        ("import sys\nsys.exit('a message')\n", 1),
    ],
)
def test_an_exit_is_the_exit_a_fresh_interpreter_makes(server, tmp_path, body, code):
    script = tmp_path / "end.py"
    script.write_text(body)
    fresh = _fresh([str(script)])
    forked_code, _, err = _forked(server, [str(script)])
    assert fresh.returncode == forked_code == code
    if code == 1:  # the same report, without the fork server's frames
        assert err.decode() == fresh.stderr.decode()


def test_the_end_of_a_script_runs_as_in_a_fresh_interpreter(server, tmp_path):
    # atexit handlers run, and a file the script never closed is flushed at the interpreter's
    # final collection.
    out = tmp_path / "out.txt"
    script = tmp_path / "end.py"
    script.write_text(
        textwrap.dedent(f"""\
            import atexit
            log = open({str(out)!r}, "w")
            log.write("written, never closed\\n")
            atexit.register(print, "at exit")
            """)
    )
    code, stdout, _ = _forked(server, [str(script)])
    assert code == 0 and stdout == b"at exit\n"
    assert out.read_text() == "written, never closed\n"


def test_a_missing_script_is_reported_as_the_interpreter_reports_it(server, tmp_path):
    code, _, err = _forked(server, [str(tmp_path / "gone.py")])
    assert code == 2 and b"can't open file" in err and b"gone.py" in err


def test_signals_reach_the_process_through_its_pidfd(server, tmp_path):
    script = tmp_path / "wait.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    for how, code in (("terminate", -signal.SIGTERM), ("kill", -signal.SIGKILL)):
        proc = server.spawn([str(script)], env=dict(os.environ), stdout=subprocess.PIPE)
        assert proc.stdout.readline() == b"up\n"
        assert proc.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(0.05)
        getattr(proc, how)()
        assert proc.wait(30) == code and proc.poll() == code
        proc.kill()  # ended: nothing is signalled
        proc.stdout.close()


def test_a_malformed_request_is_refused_and_the_server_serves_on(server, tmp_path):
    server._sock.send(b'{"spawn": {"entry": []}}')
    with pytest.raises(ForkServerError, match="refused"):
        while True:
            doc, _ = server._receive(None, "a refusal")
            if "refused" in doc:
                raise ForkServerError(f"refused: {doc['refused']}")
    script = tmp_path / "ok.py"
    script.write_text("print('still served')\n")
    assert _forked(server, [str(script)])[:2] == (0, b"still served\n")


def test_its_processes_end_with_the_server(tmp_path):
    fs = ForkServer([PY], dict(os.environ), preload=[])
    try:
        assert fs.wait_ready(60)
        script = tmp_path / "wait.py"
        script.write_text("import time\nprint('up', flush=True)\ntime.sleep(60)\n")
        proc = fs.spawn([str(script)], env=dict(os.environ), stdout=subprocess.PIPE)
        assert proc.stdout.readline() == b"up\n"
        os.kill(fs.pid, signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
        wait_for(lambda: not alive(proc.pid), "the forked process to end with its server")
        with pytest.raises(ForkServerError, match="gone"):
            fs.spawn([str(script)], env=dict(os.environ))
        proc.stdout.close()
    finally:
        fs.close()


def test_a_server_that_cannot_start_says_so():
    fs = ForkServer([PY, "-c", "import sys; sys.exit(4)"], dict(os.environ), preload=[])
    try:
        with pytest.raises(ForkServerError, match="exited"):
            fs.wait_ready(60)
    finally:
        fs.close()


def test_a_server_whose_imports_loaded_the_cuda_driver_is_not_used(tmp_path):
    # A module that loads a library named as the driver is (a copy of libc): what a preload that
    # called into CUDA leaves mapped. A process forked from there could not use the GPU.
    maps = Path("/proc/self/maps").read_text().split()
    libc = Path(next(p for p in maps if os.path.basename(p).startswith("libc.so")))
    driver = tmp_path / "libcuda.so.1"
    driver.write_bytes(libc.read_bytes())
    (tmp_path / "touches_cuda.py").write_text(f"import ctypes\nctypes.CDLL({str(driver)!r})\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    fs = ForkServer([PY], env, preload=["touches_cuda"])
    try:
        with pytest.raises(ForkServerError, match=r"loaded the CUDA driver \(.*libcuda.so.1\)"):
            fs.wait_ready(60)
    finally:
        fs.close()


def test_a_process_started_for_a_request_given_up_on_is_killed(server, tmp_path):
    # The answer to a request that timed out comes late, before the answer to the next one:
    # that process has no owner, and must not run on unmanaged.
    (tmp_path / "wait.py").write_text("import time\ntime.sleep(60)\n")
    (tmp_path / "ok.py").write_text("print('mine')\n")
    spec = {"id": -1, "entry": [str(tmp_path / "wait.py")], "env": {}, "cwd": "/", "fds": []}
    server._sock.send(json.dumps({"spawn": spec}).encode())
    assert _forked(server, [str(tmp_path / "ok.py")])[:2] == (0, b"mine\n")

    def children():
        tasks = Path(f"/proc/{server.pid}/task")
        return [c for t in tasks.iterdir() for c in (t / "children").read_text().split()]

    wait_for(lambda: not children(), "the server's children to be gone", 30)


def test_exits_reported_before_the_server_was_closed_are_kept(tmp_path):
    fs = ForkServer([PY], dict(os.environ), preload=[])
    try:
        assert fs.wait_ready(60)
        (tmp_path / "three.py").write_text("import sys\nsys.exit(3)\n")
        (tmp_path / "wait.py").write_text("import time\nprint('up', flush=True)\ntime.sleep(60)\n")
        done = fs.spawn([str(tmp_path / "three.py")], env=dict(os.environ))
        running = fs.spawn(
            [str(tmp_path / "wait.py")], env=dict(os.environ), stdout=subprocess.PIPE
        )
        assert running.stdout.readline() == b"up\n"
        wait_for(lambda: select.select([fs._sock], [], [], 0)[0], "the first exit report")
    finally:
        fs.close()
    assert done.wait(30) == 3  # reported before the close
    assert running.wait(30) == -signal.SIGKILL  # died with the server
    running.stdout.close()


def test_a_hung_server_costs_a_second_per_process_not_the_nodes_heartbeats(tmp_path, caplog):
    # The agent waits on the server in its event loop, which also sends the node's heartbeats.
    fs = ForkServer([PY], dict(os.environ), preload=[])
    try:
        assert fs.wait_ready(60)
        (tmp_path / "wait.py").write_text("import time\nprint('up', flush=True)\ntime.sleep(60)\n")
        running = fs.spawn(
            [str(tmp_path / "wait.py")], env=dict(os.environ), stdout=subprocess.PIPE
        )
        assert running.stdout.readline() == b"up\n"
        os.kill(fs.pid, signal.SIGSTOP)
        with pytest.raises(ForkServerError, match="did not report the process it started in time"):
            fs.spawn([str(tmp_path / "wait.py")], env=dict(os.environ))
        running.kill()
        assert running.wait(30) == 1  # its exit went unreported: counted as a failure
        assert "did not report the exit code" in caplog.text
        running.stdout.close()
        # Requests it never reads fill its socket: a send then gives up too, never blocks.
        env = {**os.environ, "LARGE": "x" * 60_000}
        errors = []
        for _ in range(8):
            try:
                fs.spawn([str(tmp_path / "wait.py")], env=env)
            except ForkServerError as e:
                errors.append(str(e))
            if "did not take the request in time" in errors[-1]:
                break
        assert "did not take the request in time" in errors[-1], errors
    finally:
        os.kill(fs.pid, signal.SIGCONT)
        fs.close()


def test_a_late_answer_read_in_passing_has_its_process_killed(tmp_path):
    # What the agent's event loop does when the server's socket is readable: exit reports are
    # kept, the process of an answer nobody waits for is killed at once.
    fs = ForkServer([PY], dict(os.environ), preload=[])
    try:
        assert fs.wait_ready(60)
        (tmp_path / "wait.py").write_text("import time\ntime.sleep(60)\n")
        spec = {"id": -1, "entry": [str(tmp_path / "wait.py")], "env": {}, "cwd": "/", "fds": []}
        fs._sock.send(json.dumps({"spawn": spec}).encode())
        wait_for(lambda: select.select([fs.fileno()], [], [], 0)[0], "the answer")
        fs.drain()
        wait_for(lambda: fs.drain() or fs._exits, "the unmanaged process's exit report")
        assert list(fs._exits.values()) == [-signal.SIGKILL]
    finally:
        fs.close()
    assert fs.fileno() == -1
