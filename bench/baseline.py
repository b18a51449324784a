"""The checkpoint-restart baseline: the example job run the way people run it today.

``examples/train_plain.py`` under ``torchrun --max-restarts``: plain FSDP2, a DCP checkpoint every
M steps (a local directory or any fsspec URL such as ``s3://``), and on a fault torchrun stops
every worker, starts them all again, and they re-initialise their process group, load the last
checkpoint and recompute the steps since. Faults are injected from outside: when rank 0 has
finished the step before the fault's step, the target process gets a SIGKILL (or SIGSTOP for a
hang; a plain job only notices that when a collective times out).

``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` is set: with gloo on torch 2.13 a restarted group fails to
re-form otherwise ("Gloo connectFullMesh failed ... Connection refused"), because the shared
rendezvous store keeps the dead attempt's addresses.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.faults import COORDINATOR_KINDS, NODE_KINDS, Fault
from bench.runner import CPU_ONLY, SHARED_GPU, example_args
from bench.workdir import fresh_run_dir
from launcher.events import read_json_lines
from launcher.lifetime import die_with_parent
from launcher.protocol import ENV_INJECT, ENV_TIMELINE
from launcher.testing import JobTimeout

PLAIN = str(Path(__file__).resolve().parents[1] / "examples" / "train_plain.py")


@dataclass
class BaselineRun:
    """What a baseline run left: torchrun's exit code, the timeline, the kills, the results."""

    code: int
    marks: list[dict[str, Any]]
    kills: list[tuple[str, float]]
    """``(fault spec, time)`` of every fault injected."""
    results: dict[int, dict[str, Any]]
    wall_s: float
    started_t: float
    output: str


def _victims(fault: Fault, world_size: int, ranks_per_node: int) -> list[int]:
    """The ranks a fault takes down in a plain job (every kind maps onto killing processes: a
    partitioned node's ranks are killed, the end a plain job's collective timeouts reach)."""
    if fault.kind in NODE_KINDS:
        return [r for r in range(world_size) if r // ranks_per_node == fault.target]
    if fault.kind == "kill-buddies":
        from p2p_state.placement import place

        return [fault.target, *place(world_size, ranks_per_node, 1).holders[fault.target]]
    return [fault.target]


def run_baseline(
    run_dir: Path,
    *,
    model: str,
    steps: int,
    world_size: int,
    ranks_per_node: int,
    checkpoint_every: int,
    checkpoint_dir: str | None = None,
    faults: Sequence[Fault] = (),
    cache_dir: str | None = None,
    max_restarts: int | None = None,
    timeout_s: float = 1800.0,
    on_poll: Callable[[list[dict[str, Any]]], None] | None = None,
    device: str | None = None,
) -> BaselineRun:
    """Run the plain job under torchrun with ``faults``; every process is gone on return.
    ``device`` as :func:`bench.runner.run_script` takes it.

    Raises:
        JobTimeout: the run outlived ``timeout_s`` (it is killed first).
    """
    run_dir = fresh_run_dir(run_dir)
    timeline_path = run_dir / "timeline.jsonl"
    out = run_dir / "out"
    ckpt = checkpoint_dir or str(run_dir / "checkpoints")
    # There is no recovery to hit, a bit flip is not a crash, and a restarted job has no
    # standby coordinator: none of those applies here.
    usable = [f for f in faults if f.kind not in ("during-recovery", "bitflip", *COORDINATOR_KINDS)]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(world_size),
        "--max-restarts",
        str(len(usable) if max_restarts is None else max_restarts),
        "--monitor-interval",
        "0.1",
        *([SHARED_GPU] if device == "cuda" else []),
        PLAIN,
        *example_args(model, steps, cache_dir or str(run_dir / "cache"), out),
        "--checkpoint-dir",
        ckpt,
        "--checkpoint-every",
        str(checkpoint_every),
    ]
    env = {
        **os.environ,
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        ENV_TIMELINE: str(timeline_path),
        "OMP_NUM_THREADS": "1",
        **(CPU_ONLY if device == "cpu" else {}),
    }
    env.pop(ENV_INJECT, None)
    log_path = run_dir / "torchrun.log"
    t0 = time.monotonic()
    pending = sorted(usable, key=lambda f: f.at)
    kills: list[tuple[str, float]] = []
    stopped: list[int] = []
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent(signal.SIGTERM),  # torchrun then ends its workers
        )
        try:
            while proc.poll() is None:
                if time.monotonic() - t0 > timeout_s:
                    raise JobTimeout(f"the baseline run outlived {timeout_s:g} s; see {log_path}")
                marks = read_json_lines(timeline_path)
                if on_poll is not None:
                    on_poll(marks)
                if pending and _step_done(marks, pending[0].at - 1, after=kills):
                    fault = pending.pop(0)
                    pids = _pids(marks)
                    for rank in _victims(fault, world_size, ranks_per_node):
                        pid = pids.get(rank)
                        if pid is not None:
                            sig = signal.SIGSTOP if fault.kind == "hang" else signal.SIGKILL
                            os.kill(pid, sig)
                            if sig == signal.SIGSTOP:
                                stopped.append(pid)
                    kills.append((str(fault), time.monotonic()))
                time.sleep(0.01)
        finally:
            for pid in stopped:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # any worker torchrun left behind
            except ProcessLookupError:
                pass
    results = {
        int(p.stem.removeprefix("rank")): json.loads(p.read_text()) for p in out.glob("rank*.json")
    }
    return BaselineRun(
        code=proc.returncode,
        marks=read_json_lines(timeline_path),
        kills=kills,
        results=results,
        wall_s=time.monotonic() - t0,
        started_t=t0,
        output=log_path.read_text(),
    )


def _step_done(marks: list[dict[str, Any]], step: int, after: list[tuple[str, float]]) -> bool:
    """Rank 0 has finished ``step`` since the last kill (step 0: the job has started)."""
    since = after[-1][1] if after else 0.0
    if step <= 0:
        return any(m["event"] == "communicators" and m["t"] > since for m in marks)
    return any(m["event"] == "step_done" and m["step"] >= step and m["t"] > since for m in marks)


def _pids(marks: list[dict[str, Any]]) -> dict[int, int]:
    """Rank -> pid of its latest process."""
    out: dict[int, int] = {}
    for m in sorted(marks, key=lambda m: m["t"]):
        if m["event"] == "started":
            out[m["rank"]] = m["pid"]
    return out
