"""The report folder every ``p2p-bench`` subcommand writes, and the command line it records.

Each subcommand takes ``--out-dir`` (default ``reports/<kind>-<time>``) and leaves
``report.json`` (its report's ``to_json()``) and ``report.md`` there. The fault runs and
``scale-report`` render theirs with plots (:mod:`bench.report`, :mod:`bench.scale_render`);
the others write their printed table, headed by the command that reproduces it
(:func:`finish_with_table`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
from pathlib import Path
from typing import Any


def add_out_dir(p: argparse.ArgumentParser, kind: str) -> None:
    """``--out-dir``, as every subcommand spells it."""
    p.add_argument("--out-dir", default=None, help=f"report folder (default reports/{kind}-<time>)")


def report_dir(args: argparse.Namespace, kind: str) -> Path:
    """The folder ``--out-dir`` names, else a new one under ``reports/``."""
    if args.out_dir:
        return Path(args.out_dir)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("reports") / f"{kind}-{stamp}"


def command_line(args: argparse.Namespace) -> str:
    """The command as given: ``p2p-bench`` and its arguments (set by :func:`bench.cli.main`,
    which also sees them when called with a list rather than from the shell)."""
    given = getattr(args, "given_argv", None)
    return shlex.join(["p2p-bench", *(sys.argv[1:] if given is None else given)])


def finish_with_table(
    args: argparse.Namespace,
    doc: dict[str, Any],
    table: str,
    *,
    markdown: bool = False,
    folder: Path | None = None,
) -> None:
    """Write ``report.json`` and ``report.md`` (the table: fenced as printed, or as it is when
    it is ``markdown`` already) into ``folder`` (default :func:`report_dir`), then print the
    table and where the report is, or with ``--json`` one object: ``doc`` and ``report_dir``."""
    folder = folder or report_dir(args, args.command)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    body = table if markdown else f"```\n{table}\n```"
    md = f"# p2p-bench {args.command}\n\n`{command_line(args)}`\n\n{body}\n"
    (folder / "report.md").write_text(md)
    if args.json:
        print(json.dumps({**doc, "report_dir": str(folder)}, default=str))
    else:
        print(table)
        print(f"  report: {folder / 'report.md'}")
