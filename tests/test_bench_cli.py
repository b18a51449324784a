"""The benchmarks run end to end (tiny settings; no timing is asserted)."""

from __future__ import annotations

import json

import pytest

from bench.cli import main

pytestmark = pytest.mark.slow


def _run(capsys, *argv):
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_data_bench(capsys, tmp_path):
    r = _run(
        capsys,
        "data",
        "--size-mb",
        "2",
        "--seq-len",
        "64",
        "--resume-step",
        "3",
        "--batches",
        "5",
        "--dir",
        str(tmp_path),
        "--json",
    )
    assert r["first_batch_from_cache_s"] > 0 and r["samples"] > 0


def test_control_plane_bench(capsys):
    r = _run(
        capsys,
        "control-plane",
        "--ranks",
        "32",
        "--workers",
        "2",
        "--exits",
        "2",
        "--hangs",
        "1",
        "--heartbeat-timeout",
        "1",
        "--heartbeat-interval",
        "0.2",
        "--cpu-window",
        "0.5",
        "--json",
    )
    (size,) = r["sizes"]
    assert size["ranks"] == 32 and size["exit_trials"] == 2 and size["hang_detect_s_p50"] >= 1


def test_replicate_bench(capsys):
    r = _run(
        capsys,
        "replicate",
        "--model",
        "tiny",
        "--blocks",
        "1",
        "--steps-per-block",
        "1",
        "--warmup",
        "1",
        "--rounds",
        "1",
        "--batch-size",
        "2",
        "--json",
    )
    assert r["replication_gbps"] > 0 and r["snapshot_mib_per_rank"] > 0


def test_bad_bench_input_is_one_line(capsys):
    assert main(["data", "--size-mb", "0"]) == 2
    assert "--size-mb" in capsys.readouterr().err
