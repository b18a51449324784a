"""``p2p-bench recover``: one SIGKILL with a spare on the example model, 4 ranks: what it costs.

Each recovery phase in milliseconds, ``recovery_s`` (from the fault to the first completed step
after it) and ``bitwise_equal`` (the final state against the fault-free run). The single-fault
preset of ``p2p-bench inject``, which takes any schedule.

    p2p-bench recover --json
"""

from __future__ import annotations

import argparse

from bench import fault_runs
from bench.phases import RecoveredFault
from bench.reports import RecoverSummary

DEFAULT_FAULT = "kill:rank=1@step=6:phase=backward"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``p2p-bench recover``."""
    fault_runs.add_job_arguments(p, steps=10, checkpoint_every=0)


def run(args: argparse.Namespace) -> int:
    """One fault, the reference, the phase timings."""
    if not args.fault and not args.random:
        args.fault = [DEFAULT_FAULT]
    faults = fault_runs.resolve_faults(args)
    report = fault_runs.new_report("inject", args, faults)
    with fault_runs.progress(args, runs=2) as progress:
        section = fault_runs.run_checkpointless(args, faults, progress)
    report.checkpointless = section
    measured = [f for f in section.faults if isinstance(f, RecoveredFault)]
    first = measured[0] if measured else None
    report.summary = RecoverSummary(
        phases_ms={k: round(v * 1e3, 1) for k, v in first.phases.items()} if first else {},
        recovery_s=first.recovery_s if first else None,
        downtime_checkpointless_s=first.downtime_s if first else None,
        bytes_received=first.bytes_received if first else None,
        bitwise_equal=section.bitwise_equal,
        notes=fault_runs.notes(report),
    )
    return fault_runs.finish(args, report)
