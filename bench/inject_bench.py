"""``p2p-bench inject``: the example job under p2p-run with a schedule of faults, measured.

Every fault's phases (detect, interrupt, communicators, plan, build, transfer, restore, data,
replicate, recompute), the steps lost and the downtime, and the final state checked bit for bit
against the same job without faults. Writes a report folder (``report.json``, ``report.md``,
PNG plots) and exits 1 when the check fails.

    p2p-bench inject --fault kill:rank=3@step=12 --fault hang:rank=2@step=16
    p2p-bench inject --random 3 --seed 7
"""

from __future__ import annotations

import argparse

from bench import fault_runs


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``p2p-bench inject``."""
    fault_runs.add_job_arguments(p, steps=20, checkpoint_every=10)
    p.add_argument(
        "--no-reference",
        action="store_true",
        help="skip the fault-free run (and so the bitwise check)",
    )


def run(args: argparse.Namespace) -> int:
    """Run the checkpointless job with the faults and report."""
    faults = fault_runs.resolve_faults(args)
    if not faults:
        raise fault_runs.UsageError("give at least one --fault or --random N")
    report = fault_runs.new_report("inject", args, faults)
    with fault_runs.progress(args, runs=1 if args.no_reference else 2) as progress:
        section = fault_runs.run_checkpointless(
            args, faults, progress, reference=not args.no_reference
        )
    report["modes"]["checkpointless"] = section
    report["summary"] = {
        "downtime_checkpointless_s": fault_runs.downtime(section),
        "bitwise_equal": section["bitwise_equal"],
        "notes": fault_runs.notes(report),
    }
    return fault_runs.finish(args, report)
