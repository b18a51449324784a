"""``p2p-bench baseline``: the example job the way people run it today, measured.

Plain FSDP2 under ``torchrun --max-restarts`` with a DCP checkpoint every ``--checkpoint-every``
steps (a directory, or an ``s3://`` URL through fsspec/s3fs); a fault kills the whole job, every
process restarts, re-initialises, loads the last checkpoint and recomputes the steps since.
Per fault: terminate, restart processes, init communicators, load checkpoint, warm data,
recompute, the steps lost and the downtime.

    p2p-bench baseline --fault kill:rank=3@step=12 --checkpoint-every 10
"""

from __future__ import annotations

import argparse

from bench import fault_runs
from bench.errors import UsageError
from bench.phases import RestartedFault
from bench.reports import BaselineSummary


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``p2p-bench baseline``."""
    fault_runs.add_job_arguments(p, steps=20, checkpoint_every=10)


def run(args: argparse.Namespace) -> int:
    """Run the checkpoint-restart job with the faults and report."""
    faults = fault_runs.resolve_faults(args)
    if not faults:
        raise UsageError("give at least one --fault or --random N")
    report = fault_runs.new_report("baseline", args, faults)
    with fault_runs.progress(args, runs=1) as progress:
        section = fault_runs.run_restart(args, faults, progress)
    report.restart = section
    report.summary = BaselineSummary(
        downtime_restart_s=fault_runs.downtime(section),
        steps_lost=[
            f.steps_lost if isinstance(f, RestartedFault) else None for f in section.faults
        ],
        notes=fault_runs.notes(report),
    )
    return fault_runs.finish(args, report)
