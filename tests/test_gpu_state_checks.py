"""The training checks of ``p2p-bench gpu-check``, run on the CPU over gloo.

On a GPU the same functions run over NCCL with GPU memory (``p2p-bench gpu-check``); here they
check what does not need one: the bitwise restore with the default and fused AdamW, the
replicate() timing loop, the report lines and verdict, and the report a run writes (its checks
faked). The GPU-only checks refuse a CPU device.
"""

from __future__ import annotations

import argparse
import json
import re

import pytest
import torch

from bench import gpu_check
from bench.bench_reports import CheckError, GpuCheckReport
from bench.errors import UsageError
from bench.gpu_state_checks import bitwise_restore, rebuild_peak, replicate_blocking, stream_race

CPU = torch.device("cpu")


MACHINE = {
    "hostname": "gpu-host",
    "cpus": 16,
    "platform": "Linux-6.1-x86_64",
    "python": "3.11.2",
    "torch": "2.5.1",
    "gpu": "GPU",
}


def _report(**sections: object) -> GpuCheckReport:
    """A gpu-check report of a one-GPU machine holding ``sections``, in the order given."""
    doc = {"device": "GPU", "num_gpus": 1, "machine": MACHINE, "command": "p2p-bench gpu-check"}
    return GpuCheckReport.from_json({**doc, **sections})


@pytest.mark.parametrize("variant", ["default", "fused"])
def test_capture_and_restore_of_a_one_rank_fsdp2_model_is_bitwise(variant):
    assert bitwise_restore(CPU, variant, preset="tiny") == {
        "variant": variant,
        "restored_equal": True,
        "redone_equal": True,
        "moved": True,
        "passed": True,
    }


def test_an_optimizer_that_cannot_run_here_is_reported_not_raised():
    r = bitwise_restore(CPU, "capturable", preset="tiny")  # capturable AdamW needs a GPU
    assert r["passed"] is False and r["variant"] == "capturable" and r["error"]


def test_replicate_timing_runs_a_real_replicator_on_one_rank():
    r = replicate_blocking(CPU, preset="tiny", steps=2)
    assert set(r) == {
        "preset",
        "variant",
        "steps",
        "host_blocked_ms",
        "host_step_ms",
        "host_vs_step",
    }
    assert r["host_blocked_ms"] > 0 and r["host_step_ms"] > 0


def test_the_gpu_only_checks_refuse_a_cpu_device():
    with pytest.raises(ValueError, match="needs a CUDA device"):
        stream_race(CPU)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        rebuild_peak(CPU)


def test_report_lines_and_verdict():
    report = _report(
        bitwise_restore=[
            {"variant": "default", "passed": True},
            {"variant": "capturable", "passed": False, "error": "RuntimeError: x"},
        ],
        replicate_blocking={
            "staged_blocked_ms": 0.21,
            "staged_step_ms": 40.0,
            "staged_vs_step": 0.005,
            "unstaged_blocked_ms": 30.0,
            "unstaged_vs_step": 0.75,
        },
        stream_race={"fenced_equal": True, "unfenced_differs": True, "passed": True},
        rebuild_peak={
            "released_gib": 2.0,
            "released_vs_plain": 1.0,
            "kept_gib": 3.0,
            "kept_vs_plain": 1.5,
            "uncollected_gib": 4.0,
            "uncollected_vs_plain": 2.0,
        },
        not_measured=["x"],
    )
    assert not report.errors  # a variant's error is its own figure, beside its verdict
    lines = gpu_check._table(report).splitlines()[2:]  # after the title and the skipped tests
    assert lines[0] == "  restore AdamW default    bitwise"
    assert lines[1] == "  restore AdamW capturable FAILED RuntimeError: x"
    assert "0.21 ms per 40.0 ms step (0.005x)" in lines[2] and "30.00 ms (0.750x)" in lines[2]
    assert "without the fence it is overwritten: True" in lines[3]
    assert lines[4] == (
        "  rebuild peak     2.00 GiB as the engine does it (1.00x a plain step); failed frames "
        "kept 3.00 GiB (1.50x); old model not collected 4.00 GiB (2.00x)"
    )
    assert report.passed is False
    restores = report.checks["bitwise_restore"]
    assert isinstance(restores, list)
    restores.pop()
    assert report.passed is True
    report.section("stream_race")["passed"] = False
    assert report.passed is False


def test_a_check_that_raised_is_printed_as_its_error_and_fails_the_run():
    report = _report(
        unit_tests={"passed": True, "summary": "3 passed", "failures": []},
        rebuild_peak={"error": "RuntimeError: out of memory"},  # as read back: no traceback
    )
    report.checks["stream_race"] = gpu_check._guarded(lambda: 1 / 0)
    lines = gpu_check._table(report).splitlines()
    assert lines[1] == "  unit tests       3 passed"
    assert lines[2] == "  stream_race      ERROR ZeroDivisionError: division by zero"
    error = report.checks["stream_race"]
    assert isinstance(error, CheckError) and "ZeroDivisionError" in (error.traceback or "")
    assert lines[3] == "  rebuild_peak     ERROR RuntimeError: out of memory"
    assert report.passed is False
    assert report.to_json()["rebuild_peak"] == {"error": "RuntimeError: out of memory"}
    del report.checks["stream_race"], report.checks["rebuild_peak"]
    assert report.passed is True


@pytest.fixture
def replication() -> dict:
    """The replication section as ``_replication`` keeps it from ``p2p-bench replicate``."""
    return {
        "replication_backend": "nccl",
        "replica_memory": "gpu",
        "snapshot_mib_per_rank": 96.0,
        "round_gbps": 1.5,
        "replication_gbps": 2.0,
        "raw_sendrecv_gbps": 2.5,
        "replication_vs_raw": 0.8,
        "overhead_pct": 3.0,
        "step_time_ms_off": 20.0,
        "step_time_ms_on": 20.6,
        "snapshot_vs_memcpy": 0.9,
        "copy_ms": 1.5,
        "post_ms": 0.25,
        "transport": "NCCL's socket transport (the ranks share a GPU)",
    }


@pytest.fixture
def kill() -> dict:
    """A kill-and-recover section whose bitwise check failed."""
    return {
        "fault": gpu_check.KILL,
        "passed": False,
        "differences": ["rank 2: parameters differ"],
        "downtime_s": 1.25,
        "steps_lost": 1,
        "restored_from": "peers",
        "phases_ms": {"detect": 20.0, "transfer": 5.0},
    }


def test_the_replication_and_kill_sections_are_printed_with_their_references(replication, kill):
    report = _report(replication=replication, kill_and_recover=kill)
    lines = gpu_check._table(report).splitlines()
    assert lines[2].startswith("  replication      2.00 GB/s over nccl from gpu memory (0.80x raw")
    assert lines[3] == (
        "  step with it     20.6 ms against 20.0 ms without (+3.0 %); the training thread "
        "enqueues the copy in 1.50 ms and posts the transfers in 0.25 ms"
    )
    assert lines[4] == (
        f"  kill + recover   {gpu_check.KILL}: FAILED rank 2: parameters differ; downtime 1.25 s,"
        " 1 step(s) lost, restored from peers (detect 20, transfer 5 ms)"
    )
    assert report.passed is False
    report.section("kill_and_recover")["passed"] = True
    assert report.passed is True


COPIES = {
    "bytes": 1 << 20,
    "d2d_gbps": 1000.0,
    "pinned_d2h_gbps": 50.0,
    "pinned_h2d_gbps": 52.5,
    "d2h_vs_d2d": 0.05,
    "h2d_vs_d2d": 0.0525,
}
CHECKSUM = {
    "kernel": "cupy",
    "gpu_gbps": 300.0,
    "gpu_vs_d2d_copy": 0.3,
    "host_gbps": 2.0,
    "gpu_equals_host": True,
}
PINNED = [{"mib": 96, "alloc_ms": 5.0, "taken_mib": 128.0, "expected_mib": 128.0, "fresh": True}]
UNIT_TESTS = {"passed": True, "summary": "3 passed", "failures": []}


@pytest.fixture
def faked_checks(monkeypatch, replication, kill):
    """``gpu_check.run`` on a pretended GPU whose checks return canned figures at once and
    pass, but the stream race raises; the unit tests, last, return :data:`UNIT_TESTS`, or raise
    what the returned dict's ``result`` is set to."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "GPU")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def race() -> dict:
        raise RuntimeError("out of memory")

    monkeypatch.setattr(gpu_check, "_copies", lambda nbytes, repeats: dict(COPIES))
    monkeypatch.setattr(gpu_check, "_checksums", lambda nbytes, repeats: dict(CHECKSUM))
    monkeypatch.setattr(gpu_check, "_pinned_alloc", lambda: list(PINNED))
    checks = {"bitwise_restore": lambda: [{"variant": "default", "passed": True}]}
    monkeypatch.setattr(gpu_check, "_state_checks", lambda d, p: {**checks, "stream_race": race})
    monkeypatch.setattr(gpu_check, "_replication", lambda folder, preset: replication)
    recovered = {**kill, "passed": True, "differences": []}
    monkeypatch.setattr(gpu_check, "_kill_and_recover", lambda folder, preset: recovered)
    unit_tests: dict = {"result": UNIT_TESTS}

    def units(folder):
        if isinstance(unit_tests["result"], BaseException):
            raise unit_tests["result"]
        return unit_tests["result"]

    monkeypatch.setattr(gpu_check, "_unit_tests", units)
    return unit_tests


def _args(out, as_json: bool, only: str | None = None) -> argparse.Namespace:
    return argparse.Namespace(
        command="gpu-check",
        mib=1,
        repeats=1,
        skip_tests=False,
        only=only,
        model="tiny",
        out_dir=str(out),
        json=as_json,
    )


def test_the_report_names_each_check_in_the_order_run_and_what_it_did_not_measure(
    faked_checks, tmp_path, capsys
):
    assert gpu_check.run(_args(tmp_path, True)) == 1  # the stream race raised
    printed = json.loads(capsys.readouterr().out)
    assert printed.pop("report_dir") == str(tmp_path)
    assert json.loads((tmp_path / "report.json").read_text()) == printed
    header = ["benchmark", "cuda", "device", "num_gpus", "machine", "command"]
    checks = ["copies", "checksum", "pinned_alloc", "bitwise_restore", "stream_race"]
    checks += ["replication", "kill_and_recover", "unit_tests"]
    assert list(printed) == [*header, *checks, "not_measured"]
    assert printed["benchmark"] == "gpu-check" and printed["cuda"] is True
    assert list(printed["stream_race"]) == ["error", "traceback"]
    assert printed["stream_race"]["error"] == "RuntimeError: out of memory"
    assert printed["unit_tests"] == UNIT_TESTS and printed["copies"] == COPIES
    back = GpuCheckReport.from_json(printed)
    assert back.to_json() == printed and list(back.errors) == ["stream_race"]
    assert not back.passed


def test_a_run_cut_short_leaves_the_checks_it_finished(faked_checks, tmp_path, capsys):
    faked_checks["result"] = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        gpu_check.run(_args(tmp_path, False))
    assert capsys.readouterr().out == ""
    doc = json.loads((tmp_path / "report.json").read_text())
    assert list(doc)[-2:] == ["replication", "kill_and_recover"]  # no unit tests, no verdict
    report = GpuCheckReport.from_json(doc)
    assert report.not_measured is None and "unit_tests" not in report.checks
    lines = gpu_check._table(report).splitlines()
    assert lines[1] == "  unit tests       not run"
    assert "  stream_race      ERROR RuntimeError: out of memory" in lines
    assert lines[-1] == "  not measured yet: "


def test_only_runs_the_checks_it_names_and_the_report_says_what_it_left_out(
    faked_checks, tmp_path, capsys
):
    assert gpu_check.run(_args(tmp_path, True, only="kill_and_recover, copies")) == 0
    printed = json.loads(capsys.readouterr().out)
    assert [k for k in printed if k in gpu_check.CHECKS] == ["copies", "kill_and_recover"]
    left_out = [n for n in gpu_check.CHECKS if n not in ("copies", "kill_and_recover")]
    assert printed["not_measured"][-1] == "left out: " + ", ".join(left_out)
    lines = gpu_check._table(GpuCheckReport.from_json(printed)).splitlines()
    assert lines[1] == "  unit tests       not run"


@pytest.mark.parametrize("only", ["kill", "copies,nope", ","])
def test_only_with_no_such_check_is_refused_with_the_names_to_choose_from(
    faked_checks, tmp_path, only
):
    with pytest.raises(UsageError, match="name one or more of copies, checksum"):
        gpu_check.run(_args(tmp_path, True, only=only))
    assert not (tmp_path / "report.json").exists()


def test_the_kill_check_keeps_every_process_log_of_its_runs(tmp_path):
    work = tmp_path / "work"
    (work / "checkpointless").mkdir(parents=True)
    (work / "checkpointless" / "p2p-run-1.log").write_text("injecting\n")
    (work / "checkpointless" / "model.distcp").write_text("not a log")
    (work / "reference.log").write_text("fault-free\n")
    gpu_check._keep_logs(work, tmp_path / "logs")
    kept = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert kept == ["checkpointless-p2p-run-1.log", "reference.log"]
    assert (tmp_path / "logs" / "checkpointless-p2p-run-1.log").read_text() == "injecting\n"


def test_the_unit_test_check_reports_pytest_s_counts(tmp_path):
    """Here every GPU test skips; the summary is pytest's closing line, not a skip reason."""
    result = gpu_check._unit_tests(tmp_path)
    assert result["passed"] is True and result["failures"] == []
    assert re.fullmatch(r"\d+ skipped, \d+ deselected in [\d.]+s", result["summary"])
    assert "needs a CUDA device" in (tmp_path / "unit-tests.log").read_text()
