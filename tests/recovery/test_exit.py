"""How a process that joined the job ends: nothing a script left to the interpreter's shutdown
is lost because the engine ran in it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

# A script the way people write them: a function at module level (so the module's globals are
# in a cycle once the module is gone) and a file opened at module level and never closed.
SCRIPT = textwrap.dedent(
    """
    import sys

    import p2p_state

    def log(line):
        out.write(line + "\\n")

    p2p_state.init_process_group()
    out = open(sys.argv[1], "w")
    for step in range(1, 4):
        log(f"step {step}")
    """
)


def test_a_file_the_script_never_closed_keeps_every_line_at_exit(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": "0",
        "WORLD_SIZE": "1",
    }
    log = tmp_path / "log.txt"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(log)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert log.read_text() == "step 1\nstep 2\nstep 3\n"
