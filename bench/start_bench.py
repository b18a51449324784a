"""``p2p-bench start``: how soon a rank or a spare runs, fresh interpreter against fork server.

A rank's first seconds are its imports. The bench starts ``--processes`` copies of a script that
imports what a protected rank imports (torch, FSDP, DCP and the engine) and says when it is
done, in one run, both ways ``p2p-run --start-method`` offers:

- ``spawn``: a fresh interpreter each (torchrun's way);
- ``forkserver``: each forked from the node's fork server (the default), whose own start is
  counted apart: it happens once per node, before the node joins.

For each: the time until all of them have their imports done (started at once, as a node's
ranks are), the time of one more started alone afterwards (a spare that refills the pool), and
the CPU seconds each used until then. One untimed import first warms the page cache for both.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.errors import UsageError
from bench.flags import count
from bench.report_dir import add_out_dir, command_line, finish_with_table

#: What a protected training script imports.
_RANK_IMPORTS = (
    "torch,torch.distributed,torch.distributed.fsdp,torch.distributed.checkpoint,recovery.api"
)

#: What each process runs: the imports, then its figures.
_SCRIPT = """\
import importlib, json, os, sys, time
for name in sys.argv[1].split(","):
    importlib.import_module(name)
times = os.times()
print(json.dumps({"ready_at": time.monotonic(), "cpu_s": times.user + times.system}))
"""

#: How long one process may take to get its imports done.
_READY_TIMEOUT_S = 300.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``p2p-bench start``."""
    p.add_argument(
        "--processes", type=count(1), default=4, help="processes started at once (default 4)"
    )
    p.add_argument(
        "--imports",
        default=None,
        help="modules each process imports, comma-separated (default: what a protected rank "
        "imports, torch to the engine; the fork server then preloads what p2p-run's does); "
        "given, the fork server preloads these",
    )
    add_out_dir(p, "start")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _ready(procs: list[Any]) -> list[dict[str, float]]:
    """What each process printed once its imports were done; then it has exited."""
    deadline = time.monotonic() + _READY_TIMEOUT_S
    docs = []
    for proc in procs:
        left_s = deadline - time.monotonic()
        if left_s <= 0 or not select.select([proc.stdout], [], [], left_s)[0]:
            raise TimeoutError(f"a process did not finish its imports in {_READY_TIMEOUT_S:.0f}s")
        line = proc.stdout.readline()
        proc.stdout.close()
        code = proc.wait(_READY_TIMEOUT_S)
        if code != 0 or not line:
            raise RuntimeError(f"a process of the bench exited with code {code}")
        docs.append(json.loads(line))
    return docs


def _round(start: Any, num_processes: int) -> dict[str, float]:
    """Start ``num_processes`` at once, then one alone; their figures."""
    t0 = time.monotonic()
    docs = _ready([start() for _ in range(num_processes)])
    all_ready_s = max(d["ready_at"] for d in docs) - t0
    t0 = time.monotonic()
    (alone,) = _ready([start()])
    return {
        "all_ready_s": all_ready_s,
        "one_ready_s": alone["ready_at"] - t0,
        "cpu_s_per_process": statistics.median(d["cpu_s"] for d in docs),
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; returns its report."""
    from launcher.forkserver import PRELOAD, ForkServer

    imports = args.imports or _RANK_IMPORTS
    preload = list(PRELOAD) if args.imports is None else imports.split(",")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # as p2p-run sets it for several ranks
    with tempfile.TemporaryDirectory(prefix="p2p-start-bench-") as tmp:
        script = Path(tmp) / "rank.py"
        script.write_text(_SCRIPT)
        command = [sys.executable, str(script), imports]
        subprocess.run(command, env=env, stdout=subprocess.DEVNULL, check=True, timeout=300)

        def spawned() -> subprocess.Popen[bytes]:
            return subprocess.Popen(command, env=env, stdout=subprocess.PIPE)

        spawn = _round(spawned, args.processes)
        t0 = time.monotonic()
        server = ForkServer([sys.executable], env, preload)
        try:
            server.wait_ready(_READY_TIMEOUT_S)
            setup_s = time.monotonic() - t0

            def forked() -> Any:
                return server.spawn(command[1:], env=env, stdout=subprocess.PIPE)

            forkserver = {**_round(forked, args.processes), "server_ready_s": setup_s}
        finally:
            server.close()
    return {
        "benchmark": "start",
        "processes": args.processes,
        "imports": imports.split(","),
        "preloaded": preload,
        "spawn": spawn,
        "forkserver": forkserver,
        "all_ready_speedup": spawn["all_ready_s"] / forkserver["all_ready_s"],
        "all_ready_speedup_with_server_start": spawn["all_ready_s"]
        / (forkserver["all_ready_s"] + setup_s),
        "one_ready_speedup": spawn["one_ready_s"] / forkserver["one_ready_s"],
        # None: the forked processes used no CPU the clock could count (light imports).
        "cpu_ratio": spawn["cpu_s_per_process"] / forkserver["cpu_s_per_process"]
        if forkserver["cpu_s_per_process"]
        else None,
        "command": command_line(args),
    }


def run(args: argparse.Namespace) -> int:
    """Entry point of ``p2p-bench start``."""
    if not hasattr(os, "pidfd_open"):
        raise UsageError("the fork server needs Linux 5.3 or later (pidfd_open)")
    imports = "torch, FSDP, DCP and the engine" if args.imports is None else args.imports
    r = measure(args)
    s, f = r["spawn"], r["forkserver"]
    with_server_s = f["all_ready_s"] + f["server_ready_s"]
    table = "\n".join(
        [
            f"{r['processes']} processes importing {imports}",
            f"{'':34}{'spawn':>10}{'forkserver':>12}{'ratio':>9}",
            f"{'all ready, started at once':34}{s['all_ready_s']:9.2f}s{f['all_ready_s']:11.2f}s"
            f"{r['all_ready_speedup']:8.1f}x",
            f"{'  + the fork server start':34}{'':10}{with_server_s:11.2f}s"
            f"{r['all_ready_speedup_with_server_start']:8.1f}x",
            f"{'one more, alone (a spare)':34}{s['one_ready_s']:9.2f}s{f['one_ready_s']:11.2f}s"
            f"{r['one_ready_speedup']:8.1f}x",
            f"{'CPU per process':34}{s['cpu_s_per_process']:9.2f}s{f['cpu_s_per_process']:11.2f}s"
            + (f"{r['cpu_ratio']:8.1f}x" if r["cpu_ratio"] else f"{'-':>9}"),
        ]
    )
    finish_with_table(args, r, table)
    return 0
