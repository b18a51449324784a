"""What ``p2p-bench inject``, ``baseline``, ``compare`` and ``recover`` share: the job's flags, the
runs of both modes, and the report they build.

The report is a :class:`bench.reports.FaultRunReport`; its ``to_json()`` is what the benches
print and write.

Each mode runs the same example job (model, world size, steps, data) with the same fault
schedule. The checkpointless run is ``examples/train.py`` under p2p-run with the faults injected
inside the ranks at exact points of a step; the fault-free reference is the same job without
faults, for the bitwise check. The restart run is ``examples/train_plain.py`` under torchrun.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import hashlib
import json
import os
import platform
import shlex
import socket
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench import phases
from bench.baseline import run_baseline
from bench.errors import UsageError
from bench.faults import COORDINATOR_KINDS, NODE_KINDS, Fault, parse_fault, random_faults
from bench.flags import MODEL_PRESETS, count, heartbeats, positive
from bench.netns import Healer, Network, unavailable
from bench.report_dir import add_out_dir, command_line, report_dir
from bench.reports import (
    BaselineSummary,
    CheckpointlessRun,
    FaultRunReport,
    JobInfo,
    Machine,
    ModeRun,
    RestartRun,
)
from bench.runner import JobOutcome, bitwise_differences, run_example, run_script
from bench.workdir import WORK_DIR_HELP

if TYPE_CHECKING:
    from bench.report import LiveProgress


def add_job_arguments(p: argparse.ArgumentParser, *, steps: int, checkpoint_every: int) -> None:
    """Flags every fault benchmark takes."""
    p.add_argument(
        "--model", default="example", choices=MODEL_PRESETS, help="model preset (default example)"
    )
    p.add_argument(
        "--steps", type=count(2), default=steps, help=f"training steps (default {steps})"
    )
    p.add_argument("--nnodes", type=count(1), default=2, help="emulated nodes (default 2)")
    p.add_argument("--nproc-per-node", type=count(1), default=2, help="ranks per node (default 2)")
    p.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="where the ranks train: cuda on this machine's GPUs over NCCL, every process a host "
        "of its own to NCCL (bench/shared_gpu.py) so emulated nodes can share them; cpu over "
        "gloo with the GPUs hidden; auto (default): cuda where there is a GPU",
    )
    p.add_argument(
        "--fault",
        action="append",
        default=[],
        help="a fault, e.g. kill:rank=3@step=20 (repeatable; see bench/faults.py)",
    )
    p.add_argument(
        "--random", type=count(0), default=0, help="N random kills and hangs (chaos mode)"
    )
    p.add_argument(
        "--replicas",
        type=count(1),
        default=1,
        help="replication factor k of the engine's run (p2p-run --replicas; default 1)",
    )
    p.add_argument(
        "--replicate-every",
        type=count(1),
        default=1,
        help="steps between replicated states of the engine's run (p2p-run --replicate-every; "
        "default 1)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of --random")
    p.add_argument(
        "--checkpoint-every",
        type=count(0),
        default=checkpoint_every,
        help=f"steps between DCP checkpoints (default {checkpoint_every})",
    )
    p.add_argument(
        "--checkpoint-dir",
        default=None,
        help="where checkpoints go: a directory or an fsspec URL, each mode's in a folder of its "
        "own (checkpointless/, restart/); default: in the run's folder",
    )
    add_out_dir(p, p.prog.split()[-1])  # "p2p-bench inject": inject
    p.add_argument("--work-dir", default=None, help=WORK_DIR_HELP)
    p.add_argument(
        "--reference-cache",
        default=None,
        metavar="DIR",
        help="keep fault-free reference runs here and reuse one made for the same job (script "
        "and its bytes, arguments, model, steps, shape, torch); clear it when the code changes",
    )
    p.add_argument("--heartbeat-interval", type=positive, default=0.5, help="p2p-run's, seconds")
    p.add_argument("--heartbeat-timeout", type=positive, default=3.0, help="p2p-run's, seconds")
    p.add_argument("--timeout", type=positive, default=1800.0, help="deadline per run, seconds")
    p.add_argument("--quiet", action="store_true", help="no live progress display")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def job_device(args: argparse.Namespace) -> str:
    """``cpu`` or ``cuda``, from ``--device``.

    Raises:
        UsageError: ``--device cuda`` on a machine without CUDA.
    """
    import torch

    device = getattr(args, "device", "auto")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device on this machine (use --device cpu)")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return str(device)


def resolve_faults(args: argparse.Namespace) -> list[Fault]:
    """The fault schedule from ``--fault`` and ``--random``; bad specs are a UsageError."""
    try:
        faults = [parse_fault(spec) for spec in args.fault]
        if args.random:
            world = args.nnodes * args.nproc_per_node
            faults += random_faults(
                args.random, seed=args.seed, world_size=world, num_steps=args.steps - 1
            )
    except ValueError as e:
        raise UsageError(str(e)) from None
    world = args.nnodes * args.nproc_per_node
    for f in faults:
        limit = args.nnodes if f.kind in NODE_KINDS else world
        if f.target >= limit:
            raise UsageError(
                f"{f}: {'node' if f.kind in NODE_KINDS else 'rank'} {f.target} does not exist "
                f"({args.nnodes} nodes x {args.nproc_per_node} ranks)"
            )
        if not f.in_recovery and not 1 <= f.at <= args.steps:
            raise UsageError(f"{f}: step {f.at} is outside 1..{args.steps} (--steps)")
        if f.kind == "kill-coordinators":
            raise UsageError(
                f"{f}: with every coordinator lost the job stops with a checkpoint, so the run "
                "has no end to compare; lose one coordinator (kill-coordinator) instead"
            )
        takes_coordinator = f.kind in COORDINATOR_KINDS or (f.kind in NODE_KINDS and f.target == 0)
        if takes_coordinator and args.nnodes < 2:
            raise UsageError(f"{f}: a standby coordinator runs on node 1: use --nnodes 2 or more")
        if f.kind in NODE_KINDS and f.target == 0 and args.nnodes < 3:
            raise UsageError(
                f"{f}: node 0 runs the active coordinator, and its standby takes over with the "
                "votes of more than half the nodes: use --nnodes 3 or more"
            )
        if f.kind == "partition" and args.nnodes < 3:
            raise UsageError(
                f"{f}: each side of a partition of 2 nodes hears half the job, and neither may "
                "decide for it (docs/launcher.md, Partitions): use --nnodes 3 or more"
            )
        if f.kind == "partition" and (why := unavailable()) is not None:
            raise UsageError(f"{f}: the nodes must run in network namespaces here, and {why}")
    heartbeats(args.heartbeat_interval, args.heartbeat_timeout)
    replicas = getattr(args, "replicas", 1)
    if not 1 <= replicas < world:
        raise UsageError(
            f"--replicas {replicas}: every shard is copied to k other ranks, so k must be "
            f"between 1 and {world - 1} for {world} ranks"
        )
    return sorted(faults, key=lambda f: f.at)


def spares_for(
    faults: list[Fault], nnodes: int, nproc_per_node: int, replicas: int = 1
) -> list[int]:
    """Hot spares per node: enough for every rank the schedule kills, spread over the nodes no
    fault takes down (a node's spares die with it; the pool also refills itself after each
    assignment)."""
    lost = 0
    for f in faults:
        if f.kind == "bitflip" or f.kind in COORDINATOR_KINDS:
            continue
        if f.kind in NODE_KINDS:
            lost += nproc_per_node
        elif f.kind == "kill-buddies":
            lost += 1 + replicas  # the rank and its k holders
        else:
            lost += 1
    down = {f.target for f in faults if f.kind in NODE_KINDS}  # their spares go with them
    hosts = [n for n in range(nnodes) if n not in down] or list(range(nnodes))
    wanted = max(1, min(lost, 2 * len(hosts)))
    share = {
        n: wanted // len(hosts) + (1 if i < wanted % len(hosts) else 0) for i, n in enumerate(hosts)
    }
    return [share.get(n, 0) for n in range(nnodes)]


def killed_nodes(faults: list[Fault]) -> set[int]:
    """The nodes a ``kill-node`` fault of the schedule takes down."""
    return {f.target for f in faults if f.kind == "kill-node"}


def _work_dir(args: argparse.Namespace) -> Path:
    # p2p-bench gives every command a work dir (bench/workdir.py); a caller of these functions
    # from Python may not.
    return Path(args.work_dir or tempfile.mkdtemp(prefix="p2p-bench-"))


def checkpoint_dir(args: argparse.Namespace, mode: str) -> str | None:
    """Where ``mode``'s run writes its checkpoints under ``--checkpoint-dir`` (None without it:
    then in the run's own folder).

    Each mode has a folder of its own there, so that the restart run of ``compare`` never
    resumes from the checkpointless run's checkpoints.
    """
    return f"{args.checkpoint_dir.rstrip('/')}/{mode}" if args.checkpoint_dir else None


def refuse_used_checkpoint_dirs(args: argparse.Namespace, *modes: str) -> None:
    """Check, before any run, that no mode would start from an earlier run's checkpoints.

    Raises:
        UsageError: a mode's folder under ``--checkpoint-dir`` already holds checkpoints.
    """
    for mode in modes:
        folder = checkpoint_dir(args, mode)
        if folder is None:
            continue
        from recovery.checkpoint import complete_steps  # torch's DCP: only when it is needed

        steps = complete_steps(folder)
        if steps:
            raise UsageError(
                f"--checkpoint-dir {args.checkpoint_dir}: {folder} already holds checkpoints of "
                f"steps {steps} from an earlier run, which this run would start from: remove "
                "them or give an empty --checkpoint-dir"
            )


def run_checkpointless(
    args: argparse.Namespace,
    faults: list[Fault],
    progress: LiveProgress,
    *,
    reference: bool = True,
) -> CheckpointlessRun:
    """The engine's run with the faults (and the fault-free reference); its report section."""
    refuse_used_checkpoint_dirs(args, "checkpointless")
    work = _work_dir(args)
    common = {
        "nnodes": args.nnodes,
        "nproc_per_node": args.nproc_per_node,
        "timeout_s": args.timeout,
        "heartbeat_interval_s": args.heartbeat_interval,
        "heartbeat_timeout_s": args.heartbeat_timeout,
        "device": job_device(args),
    }
    if getattr(args, "script", None):
        # A user's protected script: the probe injects the faults and records the results.
        run = functools.partial(run_script, script=args.script, script_args=args.script_args)
    else:
        run = functools.partial(
            run_example, model=args.model, steps=args.steps, cache_dir=str(work / "cache")
        )
    launcher = ["--replicas", str(getattr(args, "replicas", 1))]
    launcher += ["--replicate-every", str(getattr(args, "replicate_every", 1))]
    if args.checkpoint_every:
        # The cold fallback for a shard lost with every copy of it: by design (kill-buddies),
        # or by faults close together (a rank and its holders within one recovery).
        ckpt = checkpoint_dir(args, "checkpointless") or str(work / "checkpointless/checkpoints")
        launcher += ["--checkpoint-dir", ckpt, "--checkpoint-every", str(args.checkpoint_every)]
    spares = spares_for(faults, args.nnodes, args.nproc_per_node, getattr(args, "replicas", 1))
    progress.run_started("checkpointless", args.steps)
    with contextlib.ExitStack() as stack:
        poll: list[Callable[[list[dict[str, Any]]], None]] = [
            lambda events: _progress_from(progress, events)
        ]
        hosts = None
        if any(f.kind == "partition" for f in faults):
            # Nodes of their own on one bridge, so that a partition cuts a link.
            hosts = stack.enter_context(Network(args.nnodes))
            poll.append(Healer(hosts))
        outcome = run(
            work / "checkpointless",
            faults=faults,
            spares=spares,
            launcher_args=launcher,
            on_poll=lambda events: _each(poll, events),
            hosts=hosts,
            **common,
        )
    job = outcome.job
    assert job is not None  # a run of the job, not a kept reference
    events = job.events()
    t0 = job.started_t
    section = CheckpointlessRun(
        wall_s=outcome.wall_s,
        exit_codes=outcome.codes,
        spares=spares,
        replicas=getattr(args, "replicas", 1),
        faults=_relative(_copies_lost(phases.checkpointless_faults(events), faults), t0),
        not_fired=phases.not_fired([str(f) for f in faults], events),
        timeline=phases.timeline(events, t0),
        run_dir=str(job.run_dir),
    )
    # A node the schedule kills exits with its agent's signal; every other must end cleanly.
    down = killed_nodes(faults)
    if any(code != 0 for n, code in enumerate(outcome.codes) if n not in down):
        section.error = _last_lines(job.output(0))
    progress.run_finished(f"checkpointless run: exit codes {outcome.codes}")
    if reference:
        ref = _reference(args, work, run, common, progress)
        problems = bitwise_differences(outcome, ref)
        if ref.codes != [0] * args.nnodes:
            output = ref.job.output(0) if ref.job is not None else ""
            problems.append(f"the reference run failed: {_last_lines(output)}")
        section.bitwise_equal = not problems
        section.differences = problems[:20]
        section.reference_wall_s = ref.wall_s
    return section


def _each(
    calls: list[Callable[[list[dict[str, Any]]], None]], events: list[dict[str, Any]]
) -> None:
    for call in calls:
        call(events)


def _reference(
    args: argparse.Namespace,
    work: Path,
    run: Callable[..., JobOutcome],
    common: dict[str, Any],
    progress: LiveProgress,
) -> JobOutcome:
    """The fault-free run of the job: from ``--reference-cache`` when it holds one, else run."""
    cache = getattr(args, "reference_cache", None)
    kept = Path(cache) / f"reference-{_job_key(args)}.json" if cache else None
    if kept is not None and kept.exists():
        saved = json.loads(kept.read_text())
        progress.run_started("fault-free reference (kept)", 0)
        progress.run_finished(f"reference run: reused {kept}")
        results = {int(rank): r for rank, r in saved["results"].items()}
        return JobOutcome(None, saved["codes"], results, saved["wall_s"])
    progress.run_started("fault-free reference", args.steps)
    ref = run(
        work / "reference",
        spares=[0] * args.nnodes,
        on_poll=lambda events: _progress_from(progress, events),
        **common,
    )
    progress.run_finished(f"reference run: exit codes {ref.codes}")
    if kept is not None and ref.codes == [0] * args.nnodes:
        kept.parent.mkdir(parents=True, exist_ok=True)
        saved = {"codes": ref.codes, "wall_s": ref.wall_s, "results": ref.results}
        tmp = kept.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(saved))
        tmp.replace(kept)
    return ref


def _job_key(args: argparse.Namespace) -> str:
    """What a fault-free run's results depend on (not where its files go)."""
    import torch

    script = getattr(args, "script", None)
    job = {
        "script": script,
        "script_sha256": hashlib.sha256(Path(script).read_bytes()).hexdigest() if script else None,
        "script_args": list(getattr(args, "script_args", None) or []),
        "model": None if script else args.model,
        "steps": args.steps,
        "shape": [args.nnodes, args.nproc_per_node],
        "torch": torch.__version__,
        "device": job_device(args),
    }
    return hashlib.sha256(json.dumps(job, sort_keys=True).encode()).hexdigest()[:16]


def run_restart(
    args: argparse.Namespace, faults: list[Fault], progress: LiveProgress
) -> RestartRun:
    """The checkpoint-restart baseline with the same faults; its report section."""
    refuse_used_checkpoint_dirs(args, "restart")
    work = _work_dir(args)
    progress.run_started("checkpoint-restart", args.steps)
    run = run_baseline(
        work / "restart",
        model=args.model,
        steps=args.steps,
        world_size=args.nnodes * args.nproc_per_node,
        ranks_per_node=args.nproc_per_node,
        checkpoint_every=args.checkpoint_every,
        checkpoint_dir=checkpoint_dir(args, "restart"),
        faults=faults,
        cache_dir=str(work / "cache"),
        timeout_s=args.timeout,
        on_poll=lambda marks: _progress_from(progress, marks),
        device=job_device(args),
    )
    progress.run_finished(f"checkpoint-restart run: exit code {run.code}")
    section = RestartRun(
        wall_s=run.wall_s,
        exit_codes=[run.code],
        faults=_relative(list(phases.restart_faults(run.marks, run.kills)), run.started_t),
        timeline=phases.timeline([m for m in run.marks if m.get("rank") == 0], run.started_t),
        checkpoint_every=args.checkpoint_every,
    )
    if run.code != 0:
        section.error = _last_lines(run.output)
    return section


def _copies_lost(measured: list[phases.FaultRow], faults: list[Fault]) -> list[phases.FaultRow]:
    """Mark the faults after which some shard had no copy left (the recovery did not restore
    from peers): by design (``kill-buddies``) or by faults close enough together."""
    kinds = {str(f): f.kind for f in faults}
    for f in measured:
        if not isinstance(f, phases.RecoveredFault):
            continue
        source = f.restored_from
        if source is None or source == "peers":
            continue
        by_design = kinds.get(f.spec) == "kill-buddies"
        f.every_copy_lost = (
            "by design" if by_design else "a rank and its holders were lost before a new copy"
        )
    return measured


def _progress_from(progress: LiveProgress, events: list[dict[str, Any]]) -> None:
    steps = [e["step"] for e in events if e.get("event") == "step_done"]
    recovering = any(e.get("event") == "fault_injected" for e in events[-20:])
    progress.update(max(steps, default=0), "recovering" if recovering else "")


def _relative(faults: list[phases.FaultRow], t0: float) -> list[phases.FaultRow]:
    """The rows with ``t_fault`` in seconds since ``t0`` (the run's start)."""
    for f in faults:
        f.t_fault = f.t_fault - t0
    return faults


def _last_lines(text: str, n: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


def downtime(section: ModeRun) -> float | None:
    """Total downtime over a mode's faults (None if a fault has no measurement)."""
    return phases.merged_downtime(section.faults)


def machine() -> Machine:
    """What the figures were measured on."""
    import torch

    return Machine(
        hostname=socket.gethostname(),
        cpus=os.cpu_count(),
        platform=platform.platform(),
        python=platform.python_version(),
        torch=torch.__version__,
        gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    )


def machine_info() -> dict[str, Any]:
    """What the figures were measured on, as the reports write it."""
    return machine().to_json()


def job_info(args: argparse.Namespace) -> JobInfo:
    """The job both modes ran."""
    from bench.models import PRESETS

    world = args.nnodes * args.nproc_per_node
    shape = JobInfo(
        model=args.model,
        nnodes=args.nnodes,
        nproc_per_node=args.nproc_per_node,
        world_size=world,
        steps=args.steps,
        checkpoint_every=args.checkpoint_every,
        replicas=getattr(args, "replicas", 1),
        device=job_device(args),
    )
    if getattr(args, "script", None):
        script = shlex.join([args.script, *args.script_args])
        return dataclasses.replace(shape, script=script, model=Path(args.script).name)
    cfg = PRESETS[args.model]
    # Parameters and AdamW's two moments, fp32, split over the ranks.
    state_mib = cfg.num_params * 4 * 3 / world / 2**20
    return dataclasses.replace(
        shape, num_params=cfg.num_params, state_mib_per_rank=round(state_mib, 1)
    )


def new_report(kind: str, args: argparse.Namespace, faults: list[Fault]) -> FaultRunReport:
    """The report's frame; the modes and the summary are filled in by the command."""
    return FaultRunReport(
        kind=kind,
        command=command_line(args),
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        machine=machine(),
        job=job_info(args),
        faults=[str(f) for f in faults],
    )


@contextlib.contextmanager
def progress(args: argparse.Namespace, runs: int) -> Iterator[LiveProgress]:
    """The live progress display of the runs (nothing with ``--quiet`` or ``--json``)."""
    from bench.report import LiveProgress

    with LiveProgress(quiet=args.quiet or args.json, total_runs=runs) as live:
        yield live


def why_not_fired(spec: str, timeline: list[tuple[float, int]], job: JobInfo) -> str:
    """Why a fault of the schedule never fired, where the run shows it."""
    fault = parse_fault(spec)
    last = max((step for _, step in timeline), default=0)
    if fault.in_recovery or fault.at <= last:
        return "the run did not test it"
    if job.script is not None:
        return (
            f"the script stopped at step {last}, before step {fault.at}: --steps tells the "
            "bench how many steps the script trains, the script's own arguments (after --) "
            "decide it: give both the same number"
        )
    return f"the run stopped at step {last}, before step {fault.at}"


def notes(report: FaultRunReport) -> list[str]:
    """What a reader must know to trust the figures."""
    gpu = report.machine.gpu if report.job.device == "cuda" else None
    where = (
        f"{report.machine.cpus} CPU cores and {gpu}: NCCL between processes that share the "
        "GPUs, each a host of its own to NCCL (its socket transport), beside gloo over loopback"
        if gpu
        else f"{report.machine.cpus} CPU cores, no GPU (gloo over loopback)"
    )
    out = [
        "Phases are cut on one monotonic clock and add up to each fault's downtime: from the "
        "fault until training is back at the step it had reached.",
        f"Measured on {where}; ranks of emulated nodes share the cores.",
    ]
    if report.restart is not None:
        every = report.job.checkpoint_every
        out.append(
            f"Checkpoint-restart saves a DCP checkpoint every {every} steps (what a user of a "
            "multi-hour run picks: ~30-60 min of training between checkpoints at this step time "
            "scale), so a fault loses on average half an interval of steps."
        )
    for name, section in report.modes.items():
        if section.error:
            out.append(f"The {name} run failed: {section.error.splitlines()[-1]}")
        for spec in section.not_fired:
            out.append(
                f"{name}: {spec} never fired: {why_not_fired(spec, section.timeline, report.job)}"
            )
        for fault in section.faults:
            if isinstance(fault, phases.RecoveredFault) and fault.every_copy_lost:
                out.append(
                    f"{name}: {fault.spec} lost every copy of a shard "
                    f"({fault.every_copy_lost}); restored step {fault.step_restored} "
                    f"from {fault.restored_from}"
                )
            if isinstance(fault, phases.SilentFault):
                out.append(f"{fault.spec} corrupts silently: only the bitwise check sees it.")
            elif isinstance(fault, phases.UnmeasuredFault) and fault.error:
                out.append(f"{name}: {fault.spec}: {fault.error}")
    return out


def print_table(report: FaultRunReport) -> None:
    """The short table for people."""
    print(
        f"p2p-bench {report.kind}: {report.job.model} model, "
        f"{report.job.world_size} ranks, {report.job.steps} steps"
    )
    for name, section in report.modes.items():
        label = "checkpointless" if name == "checkpointless" else "checkpoint-restart"
        for spec in section.not_fired:
            why = why_not_fired(spec, section.timeline, report.job)
            print(f"  {label:18s} {spec}: never fired: {why}")
        for fault in section.faults:
            if not isinstance(fault, (phases.RecoveredFault, phases.RestartedFault)):
                error = fault.error if isinstance(fault, phases.UnmeasuredFault) else None
                print(f"  {label:18s} {fault.spec}: {error or 'silent'}")
                continue
            cut = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in fault.phases.items())
            print(
                f"  {label:18s} {fault.spec}: downtime {fault.downtime_s:.2f} s, "
                f"steps lost {fault.steps_lost} ({cut} ms)"
            )
    summary = {} if report.summary is None else dataclasses.asdict(report.summary)
    for key in (
        "downtime_checkpointless_s",
        "downtime_restart_s",
        "downtime_reduction_pct",
        "recovery_s",
        "bitwise_equal",
    ):
        if key in summary:
            value = summary[key]
            print(f"  {key}: {round(value, 3) if isinstance(value, float) else value}")


def finish(args: argparse.Namespace, report: FaultRunReport) -> int:
    """Write the report folder, print the table or the JSON; 1 if a run or the check failed."""
    from bench.report import write_report

    folder = report_dir(args, report.kind)
    doc = report.to_json()
    paths = write_report(doc, folder)
    if args.json:
        print(
            json.dumps(
                {**doc["summary"], "report_dir": str(folder), "modes": doc["modes"]},
                default=str,
            )
        )
    else:
        print_table(report)
        print(f"  report: {paths[1] if len(paths) > 1 else folder}")
    failed = any(s.error or s.not_fired for s in report.modes.values())
    summary = report.summary
    if summary is not None and not isinstance(summary, BaselineSummary):
        failed = failed or summary.bitwise_equal is False
    return 1 if failed else 0
