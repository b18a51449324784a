"""``p2p-bench``: benchmarks and failure injection.

Each subcommand lives in its own module that defines ``add_arguments(parser)`` and
``run(args) -> int``; this file only dispatches, importing the module of the chosen subcommand.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import signal
import sys
import tempfile
from pathlib import Path
from types import ModuleType

#: subcommand -> (module, one-line help)
_COMMANDS: dict[str, tuple[str, str]] = {
    "replicate": (
        "bench.replicate_bench",
        "replication bandwidth, step overhead and snapshot speed on the example model",
    ),
    "control-plane": (
        "bench.control_plane_bench",
        "coordinator CPU, fault detection and generation changes at 256-2,048 emulated ranks",
    ),
    "data": (
        "bench.data_bench",
        "time to a replacement rank's first batch from the node cache vs. from the source",
    ),
    "start": (
        "bench.start_bench",
        "how soon a rank or a spare has its imports done: fresh interpreter vs. fork server",
    ),
    "rendezvous": (
        "bench.rendezvous_bench",
        "one gloo group's rendezvous through the store at 256-2,048 members: torch's way and ours",
    ),
    "recover": (
        "bench.recover_bench",
        "one SIGKILL with a spare: each recovery phase, recovery_s, bitwise check",
    ),
    "inject": (
        "bench.inject_bench",
        "the example job under p2p-run with a fault schedule: phases, steps lost, bitwise check",
    ),
    "baseline": (
        "bench.baseline_bench",
        "the same job as people run it today: torchrun restarts and DCP checkpoints",
    ),
    "resize": (
        "bench.resize_bench",
        "shrink and grow in place vs the same resizes through DCP save, restart and load",
    ),
    "compare": (
        "bench.compare_bench",
        "checkpointless vs checkpoint-restart on one job and fault schedule: downtime reduction",
    ),
    "gpu-check": (
        "bench.gpu_check",
        "the GPU path on this machine: copies, checksum, pinned memory, GPU tests (ratios)",
    ),
    "hostile": (
        "bench.hostile_bench",
        "the coordinator under floods, forgeries, replays and squatters: crashes, RSS, lock-outs",
    ),
    "scale-report": (
        "bench.scale_report",
        "modelled recovery time, goodput and memory at 256-16,384 GPUs, validated on this machine",
    ),
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``p2p-bench`` console script."""
    # A bad value is one line naming the flag, as the subcommands' own checks are.
    parser = argparse.ArgumentParser(
        prog="p2p-bench", description=__doc__.splitlines()[0], exit_on_error=False
    )
    parser.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, exit_on_error=False)
        p.set_defaults(_module=module_name)
        importlib.import_module(module_name).add_arguments(p)
    given = sys.argv[1:] if argv is None else argv
    try:
        args = parser.parse_args(given)
    except argparse.ArgumentError as e:
        command = next((f"p2p-bench {a}" for a in given if a in _COMMANDS), "p2p-bench")
        print(f"{command}: error: {e}", file=sys.stderr)
        return 2
    args.given_argv = list(given)  # the report's command line (bench.report_dir)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    module = importlib.import_module(args._module)
    from bench.workdir import finish_work_dir, temporary_work_dir

    temporary = temporary_work_dir(args)
    code = 1
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        code = _run(module, args)
    finally:
        signal.signal(signal.SIGTERM, previous)
        if temporary is not None:
            finish_work_dir(temporary, code)
    return code


class Terminated(KeyboardInterrupt):
    """SIGTERM (``timeout``, ``kill``, a scheduler's cancel): raised where the bench is, so that
    it ends its runs' processes and keeps or removes its work folder as on Ctrl-C."""


def _terminate(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one is enough: the clean-up is not cut short
    raise Terminated


def _run(module: ModuleType, args: argparse.Namespace) -> int:
    """The subcommand's exit code; its usage errors and failures as one line."""
    from bench.errors import BenchFailed, UsageError
    from launcher.testing import JobStartFailed, JobTimeout

    try:
        _check_folders(args)
        return int(module.run(args) or 0)
    except UsageError as e:
        print(f"p2p-bench {args.command}: error: {e}", file=sys.stderr)
        return 2
    except (BenchFailed, JobStartFailed, JobTimeout) as e:
        print(f"p2p-bench {args.command}: failed: {e}", file=sys.stderr)
        return 1
    except Terminated:
        print("p2p-bench: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print("p2p-bench: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT


def _check_folders(args: argparse.Namespace) -> None:
    """Refuse a report, work or local checkpoint folder that cannot be written before the runs,
    not after them; what the check creates it removes (the runs create it again).

    Raises:
        bench.errors.UsageError: a folder cannot be created, or not written into.
    """
    from bench.errors import UsageError

    given = [(flag, getattr(args, dest, None)) for flag, dest in _FOLDERS]
    for flag, value in given:
        if not value or "://" in value:
            continue
        folder = Path(value)
        missing = [p for p in (folder, *folder.parents) if not p.exists()]  # the deepest first
        try:
            folder.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=folder).close()
        except OSError as e:
            why = "a file is there" if isinstance(e, FileExistsError) else e.strerror
            raise UsageError(
                f"{flag} {folder}: cannot write there ({why}): give a folder you can write"
            ) from None
        finally:
            for made in missing:
                with contextlib.suppress(OSError):
                    made.rmdir()


#: The folders a subcommand may be given: (flag, attribute).
_FOLDERS = (
    ("--out-dir", "out_dir"),
    ("--work-dir", "work_dir"),
    ("--checkpoint-dir", "checkpoint_dir"),
    ("--dir", "dir"),
)


if __name__ == "__main__":
    sys.exit(main())
