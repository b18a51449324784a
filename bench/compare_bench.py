"""``p2p-bench compare``: checkpointless recovery against checkpoint-restart, one job, one run.

The same job (model, world size, steps, data) and the same fault schedule in both modes, plus the
fault-free run for the bitwise check:

    downtime_reduction_pct = 100 * (1 - checkpointless downtime / checkpoint-restart downtime)

where downtime counts everything between a fault and the training being back at the step it had
reached.

    p2p-bench compare                                   # one SIGKILL with a spare
    p2p-bench compare --fault kill-node:node=1@step=15 --checkpoint-every 10
"""

from __future__ import annotations

import argparse

from bench import fault_runs
from bench.reports import CompareSummary

DEFAULT_FAULT = "kill:rank=1@step=15:phase=backward"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``p2p-bench compare``."""
    fault_runs.add_job_arguments(p, steps=20, checkpoint_every=10)


def run(args: argparse.Namespace) -> int:
    """Run both modes and the reference; report the reduction in downtime."""
    if not args.fault and not args.random:
        args.fault = [DEFAULT_FAULT]
    faults = fault_runs.resolve_faults(args)
    fault_runs.refuse_used_checkpoint_dirs(args, "checkpointless", "restart")
    report = fault_runs.new_report("compare", args, faults)
    with fault_runs.progress(args, runs=3) as progress:
        checkpointless = fault_runs.run_checkpointless(args, faults, progress)
        report.checkpointless = checkpointless
        restart = fault_runs.run_restart(args, faults, progress)
        report.restart = restart
    ours, theirs = fault_runs.downtime(checkpointless), fault_runs.downtime(restart)
    reduction = None
    if ours is not None and theirs:
        reduction = round(100.0 * (1.0 - ours / theirs), 1)
    report.summary = CompareSummary(
        downtime_checkpointless_s=ours,
        downtime_restart_s=theirs,
        downtime_reduction_pct=reduction,
        bitwise_equal=checkpointless.bitwise_equal,
        notes=fault_runs.notes(report),
    )
    return fault_runs.finish(args, report)
