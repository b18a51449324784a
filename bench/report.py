"""The report folder of the failure-injection benchmarks (``inject``, ``baseline``, ``compare``).

The benchmarks build a :class:`bench.reports.FaultRunReport`; this module turns its JSON document
(``to_json()``) into ``report.json``, ``report.md``, ``phases.png`` and ``timeline.png``, and
shows the live progress of the runs. It renders any such document, one read back or cut short
included: any field may be missing after a partial run, so every read is defensive and a
missing figure reads "n/a". matplotlib and rich are optional (``pip install -e '.[bench]'``).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any, TextIO, TypeGuard

logger = logging.getLogger(__name__)

NA = "n/a"
MODE_LABELS = {"checkpointless": "checkpointless", "restart": "checkpoint-restart"}
_TITLES = {
    "inject": "Failure injection: checkpointless recovery",
    "baseline": "Checkpoint-restart baseline",
    "compare": "Checkpointless vs checkpoint-restart: downtime",
}
_NO_MATPLOTLIB = "Plots skipped: matplotlib is missing; plots need `pip install -e '.[bench]'`."
_JOB_KEYS = ("world_size", "steps", "spares", "checkpoint_every", "replicas")
_MACHINE_KEYS = ("hostname", "cpus", "platform", "python", "torch", "gpu")
_TIMELINE_LINK = "![timeline](timeline.png)"
_HOW_TO_READ = (
    "Downtime counts everything from the fault until training is back at the step it had reached "
    "when the fault hit (the step in flight is lost in both modes). The phases are listed in the "
    "order they happen, on one clock, and add up to the downtime. Steps lost are the steps "
    "between the restored and the reached step; redoing them is the `recompute` phase."
)
# Phase colours: tab10 then Dark2, so that up to 18 phase names get distinct colours.
_PALETTE = ("tab10", "Dark2")
_MODE_COLOURS = {"checkpointless": "tab:blue", "restart": "tab:red"}

Report = dict[str, Any]


def write_report(report: Report, out_dir: str | Path) -> list[Path]:
    """Write the report folder.

    The JSON is written first, so a failure later on never loses the measurements; a plot that
    fails is logged and named in the Markdown instead of failing the run that produced it.

    Args:
        report: The report's JSON document (``FaultRunReport.to_json()``, or one read back).
        out_dir: The folder; created with its parents.

    Returns:
        The paths written: ``report.json``, ``report.md``, then the PNGs that were drawn.
    """
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    json_path = folder / "report.json"
    json_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    pngs: list[Path] = []
    plots_missing: str | None = None
    try:
        import matplotlib

        # Agg: no display, and no GUI backend chosen for the caller at import time.
        matplotlib.use("Agg")
        import matplotlib.pyplot  # fails here, not halfway through the plots
    except ImportError:
        plots_missing = _NO_MATPLOTLIB
    else:
        for name, plot in (("phases.png", plot_phases), ("timeline.png", plot_timeline)):
            try:
                plot(report, folder / name)
                pngs.append(folder / name)
            except Exception as e:
                logger.warning("could not draw %s: %s", name, e, exc_info=True)
                plots_missing = f"Plot {name} failed: {e}"
    md_path = folder / "report.md"
    md_path.write_text(render_markdown(report, plots_missing=plots_missing))
    return [json_path, md_path, *pngs]


def render_markdown(report: Report, *, plots_missing: str | None = None) -> str:
    """The report for people.

    Args:
        report: The report's JSON document.
        plots_missing: A line saying why the PNGs are absent; ``None`` links them.

    Returns:
        The Markdown text.
    """
    job, machine = _section(report, "job"), _section(report, "machine")
    summary, modes = _section(report, "summary"), _section(report, "modes")
    kind = report.get("kind")
    title = _TITLES.get(kind, "p2p-bench report") if isinstance(kind, str) else "p2p-bench report"
    out = [
        f"# {title}",
        "",
        f"Created {report.get('created', NA)}.",
    ]
    out += ["", "```", str(report.get("command", NA)), "```", "", "## Summary", ""]
    rows = [
        (f"downtime, {label} (all faults)", _fmt(summary.get(f"downtime_{mode}_s"), ".3f", " s"))
        for mode, label in MODE_LABELS.items()
        if mode in modes or f"downtime_{mode}_s" in summary
    ]
    if kind == "compare" or "downtime_reduction_pct" in summary:
        rows.append(
            ("downtime reduction", _fmt(summary.get("downtime_reduction_pct"), ".1f", " %"))
        )
    if "recovery_s" in summary:
        rows.append(("recovery (to the first step)", _fmt(summary["recovery_s"], ".3f", " s")))
    out += _table(("", ""), [*rows, ("bitwise check", _verdict(summary.get("bitwise_equal")))])
    out += ["", *(f"- {note}" for note in summary.get("notes") or [])]

    num_params = job.get("num_params")
    rows = [
        ("model", job.get("model", NA)),
        ("parameters", f"{num_params / 1e6:.1f} M" if _number(num_params) else NA),
        ("state per rank", _fmt(job.get("state_mib_per_rank"), ".1f", " MiB")),
        ("nodes x processes", f"{job.get('nnodes', NA)} x {job.get('nproc_per_node', NA)}"),
        *((key.replace("_", " "), job.get(key, NA)) for key in _JOB_KEYS),
    ]
    out += ["", "## Job", "", *_table(("", ""), rows, "---"), "", "## Machine", ""]
    values = {key: machine.get(key, NA) for key in _MACHINE_KEYS}
    out += _table(("", ""), [(k, "none" if v is None else v) for k, v in values.items()], "---")
    specs = ", ".join(f"`{f}`" for f in report.get("faults") or [])
    out += ["", f"Faults injected: {specs or NA}."]

    for mode, section in modes.items():
        out += _mode_markdown(mode, section if isinstance(section, dict) else {})

    out += ["", "## Plots", ""]
    out += [plots_missing] if plots_missing else ["![phases](phases.png)", "", _TIMELINE_LINK]
    out += ["", "## How to read this", "", _HOW_TO_READ, ""]
    return "\n".join(out)


def _mode_markdown(mode: str, section: dict[str, Any]) -> list[str]:
    out = ["", f"## {MODE_LABELS.get(mode, mode)}", ""]
    wall = _fmt(section.get("wall_s"), ".1f", " s")
    verdict = _verdict(section.get("bitwise_equal"))
    out.append(f"Wall time {wall}, exit codes {section.get('exit_codes', NA)}, bitwise {verdict}.")
    if section.get("error"):
        out += ["", "The run failed:", "", "```", str(section["error"]), "```"]
    differences = section.get("differences") or []
    out += ["", "Differences from the fault-free reference:", ""] if differences else []
    out += [f"- {d}" for d in differences]
    not_fired = section.get("not_fired") or []
    if not_fired:
        out += ["", "Faults asked for that never fired (the run did not test them):", ""]
        out += [f"- `{spec}`" for spec in not_fired]
    faults = section.get("faults") or []
    out += [] if faults else ["", f"Faults measured: {NA}."]
    for i, fault in enumerate(faults, start=1):
        fault = fault if isinstance(fault, dict) else {}
        out += ["", f"### Fault {i}: `{fault.get('spec', NA)}`", ""]
        out.append(f"Injected {_fmt(fault.get('t_fault'), '.2f', ' s')} after the run started.")
        if fault.get("silent"):
            out += ["", "Silent corruption: nothing crashed; only the bitwise check sees it."]
            continue
        if fault.get("error"):
            out += ["", f"Not measured: {fault['error']}."]
        phases = fault.get("phases")
        phases = phases if isinstance(phases, dict) else {}
        rows = [(phase, _fmt(seconds, ".3f")) for phase, seconds in phases.items()]
        rows += [
            ("**downtime**", f"**{_fmt(fault.get('downtime_s'), '.3f')}**"),
            ("steps lost", fault.get("steps_lost", NA)),
        ]
        reached = fault.get("step_reached", NA)
        rows.append(("restored step", f"{fault.get('step_restored', NA)} (reached {reached})"))
        if "restored_from" in fault:
            rows.append(("restored from", fault["restored_from"]))
        if fault.get("every_copy_lost"):
            rows.append(("every copy of a shard lost", fault["every_copy_lost"]))
        if fault.get("slowest_survivor_out_s") is not None:
            out_s = _fmt(fault["slowest_survivor_out_s"], ".3f")
            rows.append(("slowest survivor out of the step (in the phases above)", out_s))
        out += ["", *_table(("phase", "seconds"), rows)]
    return out


def _table(header: tuple[str, str], rows: list[tuple[str, Any]], align: str = "---:") -> list[str]:
    """A two-column Markdown table; ``align`` is the value column's (right by default)."""
    lines = [f"| {header[0]} | {header[1]} |", f"|---|{align}|"]
    return lines + [f"| {_cell(name)} | {_cell(value)} |" for name, value in rows]


def plot_phases(report: Report, path: Path) -> None:
    """One horizontal stacked bar per (mode, fault): its phases, in order, in seconds.

    Args:
        report: The report's JSON document.
        path: The PNG to write.
    """
    import matplotlib.pyplot as plt

    bars = _bars(report)
    colours, seen = _phase_colours(bars), set()
    fig, ax = plt.subplots(figsize=(11, 1.6 + 0.7 * max(1, len(bars))))
    try:
        for y, (_, phases, downtime) in enumerate(bars):
            left = 0.0
            for phase, seconds in phases.items():
                # One legend entry per phase name, however many bars it appears in.
                label = phase if phase not in seen else "_nolegend_"
                seen.add(phase)
                ax.barh(y, seconds, left=left, color=colours[phase], label=label, height=0.6)
                left += seconds
            ax.text(left, y, f"  {_fmt(downtime, '.2f', ' s')}", va="center", fontsize=9)
        ax.set_yticks(range(len(bars)), [label for label, _, _ in bars], fontsize=8)
        ax.invert_yaxis()  # the first fault on top
        widest = max((sum(p.values()) for _, p, _ in bars), default=0.0) or 1.0
        ax.set_xlim(0, widest * 1.15)  # room for the downtime label
        ax.set_xlabel("seconds since the fault (downtime at the end of each bar)")
        ax.set_title(f"Downtime per fault, phase by phase: {_job_name(report)}")
        if seen:
            ax.legend(title="phase", fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
        else:
            ax.text(0.5, 0.5, f"no measured faults ({NA})", transform=ax.transAxes, ha="center")
        ax.grid(axis="x", alpha=0.3)
        fig.savefig(path, dpi=120, bbox_inches="tight")
    finally:
        plt.close(fig)


def plot_timeline(report: Report, path: Path) -> None:
    """Global step against wall time, one step line per mode; faults and downtime marked.

    Args:
        report: The report's JSON document.
        path: The PNG to write.
    """
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 5))
    try:
        drawn = False
        for i, (mode, section) in enumerate(_section(report, "modes").items()):
            section = section if isinstance(section, dict) else {}
            colour = _MODE_COLOURS.get(mode, f"C{i + 2}")
            points = [p for p in section.get("timeline") or [] if _pair(p)]
            if points:
                times, steps = zip(*points)
                label = MODE_LABELS.get(mode, mode)
                ax.step(times, steps, where="post", color=colour, label=label)
                drawn = True
            for fault in section.get("faults") or []:
                t_fault = fault.get("t_fault") if isinstance(fault, dict) else None
                if not _number(t_fault):
                    continue
                ax.axvline(t_fault, color=colour, linestyle="--", linewidth=1)
                if _number(fault.get("downtime_s")):
                    ax.axvspan(t_fault, t_fault + fault["downtime_s"], color=colour, alpha=0.12)
        if drawn:
            ax.plot([], [], color="grey", linestyle="--", label="fault")
            ax.fill_between([], [], color="grey", alpha=0.2, label="downtime")
            ax.legend(loc="upper left", fontsize=9)
        else:
            ax.text(0.5, 0.5, f"no timeline recorded ({NA})", transform=ax.transAxes, ha="center")
        ax.set_xlabel("wall time since the run started (s)")
        ax.set_ylabel("global step done")
        ax.set_title(f"Training progress: {_job_name(report)}")
        ax.grid(alpha=0.3)
        fig.savefig(path, dpi=120, bbox_inches="tight")
    finally:
        plt.close(fig)


def _bars(report: Report) -> list[tuple[str, dict[str, float], float]]:
    """``(label, phases, downtime_s)`` per measured fault, modes in report order."""
    bars = []
    for mode, section in _section(report, "modes").items():
        faults = section.get("faults") if isinstance(section, dict) else None
        for fault in faults or []:
            phases = fault.get("phases") if isinstance(fault, dict) else None
            if not isinstance(phases, dict):
                continue  # silent or unmeasured: nothing to draw
            clean = {str(k): float(v) for k, v in phases.items() if _number(v)}
            downtime = fault.get("downtime_s")
            downtime = float(downtime) if _number(downtime) else sum(clean.values())
            bars.append(
                (f"{MODE_LABELS.get(mode, mode)}\n{fault.get('spec', NA)}", clean, downtime)
            )
    return bars


def _phase_colours(bars: list[tuple[str, dict[str, float], float]]) -> dict[str, Any]:
    """One colour per phase name, in order of first appearance, the same in every bar."""
    import matplotlib

    # tab10 and Dark2 are lists of colours: entry i of each, as RGBA.
    maps = [matplotlib.colormaps[name] for name in _PALETTE]
    palette = [colormap(i) for colormap in maps for i in range(colormap.N)]
    names = list(dict.fromkeys(phase for _, phases, _ in bars for phase in phases))
    return {name: palette[i % len(palette)] for i, name in enumerate(names)}


def _job_name(report: Report) -> str:
    job = _section(report, "job")
    return f"{job.get('model', NA)} model, world size {job.get('world_size', NA)}"


def _section(report: Report, key: str) -> dict[str, Any]:
    value = report.get(key)
    return value if isinstance(value, dict) else {}


def _number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _pair(point: Any) -> bool:
    return isinstance(point, (list, tuple)) and len(point) == 2 and all(map(_number, point))


def _fmt(value: Any, spec: str, unit: str = "") -> str:
    return f"{value:{spec}}{unit}" if _number(value) else NA


def _verdict(bitwise_equal: Any) -> str:
    return (
        "PASSED" if bitwise_equal is True else "FAILED" if bitwise_equal is False else "not checked"
    )


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


class LiveProgress:
    """The live display of a benchmark's runs: a rich progress bar per run on stderr.

    Without a terminal on stderr, or without rich, only the ``run_finished`` lines are printed
    (to stderr); with ``quiet`` nothing is. A display error is logged once and turns the display
    off: it never fails the benchmark. Leaving the ``with`` block (Ctrl-C included) stops the
    display and restores the terminal; exceptions propagate.

    Args:
        quiet: Print nothing.
        total_runs: How many runs the benchmark will make (shown as ``[i/n]``).
        stream: Where to draw; ``sys.stderr`` when ``None``.
    """

    def __init__(self, quiet: bool, total_runs: int, *, stream: TextIO | None = None) -> None:
        self.quiet = quiet
        self.total_runs = total_runs
        self._stream = stream if stream is not None else sys.stderr
        self._progress: Any = None  # rich.progress.Progress while the display is live
        self._task: Any = None
        self._runs = 0

    def __enter__(self) -> LiveProgress:
        if not self.quiet and self._is_tty():
            self._guard(self._start)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop()

    def run_started(self, name: str, total_steps: int) -> None:
        """A new run begins: a new bar of ``total_steps`` steps."""
        self._runs += 1
        description = f"[{self._runs}/{self.total_runs}] {name}"
        if self._progress is not None:
            add = self._progress.add_task  # refreshes the display
            self._task = self._guard(lambda: add(description, total=total_steps, note=""))

    def update(self, step: int, note: str = "") -> None:
        """The current run completed ``step`` steps; ``note`` says what it is doing."""
        if self._progress is not None and self._task is not None:
            self._guard(
                lambda: self._progress.update(self._task, completed=step, note=note, refresh=True)
            )

    def run_finished(self, summary: str) -> None:
        """The current run ended; ``summary`` is kept as one line above the bars."""
        if self.quiet:
            return
        line = f"[{self._runs}/{self.total_runs}] {summary}"
        if self._progress is not None:
            self._guard(lambda: self._progress.console.print(line, markup=False, highlight=False))
        if self._progress is None:  # plain output, or the display just failed
            try:
                print(line, file=self._stream, flush=True)
            except (OSError, ValueError) as e:
                logger.warning("could not write the progress line: %s", e)

    def _is_tty(self) -> bool:
        try:
            return bool(self._stream.isatty())
        except (AttributeError, OSError, ValueError):
            return False

    def _start(self) -> None:
        try:
            from rich import progress as rp
            from rich.console import Console
        except ImportError:
            return  # plain lines
        columns = (
            rp.TextColumn("{task.description}", markup=False),
            rp.BarColumn(),
            rp.MofNCompleteColumn(),
            rp.TimeElapsedColumn(),
            rp.TextColumn("{task.fields[note]}", markup=False),
        )
        # No auto-refresh: every write then happens in our calls, inside our try blocks, and no
        # rich thread outlives an interrupted run. The benches update every 0.5 s anyway.
        console = Console(file=self._stream)
        self._progress = rp.Progress(*columns, console=console, auto_refresh=False)
        self._progress.start()

    def _guard(self, action: Any) -> Any:
        """Run a display action, returning its result; on any error, log it, go plain."""
        try:
            return action()
        except Exception as e:
            logger.warning("progress display failed, continuing without it: %s", e, exc_info=True)
            self._stop()
            return None

    def _stop(self) -> None:
        progress, self._progress, self._task = self._progress, None, None
        if progress is None:
            return
        try:
            progress.stop()  # restores the cursor and sys.stdout / sys.stderr
        except Exception as e:
            logger.warning("could not stop the progress display: %s", e)
