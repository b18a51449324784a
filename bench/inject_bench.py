"""``p2p-bench inject``: a protected job under p2p-run with a schedule of faults, measured.

Every fault's phases (detect, interrupt, communicators, plan, build, transfer, restore, data,
replicate, recompute), the steps lost and the downtime, and the final state checked bit for bit
against the same job without faults. Writes a report folder (``report.json``, ``report.md``,
PNG plots) and exits 1 when the check fails.

    p2p-bench inject --fault kill:rank=3@step=12 --fault hang:rank=2@step=16
    p2p-bench inject --random 3 --seed 7
    p2p-bench inject --script my_train.py --steps 100 --fault kill:rank=1@step=40 -- --lr 3e-4

The job is the example training job, or with ``--script`` any training script protected by
``p2p_state.protect`` (what follows ``--`` are its arguments). The faults are armed inside its
ranks through the engine's ``P2P_JOB_HOOKS`` and the bitwise check compares what the probe
records (every step's batch, every rank's final state digest) with the same script run without
faults, so the script needs no change. ``--steps`` then says how many steps the script runs;
it is only used to check the fault steps.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench import fault_runs
from bench.errors import UsageError
from bench.reports import InjectSummary


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``p2p-bench inject``."""
    fault_runs.add_job_arguments(p, steps=20, checkpoint_every=10)
    p.add_argument(
        "--no-reference",
        action="store_true",
        help="skip the fault-free run (and so the bitwise check)",
    )
    p.add_argument(
        "--script",
        default=None,
        metavar="PATH",
        help="a training script protected by p2p_state.protect instead of the example job",
    )
    p.add_argument(
        "script_args",
        nargs="*",
        metavar="-- ARGS",
        help="the script's arguments, after --",
    )


def run(args: argparse.Namespace) -> int:
    """Run the checkpointless job with the faults and report."""
    faults = fault_runs.resolve_faults(args)
    if args.script is None and args.script_args:
        raise UsageError(
            f"unexpected arguments {' '.join(args.script_args)}: only a --script takes them"
        )
    if args.script is not None and not Path(args.script).is_file():
        raise UsageError(f"--script {args.script}: no such file")
    if args.script is not None:
        args.script = str(Path(args.script).resolve())
    if not faults:
        raise UsageError("give at least one --fault or --random N")
    report = fault_runs.new_report("inject", args, faults)
    with fault_runs.progress(args, runs=1 if args.no_reference else 2) as progress:
        section = fault_runs.run_checkpointless(
            args, faults, progress, reference=not args.no_reference
        )
    report.checkpointless = section
    report.summary = InjectSummary(
        downtime_checkpointless_s=fault_runs.downtime(section),
        bitwise_equal=section.bitwise_equal,
        notes=fault_runs.notes(report),
    )
    return fault_runs.finish(args, report)
