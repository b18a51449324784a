"""The report folder of ``p2p-bench scale-report``: ``report.json``, ``report.md`` and plots
(``tornado.png``, ``sizes.png``, ``phases.png``). matplotlib is optional: without it the plots
are skipped and the Markdown says so."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def write(report: dict[str, Any], out_dir: str | Path, *, plots: bool = True) -> list[Path]:
    """Write the folder; the JSON first so a failing plot never loses the figures."""
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / "report.json"]
    paths[0].write_text(json.dumps(report, indent=2, default=str) + "\n")
    pngs, missing = [], None
    if plots:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot
        except ImportError:
            missing = "Plots skipped: matplotlib is missing (`pip install -e '.[bench]'`)."
        else:
            for name, fn in (
                ("tornado.png", _tornado),
                ("sizes.png", _sizes),
                ("phases.png", _phases),
            ):
                try:
                    fn(report, folder / name)
                    pngs.append(folder / name)
                except Exception as e:  # a plot must not fail the report
                    logger.warning("could not draw %s: %s", name, e, exc_info=True)
                    missing = f"Plot {name} failed: {e}"
    (folder / "report.md").write_text(markdown(report, [p.name for p in pngs], missing))
    return [*paths, folder / "report.md", *pngs]


def _t(head: tuple[str, ...], rows: list[tuple[Any, ...]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return out


def _s(x: float) -> str:
    return f"{x:.3g} s" if x < 100 else f"{x:,.0f} s"


def markdown(report: dict[str, Any], pngs: list[str], missing: str | None = None) -> str:
    """The report for people."""
    job, h = report["job"], report["headline"]
    lo, hi = h["recovery_range_s"]
    rlo, rhi = h["downtime_reduction_range_pct"]
    glo, ghi = h["goodput_range_pct"]
    clo, chi = h["goodput_restart_range_pct"]
    out = [
        f"# Recovery time at {job['gpus']:,} GPUs: {job['model']} on {job['hardware']}",
        "",
        f"Created {report['created']} (modelled, offline).",
        "",
        "```",
        report["command"],
        "```",
        "",
        "## Summary",
        "",
        *_t(
            ("", f"k={h['replicas']}", "range (sensitivity)"),
            [
                ("recovery, fault -> training back", _s(h["recovery_s"]), f"{lo:.1f}-{hi:.1f} s"),
                (
                    "less downtime per fault than checkpoint-restart",
                    f"{h['downtime_reduction_pct']:.1f} %",
                    f"{rlo:.1f}-{min(rhi, 100):.1f} %",
                ),
                ("goodput over a month", f"{h['goodput_pct']:.2f} %", f"{glo:.2f}-{ghi:.2f} %"),
                (
                    "goodput, checkpoint-restart",
                    f"{h['goodput_restart_pct']:.2f} %",
                    f"{clo:.2f}-{chi:.2f} %",
                ),
            ],
        ),
        "",
        f"Step time {job['step_s']:.2f} s; training state {job['state_gib_per_gpu']:.2f} GiB per "
        f"GPU; checkpoints every {job['checkpoint_every_min']:g} min to {job['storage']}; "
        f"replicas in {job['replica_memory']} memory, {job['placement']} placement.",
        "",
        "## Validation on this machine",
        "",
        "The same formulas, fed with this machine's measured inputs, against this machine's "
        "measured `recover`, `compare` and `resize` results. `calibration` rows are the runs "
        "the fixed costs were taken from; `held-out` rows are predictions. Target: within 25 %; "
        f"{h['validation_within_25_pct']} of {h['validation_rows']} rows are; worst held-out: "
        f"{h['validation_worst_held_out']['name']}, "
        f"{h['validation_worst_held_out']['error_pct']:+.1f} %."
        + (
            " What the model leaves out, and why a row misses: docs/scale-model.md."
            if h["validation_within_25_pct"] < h["validation_rows"]
            else ""
        ),
        "",
        *_t(
            ("phase sum", "kind", "predicted", "measured", "error"),
            [
                (
                    v["name"],
                    v["kind"],
                    _s(v["predicted_s"]),
                    _s(v["measured_s"]),
                    f"{v['error_pct']:+.1f} %",
                )
                for v in report["validation"]
            ],
        ),
        "",
        "## Scenarios (one fault)",
        "",
        *_t(
            ("scenario", "recovery_s", "downtime_s"),
            [(k, _s(v["recovery_s"]), _s(v["downtime_s"])) for k, v in report["scenarios"].items()],
        ),
        "",
    ]
    for name, sc in report["scenarios"].items():
        if "phases_s" in sc:
            phases = ", ".join(f"{k} {_s(v)}" for k, v in sc["phases_s"].items())
            out.append(f"- **{name}**: {phases}")
    out += ["", "## Goodput over a month (Monte Carlo)", ""]
    rows = []
    for name, g in report["goodput"].items():
        rows.append(
            (
                name,
                f"{g['faults_per_period']:.1f}",
                f"{g['double_fault_incidents_per_period']:.3f}" if "trials" in g else "-",
                f"{g.get('copies_lost_fraction', 0):.2e} (analytic "
                f"{g.get('copies_lost_fraction_analytic', 0):.2e})"
                if "copies_lost_fraction" in g
                else "-",
                f"{g.get('cold_fallbacks_per_period', 0):.3f}" if "trials" in g else "every fault",
                _s(g["downtime_per_day_s"]),
                f"{100 * g['goodput']:.2f} %",
            )
        )
    out += _t(
        (
            "mode",
            "faults",
            "double faults",
            "faults losing every copy",
            "cold fallbacks",
            "downtime/day",
            "goodput",
        ),
        rows,
    )
    out += ["", "## Memory per GPU", ""]
    out += _t(
        (
            "k",
            "state",
            "snapshot + replicas",
            "GPU free",
            "fits GPU",
            "node pinned need / can",
            "fits host",
            "fix",
        ),
        [
            (
                m["replicas"],
                f"{m['state_gib_per_gpu']:.2f} GiB",
                f"{m['snapshot_and_replicas_gib_per_gpu']:.2f} GiB",
                f"{m['gpu_free_gib']:.1f} GiB",
                m["fits_gpu"],
                f"{m['node_pinned_need_gib']:.0f} / {m['node_pinnable_gib']:.0f} GiB",
                m["fits_host"],
                m["fix"] or "-",
            )
            for m in report["memory"]
        ],
    )
    out += ["", "## Sensitivity of the recovery time", ""]
    out += _t(
        ("input", "at low", "at high"),
        [
            (r["input"], _s(r["low"]), _s(r["high"]))
            for r in report["sensitivity"]["recovery_s"][:10]
        ],
    )
    out += ["", "## Recovery against job size", ""]
    out += _t(
        ("GPUs", "recovery", "checkpoint-restart downtime", "control plane"),
        [
            (f"{s['gpus']:,}", _s(s["recovery_s"]), _s(s["restart_downtime_s"]), s["control_plane"])
            for s in report["sizes"]
        ],
    )
    out += ["", "## Inputs", ""]
    out += _t(
        ("input", "value", "unit", "label", "source"),
        [
            (k, f"{v['value']:.4g}", v["unit"], v["label"], v["source"])
            for k, v in report["inputs"].items()
        ],
    )
    out += ["", "## Plots", ""]
    out += [f"![{p}]({p})" for p in pngs] or [missing or "Plots skipped (--no-plots)."]
    out.append("")
    return "\n".join(out)


def _tornado(report: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    rows = report["sensitivity"]["recovery_s"][:12][::-1]
    base = report["headline"]["recovery_s"]
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(rows) + 1.5))
    for i, r in enumerate(rows):
        lo, hi = min(r["low"], r["high"]), max(r["low"], r["high"])
        ax.barh(i, hi - lo, left=lo, color="tab:blue")
    ax.axvline(base, color="black", lw=1)
    ax.set_yticks(range(len(rows)), [r["input"] for r in rows])
    ax.set_xlabel("recovery (s), each input at its low and high bound")
    ax.set_title(f"What moves the recovery time ({report['job']['gpus']:,} GPUs)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _sizes(report: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    sizes = report["sizes"]
    x = [s["gpus"] for s in sizes]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(x, [s["recovery_s"] for s in sizes], "o-", label="checkpointless (k=1)")
    ax.plot(
        x,
        [s["restart_downtime_s"] for s in sizes],
        "s-",
        color="tab:red",
        label="checkpoint-restart",
    )
    extra = [s["gpus"] for s in sizes if s["control_plane"].startswith("extrapolated")]
    beyond = [g for g in extra if g > min(x)]
    if beyond:
        start = max(g for g in x if g < min(beyond))
        ax.axvspan(start, max(x), color="0.9", label="control plane extrapolated")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("downtime per fault (s)")
    ax.legend()
    ax.set_title("Recovery against job size")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _phases(report: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    names = [k for k, v in report["scenarios"].items() if "phases_s" in v]
    zoom = [n for n in names if n != "checkpoint-restart"]
    fig, axes = plt.subplots(2, 1, figsize=(10, 0.5 * (len(names) + len(zoom)) + 2.5))
    cmap = plt.get_cmap("tab20")
    seen: dict[str, Any] = {}
    for ax, rows, title in (
        (axes[0], names, "One fault, phase by phase"),
        (axes[1], zoom, "Checkpointless and resizes (zoomed)"),
    ):
        for i, name in enumerate(rows):
            left = 0.0
            for phase, v in report["scenarios"][name]["phases_s"].items():
                colour = seen.setdefault(phase, cmap(len(seen) % 20))
                ax.barh(i, v, left=left, color=colour)
                left += v
        ax.set_yticks(range(len(rows)), rows)
        ax.set_title(title)
    axes[1].set_xlabel("seconds, phases stacked")
    handles = [Patch(color=c, label=p) for p, c in seen.items()]
    fig.legend(handles=handles, fontsize=7, loc="center right")
    fig.tight_layout(rect=(0, 0, 0.82, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)
