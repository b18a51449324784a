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
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.baseline import run_baseline
from bench.runner import EXAMPLE, LocalJob
from recovery.config import CAUSE_JOINED as JOINED


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``p2p-bench resize``."""
    p.add_argument("--model", default="example", help="tiny, small or example (default)")
    p.add_argument("--steps", type=int, default=16, help="steps of the in-place run")
    p.add_argument("--dcp-steps", type=int, default=3, help="steps before the DCP resize")
    p.add_argument("--work-dir", default=None, help="where runs keep their files (default tmp)")
    p.add_argument("--timeout", type=float, default=1800.0, help="deadline per run, seconds")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _in_place(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    run_dir = work / "in-place"
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
        heartbeat_interval_s=0.5,
    )
    deadline = time.monotonic() + args.timeout
    try:
        while not _resized(job, 1):
            if time.monotonic() > deadline or job.nodes[0].poll() is not None:
                raise RuntimeError(f"the job did not grow: {job.output(0)[-2000:]}")
            time.sleep(0.2)
        subprocess.run(
            [sys.executable, "-m", "launcher.cli", "scale", "--to", "3", "--run-dir", str(run_dir)],
            check=True,
            capture_output=True,
            timeout=60,
        )
        codes = job.wait(max(1.0, deadline - time.monotonic()))
    finally:
        job.kill_everything()
    out = {"exit_codes": codes}
    for label, (resize, done) in zip(("grow", "shrink"), _resizes(job), strict=False):
        # A joining process waits from the announcement on while the job still trains: the
        # resize starts when the first rank that was training stops.
        trained = [e for e in done if e.get("cause") != JOINED] or done
        start = min(e["started_t"] for e in trained)
        critical = max(done, key=lambda e: e["t"])
        out[label] = {
            "from": resize["from"],
            "to": resize["to"],
            "step": critical["step"],
            "resize_s": critical["t"] - start,
            "phases_ms": {k: round(v * 1e3, 1) for k, v in critical["phases"].items()},
            "bytes_received": sum(e["bytes_received"] for e in done),
        }
    return out


def _resized(job: LocalJob, count: int) -> bool:
    return len(_resizes(job)) >= count


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


def _through_dcp(args: argparse.Namespace, work: Path, before: int, after: int) -> dict[str, Any]:
    ckpt = work / f"dcp-{before}-to-{after}"
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
    return {
        "from": before,
        "to": after,
        "exit_codes": [first.code, second.code],
        "save_s": saved - saving,
        "stop_s": exited - saved,
        "restart_and_load_s": restart,
        "resize_s": (exited - saving) + restart,
    }


def run(args: argparse.Namespace) -> int:
    """Both ways, both directions; print the figures."""
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="p2p-bench-resize-"))
    in_place = _in_place(args, work)
    dcp = {"grow": _through_dcp(args, work, 3, 4), "shrink": _through_dcp(args, work, 4, 3)}
    result: dict[str, Any] = {"model": args.model, "in_place": in_place, "dcp": dcp}
    for label in ("grow", "shrink"):
        ours, theirs = in_place.get(label, {}).get("resize_s"), dcp[label]["resize_s"]
        result[f"{label}_resize_s"] = ours
        result[f"{label}_resize_dcp_s"] = theirs
        result[f"{label}_speedup_vs_dcp"] = round(theirs / ours, 1) if ours else None
    speedups = [result[f"{x}_speedup_vs_dcp"] for x in ("grow", "shrink")]
    result["resize_speedup_vs_dcp"] = min(speedups) if all(speedups) else None
    if args.json:
        print(json.dumps(result, default=str))
        return 0
    print(f"p2p-bench resize: {args.model} model")
    for label in ("grow", "shrink"):
        ours = in_place.get(label, {})
        theirs = dcp[label]
        print(
            f"  {label:6s} {theirs['from']} -> {theirs['to']}: in place "
            f"{ours.get('resize_s', float('nan')):.2f} s ({ours.get('phases_ms')}), through DCP "
            f"{theirs['resize_s']:.2f} s (save {theirs['save_s']:.2f}, stop "
            f"{theirs['stop_s']:.2f}, restart and load {theirs['restart_and_load_s']:.2f}): "
            f"{result[f'{label}_speedup_vs_dcp']}x"
        )
    print(f"  resize_speedup_vs_dcp: {result['resize_speedup_vs_dcp']}")
    return 0
