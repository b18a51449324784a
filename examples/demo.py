"""The demo behind ``make demo``: a rank is SIGKILLed mid-step and rebuilt from its peers, bitwise.

The example training job (``examples/train.py``: FSDP2 on gloo, a small transformer, the node-local
data cache) runs under p2p-run on 2 emulated nodes of 2 ranks with a hot spare. Half-way through,
rank 1 is SIGKILLed in the middle of its backward pass. The coordinator sees the exit, hands the
rank to the spare and starts a new generation; the surviving ranks abort their blocked
collectives, form new process groups, and the spare receives rank 1's shard from the buddy that
holds its replica. Then the same job runs without the fault and the two are compared: every rank's
final parameters, optimizer state, RNG and schedule, and every step's batch and loss.

    python -m examples.demo [--steps 12] [--kill-at 6] [--model small]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from recovery.phases import PEER_RECOVERY_PHASES as PHASES


def _print_recovery(outcome, kill_at: int) -> None:
    (fault,) = outcome.events("fault_injected")
    t0 = fault["t"]
    for name, label in (
        ("fault", "the coordinator saw the crash"),
        ("generation_started", "generation 2 announced"),
    ):
        e = next(e for e in outcome.events(name) if e["t"] >= t0)
        print(f"[demo] +{(e['t'] - t0) * 1e3:6.0f} ms  {label}")
    done = outcome.events("recovery_done", generation=2)
    spare = [e for e in done if e["bytes_received"]]
    for e in sorted(done, key=lambda e: e["rank"]):
        phases = ", ".join(f"{p} {e['phases'][p] * 1e3:.0f}" for p in PHASES if p in e["phases"])
        who = "spare " if e in spare else "rank  "
        print(
            f"[demo] +{(e['t'] - t0) * 1e3:6.0f} ms  {who}{e['rank']} restored step {e['step']} "
            f"from {e['restored_from']} ({phases} ms)"
        )
    first = max(e["t"] for e in outcome.events("first_step_done", generation=2))
    print(f"[demo] +{(first - t0) * 1e3:6.0f} ms  training is back: step {kill_at} done again")


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns 0 when the recovered run matches the fault-free run bit for bit."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--kill-at", type=int, default=6, help="step during which rank 1 is killed")
    p.add_argument("--model", default="small", help="tiny, small or example")
    p.add_argument("--run-dir", default=None, help="keep the runs here (default: a temp dir)")
    args = p.parse_args(argv)
    if not 2 <= args.kill_at <= args.steps:
        p.error(f"--kill-at must be between 2 and --steps ({args.steps})")

    from bench.errors import UsageError

    try:
        return _run(args)
    except UsageError as e:  # --run-dir holding what no earlier demo left there
        p.error(str(e))


def _run(args: argparse.Namespace) -> int:
    from bench.faults import parse_fault
    from bench.runner import bitwise_differences, run_example

    with tempfile.TemporaryDirectory(prefix="p2p-demo-") as tmp:
        root = Path(args.run_dir or tmp)
        common = {"model": args.model, "steps": args.steps, "cache_dir": str(root / "cache")}
        # The CPU path on any machine: the emulated nodes share this machine, and on its GPUs
        # NCCL would refuse two of them on one device (bench/shared_gpu.py is the way there).
        common["env"] = {"CUDA_VISIBLE_DEVICES": ""}
        print(
            f"[demo] {args.steps} steps of the {args.model} model, FSDP2 on 2 nodes x 2 ranks "
            "(gloo), 1 hot spare; rank 1 is SIGKILLed during the backward pass of step "
            f"{args.kill_at}"
        )
        fault = parse_fault(f"kill:rank=1@step={args.kill_at}:phase=backward")
        faulty = run_example(root / "with-fault", faults=[fault], spares=(1, 0), **common)
        if faulty.codes != [0, 0]:
            print(faulty.job.output(0)[-3000:], file=sys.stderr)
            print("[demo] the run with the fault failed", file=sys.stderr)
            return 1
        _print_recovery(faulty, args.kill_at)
        print("[demo] reference run without any fault ...")
        reference = run_example(root / "reference", spares=(0, 0), **common)
        problems = bitwise_differences(faulty, reference)
        for rank in sorted(faulty.results):
            a, b = faulty.results[rank]["digest"], reference.results[rank]["digest"]
            print(f"[demo] rank {rank}: final state {a[:16]} {'==' if a == b else '!='} {b[:16]}")
        print(
            "[demo] final state, every batch and every loss bitwise equal to the fault-free "
            f"run: {not problems}"
        )
        for problem in problems[:10]:
            print(f"[demo]   {problem}")
        return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
