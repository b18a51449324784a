"""The report writer of the failure-injection benchmarks: files, content, progress display."""

from __future__ import annotations

import copy
import io
import json
import sys
import threading

import pytest

from bench.report import LiveProgress, render_markdown, write_report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
FILES = ["report.json", "report.md", "phases.png", "timeline.png"]
CHECKPOINTLESS_PHASES = {
    "detect": 0.03,
    "interrupt": 0.01,
    "communicators": 0.02,
    "plan": 0.2,
    "build": 0.1,
    "transfer": 0.05,
    "restore": 0.06,
    "data": 0.0,
    "replicate": 0.05,
    "first step": 1.4,
    "recompute": 0.0,
}
RESTART_PHASES = {
    "terminate": 0.4,
    "restart processes": 3.1,
    "init communicators": 0.2,
    "load checkpoint": 1.2,
    "warm data": 0.1,
    "recompute": 7.0,
}
SPECS = ["kill:rank=1@step=12:phase=forward", "kill:rank=2@step=30:phase=backward"]


def _fault(spec: str, t_fault: float, phases: dict, reached: int, restored: int) -> dict:
    downtime = round(sum(phases.values()), 3)
    return {
        "spec": spec,
        "t_fault": t_fault,
        "step_reached": reached,
        "step_restored": restored,
        "steps_lost": reached - restored,
        "phases": dict(phases),
        "downtime_s": downtime,
        "recovery_s": downtime,
    }


@pytest.fixture
def report() -> dict:
    """A compare report with two faults in each mode, as the benchmarks build it."""
    return {
        "kind": "compare",
        "command": "p2p-bench compare --fault kill:rank=1@step=12 --fault kill:rank=2@step=30",
        "created": "2026-11-23T10:00:00+00:00",
        "machine": {
            "hostname": "bench-host",
            "cpus": 16,
            "platform": "Linux-6.1-x86_64",
            "python": "3.11.2",
            "torch": "2.5.1",
            "gpu": None,
        },
        "job": {
            "model": "example",
            "num_params": 13400000,
            "state_mib_per_rank": 38.7,
            "nnodes": 2,
            "nproc_per_node": 2,
            "world_size": 4,
            "steps": 40,
            "spares": [1, 0],
            "checkpoint_every": 10,
        },
        "faults": list(SPECS),
        "modes": {
            "checkpointless": {
                "wall_s": 61.2,
                "exit_codes": [0, 0],
                "faults": [
                    _fault(SPECS[0], 13.0, CHECKPOINTLESS_PHASES, 11, 11),
                    _fault(SPECS[1], 34.0, CHECKPOINTLESS_PHASES, 29, 29),
                ],
                "timeline": [[float(t), t] for t in range(12)]
                + [[15.0 + t, 12 + t] for t in range(18)]
                + [[36.0 + t, 30 + t] for t in range(11)],
                "bitwise_equal": True,
                "differences": [],
            },
            "restart": {
                "wall_s": 80.5,
                "exit_codes": [0],
                "faults": [
                    _fault(SPECS[0], 13.0, RESTART_PHASES, 11, 10),
                    _fault(SPECS[1], 45.0, RESTART_PHASES, 29, 20),
                ],
                "timeline": [[float(t), t] for t in range(12)]
                + [[25.0 + t, 11 + t] for t in range(19)]
                + [[57.0 + t, 21 + t] for t in range(20)],
                "bitwise_equal": None,
            },
        },
        "summary": {
            "downtime_checkpointless_s": 3.84,
            "downtime_restart_s": 24.0,
            "downtime_reduction_pct": 84.2,
            "bitwise_equal": True,
            "notes": ["Measured on 16 CPU cores, no GPU."],
        },
    }


def test_write_report_writes_the_four_files_in_order(report, tmp_path):
    out = tmp_path / "reports" / "compare-1"
    paths = write_report(report, out)
    assert [p.name for p in paths] == FILES
    assert all(p.parent == out and p.is_file() for p in paths)


def test_report_json_round_trips(report, tmp_path):
    expected = copy.deepcopy(report)
    write_report(report, tmp_path)
    assert json.loads((tmp_path / "report.json").read_text()) == expected


def test_markdown_has_the_figures_phases_and_faults(report, tmp_path):
    write_report(report, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "84.2 %" in md
    assert "| bitwise check | PASSED |" in md
    assert report["command"] in md
    for phase in [*CHECKPOINTLESS_PHASES, *RESTART_PHASES]:
        assert f"| {phase} |" in md, phase
    for spec in SPECS:
        assert f"`{spec}`" in md
    assert "| **downtime** | **1.920** |" in md
    assert "| **downtime** | **12.000** |" in md
    assert "| restored step | 20 (reached 29) |" in md
    assert "## checkpoint-restart" in md
    assert "![phases](phases.png)" in md and "![timeline](timeline.png)" in md
    assert "How to read this" in md


def test_pngs_are_real_images(report, tmp_path):
    write_report(report, tmp_path)
    for name in ("phases.png", "timeline.png"):
        data = (tmp_path / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE), name
        assert len(data) > 20_000, (name, len(data))


@pytest.mark.parametrize(("value", "verdict"), [(False, "FAILED"), (None, "not checked")])
def test_bitwise_verdict_follows_the_summary(report, value, verdict):
    report["summary"]["bitwise_equal"] = value
    md = render_markdown(report)
    assert f"| bitwise check | {verdict} |" in md
    assert "PASSED" not in md.split("## Job")[0]


def test_partial_report_still_writes_and_says_na(report, tmp_path):
    del report["summary"]
    report["modes"]["checkpointless"] = {"faults": []}
    report["modes"]["restart"]["faults"] = [
        {"spec": SPECS[0], "t_fault": 13.0, "error": "the job did not restart"}
    ]
    del report["modes"]["restart"]["timeline"]
    paths = write_report(report, tmp_path)
    assert [p.name for p in paths] == FILES
    md = (tmp_path / "report.md").read_text()
    assert "| downtime reduction | n/a |" in md
    assert "| downtime, checkpointless (all faults) | n/a |" in md
    assert "Faults measured: n/a." in md
    assert "Not measured: the job did not restart." in md
    assert "| bitwise check | not checked |" in md


def test_empty_report_still_writes(tmp_path):
    paths = write_report({}, tmp_path)
    assert [p.name for p in paths] == FILES
    md = (tmp_path / "report.md").read_text()
    assert "Faults injected: n/a." in md
    assert (tmp_path / "phases.png").read_bytes().startswith(PNG_SIGNATURE)


def test_without_matplotlib_writes_json_and_markdown(report, tmp_path, monkeypatch):
    # None in sys.modules makes `import matplotlib` raise ImportError.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    paths = write_report(report, tmp_path)
    assert [p.name for p in paths] == ["report.json", "report.md"]
    md = (tmp_path / "report.md").read_text()
    assert "pip install -e '.[bench]'" in md
    assert "![phases]" not in md
    assert not (tmp_path / "phases.png").exists()


def test_quiet_progress_prints_nothing_and_lets_exceptions_through(capsys):
    with pytest.raises(RuntimeError, match="boom"), LiveProgress(quiet=True, total_runs=2) as live:
        live.run_started("checkpointless", 20)
        live.update(5, "recovering")
        live.run_finished("checkpointless run: exit codes [0, 0]")
        raise RuntimeError("boom")
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == ""


def test_progress_without_a_terminal_prints_only_finished_lines(capsys):
    with LiveProgress(quiet=False, total_runs=2) as live:
        live.run_started("checkpointless", 20)
        live.update(5, "recovering")
        live.run_finished("checkpointless run: exit codes [0, 0]")
        live.run_started("checkpoint-restart", 20)
        live.run_finished("checkpoint-restart run: exit code 0")
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        "[1/2] checkpointless run: exit codes [0, 0]",
        "[2/2] checkpoint-restart run: exit code 0",
    ]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class _BrokenTerminal(_Terminal):
    def write(self, text: str) -> int:
        raise OSError("the terminal went away")


def test_progress_on_a_terminal_draws_bars_and_cleans_up_on_error():
    stream = _Terminal()
    stdout, stderr, threads = sys.stdout, sys.stderr, threading.active_count()
    with pytest.raises(KeyboardInterrupt), LiveProgress(False, 1, stream=stream) as live:
        live.run_started("checkpointless", 20)
        live.update(7, "recovering")
        live.run_finished("checkpointless run: exit codes [0, 0]")
        assert sys.stdout is not stdout  # rich redirects prints above the bars while live
        raise KeyboardInterrupt
    text = stream.getvalue()
    assert "[1/1] checkpointless" in text and "7/20" in text and "recovering" in text
    assert "[1/1] checkpointless run: exit codes [0, 0]" in text
    assert (sys.stdout, sys.stderr) == (stdout, stderr)
    assert threading.active_count() == threads


def test_progress_survives_a_broken_display(caplog):
    stream = _BrokenTerminal()
    stdout = sys.stdout
    with LiveProgress(quiet=False, total_runs=1, stream=stream) as live:
        live.run_started("checkpointless", 20)
        live.update(3)
        live.run_finished("checkpointless run: exit codes [0, 0]")
    assert sys.stdout is stdout
    assert "progress display failed" in caplog.text


def test_markdown_names_faults_that_never_fired_and_lost_copies(report):
    section = report["modes"]["checkpointless"]
    section["not_fired"] = ["during-recovery:rank=2@recovery=1:phase=transfer"]
    section["faults"][1].update(restored_from="checkpoint", every_copy_lost="by design")
    text = render_markdown(report)
    assert "never fired" in text and "`during-recovery:rank=2@recovery=1:phase=transfer`" in text
    assert "| restored from | checkpoint |" in text
    assert "| every copy of a shard lost | by design |" in text
    del section["not_fired"]
    assert "never fired" not in render_markdown(report)


def test_spares_cover_a_rank_and_all_its_k_holders():
    from bench.fault_runs import spares_for
    from bench.faults import parse_fault

    buddies = [parse_fault("kill-buddies:rank=1@step=3")]
    assert spares_for(buddies, 2, 2) == [1, 1]
    assert spares_for(buddies, 2, 2, replicas=2) == [2, 1]


def _gpu_check_cut_short() -> dict:
    """The ``report.json`` of a gpu-check run cut short: two checks, the second one raised."""
    from bench.bench_reports import CheckError, GpuCheckReport
    from bench.reports import Machine

    report = GpuCheckReport(
        device="NVIDIA H200",
        num_gpus=1,
        machine=Machine("gpu-host", 16, "Linux-6.1-x86_64", "3.11.2", "2.5.1", "NVIDIA H200"),
        command="p2p-bench gpu-check",
        checks={
            "copies": {"bytes": 1 << 26, "d2d_gbps": 1000.0},
            "checksum": CheckError("RuntimeError: no kernel", "Traceback ...\n"),
        },
    )
    return json.loads(json.dumps(report.to_json()))


@pytest.mark.parametrize("kind", ["gpu-check cut short", "sections that are errors"])
def test_a_partial_report_or_one_with_errors_renders_without_a_traceback(report, tmp_path, kind):
    if kind == "gpu-check cut short":
        doc = _gpu_check_cut_short()
    else:
        doc = report
        doc["modes"]["checkpointless"] = {"error": "RuntimeError: boom", "traceback": "T"}
        doc["modes"]["restart"]["faults"] = {"error": "RuntimeError: no faults"}
        doc["modes"]["restart"]["timeline"] = {"error": "RuntimeError: no timeline"}
        doc["summary"] = {"error": "RuntimeError: no summary"}
        doc["job"] = {"error": "RuntimeError: no job"}
    paths = write_report(doc, tmp_path)
    assert [p.name for p in paths] == FILES
    assert json.loads((tmp_path / "report.json").read_text()) == doc
    md = (tmp_path / "report.md").read_text()
    assert "| bitwise check | not checked |" in md and "| model | n/a |" in md
    if kind == "gpu-check cut short":
        assert "| gpu | NVIDIA H200 |" in md and "p2p-bench gpu-check" in md
    else:
        assert "The run failed:" in md and "RuntimeError: boom" in md
