"""How a process that joined the job ends: its groups destroyed, its garbage finalized, and the
objects still alive left out of the interpreter's last collections."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

# Registered before the engine's handlers, this handler runs after them (atexit is last in,
# first out): it sees what they left.
SCRIPT = textwrap.dedent(
    """
    import atexit, gc

    import torch.distributed as dist

    atexit.register(lambda: print("after the engine: frozen", gc.get_freeze_count(),
                                  "initialized", dist.is_initialized(), flush=True))

    import p2p_state

    class Cycle:
        def __del__(self):
            print("garbage finalized", flush=True)

    p2p_state.init_process_group()
    gc.disable()  # only the collection at exit can find the cycle below
    cycle = Cycle()
    cycle.me = cycle
    del cycle
    """
)


def test_at_exit_the_garbage_is_finalized_and_what_lives_is_frozen_after_the_groups_go():
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
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "garbage finalized", lines
    words = lines[1].split()
    assert words[:3] == ["after", "the", "engine:"] and int(words[4]) > 100_000, lines
    assert words[5:] == ["initialized", "False"], lines
