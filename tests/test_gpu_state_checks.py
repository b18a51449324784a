"""The training checks of ``p2p-bench gpu-check``, run on the CPU over gloo.

On a GPU the same functions run over NCCL with GPU memory (``p2p-bench gpu-check``); here they
check what does not need one: the bitwise restore with the default and fused AdamW, the
replicate() timing loop, the report lines and verdict. The GPU-only checks refuse a CPU device.
"""

from __future__ import annotations

import pytest
import torch

from bench import gpu_check
from bench.gpu_state_checks import bitwise_restore, rebuild_peak, replicate_blocking, stream_race

CPU = torch.device("cpu")


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
    report = {
        "bitwise_restore": [
            {"variant": "default", "passed": True},
            {"variant": "capturable", "passed": False, "error": "RuntimeError: x"},
        ],
        "replicate_blocking": {
            "staged_blocked_ms": 0.21,
            "staged_step_ms": 40.0,
            "staged_vs_step": 0.005,
            "unstaged_blocked_ms": 30.0,
            "unstaged_vs_step": 0.75,
        },
        "stream_race": {"fenced_equal": True, "unfenced_differs": True, "passed": True},
        "rebuild_peak": {
            "released_gib": 2.0,
            "released_vs_plain": 1.0,
            "kept_gib": 3.0,
            "kept_vs_plain": 1.5,
            "uncollected_gib": 4.0,
            "uncollected_vs_plain": 2.0,
        },
    }
    report.update(device="GPU", num_gpus=1, not_measured=["x"])
    lines = gpu_check._table(report).splitlines()[2:]  # after the title and the skipped tests
    assert lines[0] == "  restore AdamW default    bitwise"
    assert lines[1] == "  restore AdamW capturable FAILED RuntimeError: x"
    assert "0.21 ms per 40.0 ms step (0.005x)" in lines[2] and "30.00 ms (0.750x)" in lines[2]
    assert "without the fence it is overwritten: True" in lines[3]
    assert lines[4] == (
        "  rebuild peak     2.00 GiB as the engine does it (1.00x a plain step); failed frames "
        "kept 3.00 GiB (1.50x); old model not collected 4.00 GiB (2.00x)"
    )
    assert gpu_check.passed(report) is False
    report["bitwise_restore"].pop()
    assert gpu_check.passed(report) is True
    report["stream_race"]["passed"] = False
    assert gpu_check.passed(report) is False


def test_a_check_that_raised_is_printed_as_its_error_and_fails_the_run():
    report = {
        "device": "GPU",
        "num_gpus": 1,
        "unit_tests": {"passed": True, "summary": "3 passed", "failures": []},
        "stream_race": gpu_check._guarded(lambda: 1 / 0),
        "rebuild_peak": {"error": "RuntimeError: out of memory"},
    }
    lines = gpu_check._table(report).splitlines()
    assert lines[1] == "  unit tests       3 passed"
    assert lines[2] == "  stream_race      ERROR ZeroDivisionError: division by zero"
    assert "ZeroDivisionError" in report["stream_race"]["traceback"]
    assert lines[3] == "  rebuild_peak     ERROR RuntimeError: out of memory"
    assert gpu_check.passed(report) is False
    del report["stream_race"], report["rebuild_peak"]
    assert gpu_check.passed(report) is True


def test_the_replication_and_kill_sections_are_printed_with_their_references():
    replication = {
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
        "transport": "NCCL's socket transport (the ranks share a GPU)",
    }
    kill = {
        "fault": gpu_check.KILL,
        "passed": False,
        "differences": ["rank 2: parameters differ"],
        "downtime_s": 1.25,
        "steps_lost": 1,
        "restored_from": "peers",
        "phases_ms": {"detect": 20.0, "transfer": 5.0},
    }
    report = {"device": "GPU", "num_gpus": 1, "replication": replication, "kill_and_recover": kill}
    lines = gpu_check._table(report).splitlines()
    assert lines[2].startswith("  replication      2.00 GB/s over nccl from gpu memory (0.80x raw")
    assert lines[3] == "  step with it     20.6 ms against 20.0 ms without (+3.0 %)"
    assert lines[4] == (
        f"  kill + recover   {gpu_check.KILL}: FAILED rank 2: parameters differ; downtime 1.25 s,"
        " 1 step(s) lost, restored from peers (detect 20, transfer 5 ms)"
    )
    assert gpu_check.passed(report) is False
    kill["passed"] = True
    assert gpu_check.passed(report) is True
