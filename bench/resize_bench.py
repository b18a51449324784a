"""``p2p-bench resize``: shrink and grow in place, against the same resizes through DCP.

In place: the example job starts on 3 ranks with a hot spare and ``--max-ranks 4``; the policy
grows it into the spare (3 -> 4), then ``p2p-run scale --to 3`` gives a rank back (4 -> 3).
Both are graceful: ranks finish their step, switch at the next commit of replication, rebuild
the model on the new world and reshard the state from peers' memory. ``resize_s`` runs from the
first rank stopping training to the last rank ready to train in the new world (a joining spare, idle
until then, is not counted from the announcement).

Through DCP (how elastic training without in-memory copies resizes): the plain job saves a DCP
checkpoint, every process exits, and the job restarts at the new size and loads the checkpoint
(DCP reshards it). ``resize_s`` runs from the save starting to the restarted ranks' first batch
being ready; the time a scheduler needs to hand out the new allocation is not counted (in the
favour of the DCP path).

    p2p-bench resize --json

A small model trains faster than the resizes take: ``--step-time S`` paces the in-place run's
steps (at least ``S`` seconds each, through the job hook :func:`pace`) until both resizes are
done, so that they happen while it trains; ``--no-dcp`` skips the DCP side. The test suite's
smoke run uses both (``--model tiny --steps 30 --step-time 0.3 --no-dcp``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.baseline import run_baseline
from bench.errors import BenchFailed
from bench.flags import MODEL_PRESETS, count, non_negative, positive
from bench.report_dir import add_out_dir, finish_with_table
from bench.reports import DcpResize, InPlaceResize, InPlaceRun, ResizeReport
from bench.runner import EXAMPLE
from bench.workdir import WORK_DIR_HELP, fresh_run_dir
from launcher.protocol import ENV_BENCH_STEP_S, ENV_JOB_HOOKS, ENV_RUN_DIR
from launcher.testing import LocalJob
from recovery.records import CAUSE_JOINED as JOINED

#: The job hook pacing the in-place run's steps (see :func:`pace`).
PACE_HOOK = "bench.resize_bench:pace"
#: Written into the run directory once both resizes are done: the pacing stops.
PACE_OFF = "pace-off"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``p2p-bench resize``."""
    p.add_argument(
        "--model", default="example", choices=MODEL_PRESETS, help="model preset (default example)"
    )
    p.add_argument("--steps", type=count(2), default=16, help="steps of the in-place run")
    p.add_argument("--dcp-steps", type=count(1), default=3, help="steps before the DCP resize")
    p.add_argument("--work-dir", default=None, help=WORK_DIR_HELP)
    p.add_argument("--timeout", type=positive, default=1800.0, help="deadline per run, seconds")
    p.add_argument(
        "--step-time",
        type=non_negative,
        default=0.0,
        help="pace the in-place run: at least this many seconds per step until both resizes "
        "are done (for small models; default 0, unpaced)",
    )
    p.add_argument("--no-dcp", action="store_true", help="skip the resizes through DCP")
    add_out_dir(p, "resize")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _in_place(args: argparse.Namespace, work: Path) -> InPlaceRun:
    run_dir = fresh_run_dir(work / "in-place")
    job = LocalJob(
        run_dir,
        nnodes=3,
        nproc_per_node=1,
        spares=(1, 0, 0),
        script=EXAMPLE,
        script_args=[
            "--model",
            args.model,
            "--steps",
            str(args.steps),
            "--cache-dir",
            str(work / "cache"),
            "--global-batch",
            "12",
        ],
        launcher_args=["--max-ranks", "4", "--scale-up-delay", "2", "--min-ranks", "2"],
        env={ENV_JOB_HOOKS: PACE_HOOK, ENV_BENCH_STEP_S: str(args.step_time)},
        heartbeat_interval_s=0.5,
    )
    deadline = time.monotonic() + args.timeout
    try:
        _wait_for_resizes(job, 1, deadline, "grow")
        subprocess.run(
            [sys.executable, "-m", "launcher.cli", "scale", "--to", "3", "--run-dir", str(run_dir)],
            check=True,
            capture_output=True,
            timeout=60,
        )
        _wait_for_resizes(job, 2, deadline, "shrink")
        (run_dir / PACE_OFF).touch()
        codes = job.wait(max(1.0, deadline - time.monotonic()))
    finally:
        job.kill_everything()
    out = InPlaceRun(exit_codes=codes)
    for label, (resize, done) in zip(("grow", "shrink"), _resizes(job), strict=False):
        # A joining process waits from the announcement on while the job still trains: the
        # resize starts when the first rank that was training stops.
        trained = [e for e in done if e.get("cause") != JOINED] or done
        start = min(e["started_t"] for e in trained)
        critical = max(done, key=lambda e: e["t"])
        measured = InPlaceResize(
            from_size=resize["from"],
            to_size=resize["to"],
            step=critical["step"],
            resize_s=critical["t"] - start,
            phases_ms={k: round(v * 1e3, 1) for k, v in critical["phases"].items()},
            bytes_received=sum(e["bytes_received"] for e in done),
        )
        if label == "grow":
            out.grow = measured
        else:
            out.shrink = measured
    return out


def _wait_for_resizes(job: LocalJob, count: int, deadline: float, what: str) -> None:
    while len(_resizes(job)) < count:
        if time.monotonic() > deadline or job.nodes[0].poll() is not None:
            hint = " (a small model may need --step-time)" if job.nodes[0].poll() == 0 else ""
            raise BenchFailed(f"the job did not {what}{hint}: {job.output(0)[-2000:]}")
        time.sleep(0.2)


def pace(job: Any) -> None:
    """Job hook: steps of at least ``P2P_BENCH_STEP_S`` seconds until the bench lifts it."""
    step_s = float(os.environ.get(ENV_BENCH_STEP_S) or 0)
    if step_s > 0:
        job.add_hook(_Pacer(step_s, Path(os.environ.get(ENV_RUN_DIR, ".")) / PACE_OFF))


class _Pacer:
    """Starts each step ``step_s`` after the previous one at the earliest, until ``off`` exists."""

    def __init__(self, step_s: float, off: Path) -> None:
        self.step_s, self.off = step_s, off
        self.last: float | None = None
        self.lifted = False

    def __call__(self, point: str, **info: Any) -> None:
        if point != "step_begin" or self.lifted:
            return
        if self.off.exists():
            self.lifted = True
            return
        if self.last is not None:
            time.sleep(max(0.0, self.last + self.step_s - time.monotonic()))
        self.last = time.monotonic()


def _resizes(job: LocalJob) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """Each resize event with the recovery_done events of its generation (once all are in)."""
    events = job.events()
    out = []
    for resize in [e for e in events if e["event"] == "resize"]:
        gen = next(
            (
                e["generation"]
                for e in events
                if e["event"] == "generation_started" and e["t"] >= resize["t"]
            ),
            None,
        )
        done = [e for e in events if e["event"] == "recovery_done" and e["generation"] == gen]
        if gen is not None and len(done) == resize["to"]:
            out.append((resize, done))
    return out


def _through_dcp(args: argparse.Namespace, work: Path, before: int, after: int) -> DcpResize:
    ckpt = fresh_run_dir(work / f"dcp-{before}-to-{after}")
    common = {"model": args.model, "ranks_per_node": 1, "cache_dir": str(work / "cache")}
    first = run_baseline(
        work / f"dcp-{before}",
        steps=args.dcp_steps,
        world_size=before,
        checkpoint_every=args.dcp_steps,
        checkpoint_dir=str(ckpt),
        timeout_s=args.timeout,
        **common,
    )
    saving = next(m["t"] for m in first.marks if m["event"] == "checkpoint_saving")
    saved = max(m["t"] for m in first.marks if m["event"] == "checkpoint_saved")
    exited = first.started_t + first.wall_s
    second = run_baseline(
        work / f"dcp-{after}",
        steps=args.dcp_steps + 1,
        world_size=after,
        checkpoint_every=10**6,
        checkpoint_dir=str(ckpt),
        timeout_s=args.timeout,
        **common,
    )
    ready = max(m["t"] for m in second.marks if m["event"] == "data_ready")
    restart = ready - second.started_t
    return DcpResize(
        from_size=before,
        to_size=after,
        exit_codes=[first.code, second.code],
        save_s=saved - saving,
        stop_s=exited - saved,
        restart_and_load_s=restart,
        resize_s=(exited - saving) + restart,
    )


def run(args: argparse.Namespace) -> int:
    """Both ways, both directions; print the figures."""
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="p2p-bench-resize-"))
    report = ResizeReport(model=args.model, in_place=_in_place(args, work))
    if not args.no_dcp:
        report.dcp_grow = _through_dcp(args, work, 3, 4)
        report.dcp_shrink = _through_dcp(args, work, 4, 3)
    finish_with_table(args, report.to_json(), _table(report))
    return 0


def _table(report: ResizeReport) -> str:
    lines = [f"p2p-bench resize: {report.model} model"]
    for label in ("grow", "shrink"):
        ours, theirs = report.in_place_of(label), report.dcp_of(label)
        ours_s = float("nan") if ours is None else ours.resize_s
        if theirs is None:
            lines.append(f"  {label:6s}: in place {ours_s:.2f} s")
            continue
        lines.append(
            f"  {label:6s} {theirs.from_size} -> {theirs.to_size}: in place "
            f"{ours_s:.2f} s ({None if ours is None else ours.phases_ms}), through DCP "
            f"{theirs.resize_s:.2f} s (save {theirs.save_s:.2f}, stop "
            f"{theirs.stop_s:.2f}, restart and load {theirs.restart_and_load_s:.2f}): "
            f"{report.speedup_vs_dcp(label)}x"
        )
    lines.append(f"  resize_speedup_vs_dcp: {report.resize_speedup_vs_dcp}")
    return "\n".join(lines)
