"""The benchmarks' reports as named data: their JSON documents, key for key, and back."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from bench import fault_runs
from bench.bench_reports import (
    CheckError,
    DataReport,
    GpuCheckReport,
    HostInfo,
    ReplicateReport,
    RoundTimes,
    ScaleReport,
)
from bench.faults import parse_fault
from bench.phases import RecoveredFault, RestartedFault, SilentFault, UnmeasuredFault
from bench.reports import (
    BaselineSummary,
    CheckpointlessRun,
    CompareSummary,
    ControlPlaneReport,
    ControlPlaneSize,
    DcpResize,
    FaultRunReport,
    HostileReport,
    InPlaceResize,
    InPlaceRun,
    JobInfo,
    Machine,
    RecoverSummary,
    ResizeReport,
    RestartRun,
    Takeover,
)

SPEC = "kill:rank=1@step=5:phase=forward"


def _recovered(**changes: object) -> RecoveredFault:
    row = RecoveredFault(
        spec=SPEC,
        t_fault=4.2,
        generation=2,
        step_reached=4,
        step_restored=4,
        steps_lost=0,
        restored_from="peers",
        phases={"detect": 0.03, "interrupt": 0.01, "transfer": 0.2},
        downtime_s=0.24,
        recovery_s=0.9,
        bytes_received=1 << 20,
    )
    return dataclasses.replace(row, **changes)


def _compare() -> FaultRunReport:
    """A compare report as ``p2p-bench compare`` builds it, before its summary."""
    return FaultRunReport(
        kind="compare",
        command=f"p2p-bench compare --fault {SPEC}",
        created="2026-11-23T10:00:00+00:00",
        machine=Machine("bench-host", 16, "Linux-6.1-x86_64", "3.11.2", "2.5.1", None),
        job=JobInfo(
            model="tiny",
            nnodes=2,
            nproc_per_node=2,
            world_size=4,
            steps=6,
            checkpoint_every=3,
            replicas=1,
            num_params=120_000,
            state_mib_per_rank=0.3,
        ),
        faults=[SPEC, "bitflip:rank=2@step=3"],
        checkpointless=CheckpointlessRun(
            wall_s=12.5,
            exit_codes=[0, 0],
            spares=[1, 0],
            replicas=1,
            faults=[_recovered(), SilentFault("bitflip:rank=2@step=3", 2.0)],
            not_fired=[],
            timeline=[(1.0, 1), (2.0, 2), (5.0, 5), (6.0, 6)],
            run_dir="/tmp/run",
            bitwise_equal=True,
            reference_wall_s=10.0,
        ),
        restart=RestartRun(
            wall_s=30.0,
            exit_codes=[0],
            faults=[
                RestartedFault(SPEC, 4.3, 4, 3, 1, "checkpoint", {"terminate": 0.4}, 9.0),
                UnmeasuredFault("bitflip:rank=2@step=3", 2.1, "the job did not restart"),
            ],
            timeline=[(1.0, 1), (14.0, 4)],
            checkpoint_every=3,
        ),
    )


def _roundtrip(doc: dict) -> dict:
    return json.loads(json.dumps(doc))


def test_the_document_has_the_keys_the_benches_have_always_written_in_order():
    report = _compare()
    report.summary = CompareSummary(0.24, 9.0, 97.3, True, fault_runs.notes(report))
    doc = report.to_json()
    top = ["kind", "command", "created", "machine", "job", "faults", "modes", "summary"]
    assert list(doc) == top
    assert list(doc["machine"]) == ["hostname", "cpus", "platform", "python", "torch", "gpu"]
    assert list(doc["job"]) == [
        "model",
        "num_params",
        "state_mib_per_rank",
        "nnodes",
        "nproc_per_node",
        "world_size",
        "steps",
        "checkpoint_every",
        "replicas",
        "spares",
    ]
    assert list(doc["modes"]) == ["checkpointless", "restart"]
    assert list(doc["modes"]["checkpointless"]) == [
        "wall_s",
        "exit_codes",
        "spares",
        "replicas",
        "faults",
        "not_fired",
        "timeline",
        "bitwise_equal",
        "differences",
        "run_dir",
        "reference_wall_s",
    ]
    assert list(doc["modes"]["restart"]) == [
        "wall_s",
        "exit_codes",
        "faults",
        "timeline",
        "bitwise_equal",
        "checkpoint_every",
    ]
    assert doc["modes"]["restart"]["bitwise_equal"] is None
    assert list(doc["summary"]) == [
        "downtime_checkpointless_s",
        "downtime_restart_s",
        "downtime_reduction_pct",
        "bitwise_equal",
        "notes",
    ]
    assert _roundtrip(doc)["modes"]["checkpointless"]["timeline"][0] == [1.0, 1]
    assert doc["modes"]["checkpointless"]["faults"][1] == {
        "spec": "bitflip:rank=2@step=3",
        "t_fault": 2.0,
        "silent": True,
    }


def test_a_failed_run_says_so_after_its_fields_and_before_the_reference():
    report = _compare()
    assert report.checkpointless is not None and report.restart is not None
    report.checkpointless.error = "Traceback ..."
    report.restart.error = ""  # a failed run with no output still has the key
    doc = report.to_json()
    assert list(doc["modes"]["checkpointless"])[-2:] == ["error", "reference_wall_s"]
    assert doc["modes"]["restart"]["error"] == ""


def test_a_scripts_job_and_a_baseline_have_no_fields_they_never_had():
    report = _compare()
    report.job = dataclasses.replace(
        report.job, script="/w/train.py --lr 3e-4", model="train.py", num_params=None
    )
    report.job.state_mib_per_rank = None
    report.checkpointless = None
    report.summary = BaselineSummary(9.0, [1, None], [])
    doc = report.to_json()
    assert list(doc["job"])[:3] == ["script", "model", "nnodes"]
    assert "spares" not in doc["job"] and list(doc["modes"]) == ["restart"]
    assert doc["summary"] == {"downtime_restart_s": 9.0, "steps_lost": [1, None], "notes": []}


@pytest.mark.parametrize("kind", ["compare", "inject", "baseline"])
def test_a_report_reads_back_from_its_document(kind):
    report = _compare()
    report.kind = kind
    if kind == "inject":
        report.restart = None
        report.summary = RecoverSummary({"detect": 30.0}, 0.9, 0.24, 1 << 20, True, ["n"])
    elif kind == "baseline":
        report.checkpointless = None
        report.summary = BaselineSummary(9.0, [1, None], ["n"])
    else:
        report.summary = CompareSummary(0.24, 9.0, 97.3, True, ["n"])
    doc = _roundtrip(report.to_json())
    back = FaultRunReport.from_json(doc)
    assert _roundtrip(back.to_json()) == doc
    assert type(back.summary) is type(report.summary)
    assert back.modes.keys() == report.modes.keys()


def test_a_summary_of_another_bench_does_not_read_back():
    doc = _roundtrip(_compare().to_json())
    doc["summary"] = {"downtime_restart_s": 9.0, "steps_lost": [1], "notes": []}
    with pytest.raises(KeyError, match="compare summary"):
        FaultRunReport.from_json(doc)


def test_a_fault_that_never_fired_or_a_failed_check_fails_the_bench(tmp_path, capsys):
    args = argparse.Namespace(out_dir=str(tmp_path / "r"), json=True)
    report = _compare()
    report.summary = CompareSummary(0.24, 9.0, 97.3, True, [])
    assert fault_runs.finish(args, report) == 0
    printed = json.loads(capsys.readouterr().out)
    written = json.loads((tmp_path / "r" / "report.json").read_text())
    assert written == _roundtrip(report.to_json())
    assert printed == {**written["summary"], "report_dir": args.out_dir, "modes": written["modes"]}
    report.summary.bitwise_equal = False
    assert fault_runs.finish(args, report) == 1
    report.summary.bitwise_equal = True
    assert report.checkpointless is not None
    report.checkpointless.not_fired = [SPEC]
    assert fault_runs.finish(args, report) == 1
    report.checkpointless = None
    report.summary = BaselineSummary(9.0, [1, None], [])  # no bitwise check to fail
    assert fault_runs.finish(args, report) == 0
    capsys.readouterr()


def test_faults_whose_recovery_had_no_copy_left_are_marked():
    faults = [
        parse_fault("kill:rank=1@step=3"),
        parse_fault("kill-buddies:rank=2@step=6"),
        parse_fault("kill:rank=3@step=8"),
    ]
    measured = [
        _recovered(spec=str(faults[0])),
        _recovered(spec=str(faults[1]), restored_from="checkpoint"),
        _recovered(spec=str(faults[2]), restored_from="checkpoint"),
        UnmeasuredFault("hang:rank=0@step=9:phase=forward", 9.0, "no recovery after it"),
    ]
    marked = fault_runs._copies_lost(measured, faults)
    assert isinstance(marked[0], RecoveredFault) and marked[0].every_copy_lost is None
    assert isinstance(marked[1], RecoveredFault) and marked[1].every_copy_lost == "by design"
    assert isinstance(marked[2], RecoveredFault) and marked[2].every_copy_lost is not None
    assert "holders were lost" in marked[2].every_copy_lost


def test_notes_name_lost_copies_silent_faults_and_unmeasured_ones():
    report = _compare()
    assert report.checkpointless is not None
    report.checkpointless.faults[0] = _recovered(
        restored_from="checkpoint", every_copy_lost="by design"
    )
    text = "\n".join(fault_runs.notes(report))
    assert f"checkpointless: {SPEC} lost every copy of a shard (by design)" in text
    assert "bitflip:rank=2@step=3 corrupts silently" in text
    assert "restart: bitflip:rank=2@step=3: the job did not restart" in text
    assert "every 3 steps" in text and "16 CPU cores, no GPU" in text


def test_a_fault_that_never_fired_is_explained_where_the_run_shows_why(capsys):
    report = _compare()
    assert report.checkpointless is not None
    section = report.checkpointless
    section.not_fired = ["hang:rank=0@step=9:phase=optimizer", "kill:rank=1@step=4:phase=forward"]
    text = "\n".join(fault_runs.notes(report))
    # The run stopped at step 6: a fault at step 9 could not fire; one at step 4 should have.
    assert "hang:rank=0@step=9:phase=optimizer never fired: the run stopped at step 6" in text
    assert "kill:rank=1@step=4:phase=forward never fired: the run did not test it" in text
    report.job = dataclasses.replace(report.job, script="train.py --steps 6")
    text = "\n".join(fault_runs.notes(report))
    assert "the script stopped at step 6, before step 9" in text and "after --" in text
    fault_runs.print_table(report)
    assert "step=9:phase=optimizer: never fired: the script stopped at step 6" in (
        capsys.readouterr().out
    )


def test_the_resize_report_has_the_keys_it_always_printed():
    grow = InPlaceResize(3, 4, 7, 2.0, {"build": 300.0}, 1 << 20)
    report = ResizeReport("tiny", InPlaceRun([0, 0, 0], grow=grow))
    doc = report.to_json()
    assert list(doc) == [
        "model",
        "in_place",
        "dcp",
        "grow_resize_s",
        "grow_resize_dcp_s",
        "grow_speedup_vs_dcp",
        "shrink_resize_s",
        "shrink_resize_dcp_s",
        "shrink_speedup_vs_dcp",
        "resize_speedup_vs_dcp",
    ]
    assert doc["in_place"] == {
        "exit_codes": [0, 0, 0],
        "grow": {
            "from": 3,
            "to": 4,
            "step": 7,
            "resize_s": 2.0,
            "phases_ms": {"build": 300.0},
            "bytes_received": 1 << 20,
        },
    }
    assert doc["dcp"] == {} and doc["resize_speedup_vs_dcp"] is None
    report.in_place.shrink = dataclasses.replace(grow, from_size=4, to_size=3, resize_s=4.0)
    report.dcp_grow = DcpResize(3, 4, [0, 0], 5.0, 1.0, 9.0, 15.0)
    report.dcp_shrink = DcpResize(4, 3, [0, 0], 5.0, 1.0, 8.0, 14.0)
    doc = report.to_json()
    assert list(doc["dcp"]) == ["grow", "shrink"]
    assert list(doc["dcp"]["grow"]) == [
        "from",
        "to",
        "exit_codes",
        "save_s",
        "stop_s",
        "restart_and_load_s",
        "resize_s",
    ]
    assert doc["grow_speedup_vs_dcp"] == 7.5 and doc["shrink_speedup_vs_dcp"] == 3.5
    assert doc["resize_speedup_vs_dcp"] == 3.5


def test_the_hostile_report_passes_only_when_nothing_got_through():
    report = HostileReport(
        {"random frames": 20},
        20,
        0,
        0,
        0,
        ["agent/0", "agent/1"],
        20,
        80.5,
        10,
        3.2,
        0,
        True,
        0,
        0,
        0,
    )
    assert list(report.to_json())[:3] == ["tried_by_kind", "tried_total", "crashes"]
    assert report.passed
    assert not dataclasses.replace(report, squatter_messages_received=1).passed
    assert not dataclasses.replace(report, crashes=1).passed


def test_the_control_plane_report_puts_the_takeover_where_it_always_was():
    size = ControlPlaneSize(32, 0.05, 170.0, 180.0, 3.0, 4.0, 50.0, 60.0, 1.1, 1.2, 1.0, 5, 0)
    report = ControlPlaneReport(0.2, 1.0, None, [size], "p2p-bench control-plane --no-takeover")
    doc = report.to_json()
    assert list(doc) == [
        "benchmark",
        "heartbeat_interval_s",
        "heartbeat_timeout_s",
        "takeover_timeout_s",
        "sizes",
        "command",
    ]
    assert list(doc["sizes"][0])[-2:] == ["exit_trials", "unexpected_faults"]
    size.takeover = Takeover(40.0, 90.0, 1.0, 35, 4, 0, 1100.0, unexpected_faults=2)
    keys = list(report.to_json()["sizes"][0])
    assert keys[keys.index("exit_trials") :] == [
        "exit_trials",
        "takeover_ms_p50",
        "takeover_ms_p99",
        "takeover_timeout_s",
        "takeover_members",
        "takeover_votes",
        "takeover_not_told",
        "election_ms",
        "unexpected_faults",
        "takeover_unexpected_faults",
    ]
    assert report.to_json()["sizes"][0]["takeover_unexpected_faults"] == 2


def _replicate() -> ReplicateReport:
    return ReplicateReport(
        model="tiny",
        num_params=134_144,
        world_size=4,
        ranks_per_node=2,
        device="cpu",
        replication_backend="gloo",
        replica_memory="host",
        snapshot_mib_per_rank=0.654541015625,
        chunk_mib=32.0,
        replication_gbps=0.4,
        raw_sendrecv_gbps=0.5,
        round_gbps=0.1,
        step_time_ms_off=80.0,
        step_time_ms_on=100.0,
        snapshot_gbps=1.5,
        memcpy_gbps=20.0,
        round_ms_in_training=RoundTimes(1.0, 0.5, 7.0, 12.0, 0.2),
        measured_steps_per_mode=3,
        machine=HostInfo(2, "3.11.7", "2.13.0+cpu"),
        command="p2p-bench replicate --model tiny --json",
    )


def test_the_replicate_report_has_the_keys_it_always_printed_and_its_ratios():
    doc = _replicate().to_json()
    assert list(doc) == [
        "benchmark",
        "model",
        "num_params",
        "world_size",
        "ranks_per_node",
        "device",
        "replication_backend",
        "replica_memory",
        "snapshot_mib_per_rank",
        "chunk_mib",
        "replication_gbps",
        "raw_sendrecv_gbps",
        "replication_vs_raw",
        "round_gbps",
        "step_time_ms_off",
        "step_time_ms_on",
        "overhead_pct",
        "snapshot_gbps",
        "memcpy_gbps",
        "snapshot_vs_memcpy",
        "round_ms_in_training",
        "measured_steps_per_mode",
        "machine",
        "command",
    ]
    assert doc["benchmark"] == "replicate"
    assert doc["replication_vs_raw"] == 0.4 / 0.5
    assert doc["overhead_pct"] == (100.0 / 80.0 - 1) * 100
    assert doc["snapshot_vs_memcpy"] == 1.5 / 20.0
    assert doc["round_ms_in_training"] == {
        "copy": 1.0,
        "checksum": 0.5,
        "transfer": 7.0,
        "headers_and_commit": 12.0,
        "post": 0.2,
    }
    assert doc["machine"] == {"cpus": 2, "python": "3.11.7", "torch": "2.13.0+cpu"}


def test_the_replicate_report_reads_back_from_its_document():
    doc = _roundtrip(_replicate().to_json())
    back = ReplicateReport.from_json(doc)
    assert back == _replicate()
    assert _roundtrip(back.to_json()) == doc
    del doc["round_gbps"]
    with pytest.raises(KeyError, match="round_gbps"):
        ReplicateReport.from_json(doc)


def _data() -> DataReport:
    return DataReport(
        corpus_mb=2.0,
        documents=1800,
        samples=5436,
        seq_len=64,
        cache_build_s=0.2,
        first_batch_from_source_s=0.08,
        first_batch_from_cache_s=0.002,
        samples_per_s_cache=110_000.0,
        samples_per_s_source=66_000.0,
        command="p2p-bench data --size-mb 2 --json",
    )


def test_the_data_report_has_the_keys_it_always_printed():
    doc = _data().to_json()
    assert list(doc) == [
        "benchmark",
        "corpus_mb",
        "documents",
        "samples",
        "seq_len",
        "cache_build_s",
        "first_batch_from_source_s",
        "first_batch_from_cache_s",
        "first_batch_speedup",
        "samples_per_s_cache",
        "samples_per_s_source",
        "command",
    ]
    assert doc["benchmark"] == "data" and doc["first_batch_speedup"] == 0.08 / 0.002


def test_the_data_report_reads_back_from_its_document():
    doc = _roundtrip(_data().to_json())
    back = DataReport.from_json(doc)
    assert back == _data() and _roundtrip(back.to_json()) == doc


def _gpu_check() -> GpuCheckReport:
    """A gpu-check run cut short after three checks, the second of which raised."""
    return GpuCheckReport(
        device="NVIDIA H200",
        num_gpus=1,
        machine=Machine("gpu-host", 16, "Linux-6.1-x86_64", "3.11.2", "2.5.1", "NVIDIA H200"),
        command="p2p-bench gpu-check --mib 64",
        checks={
            "copies": {"bytes": 1 << 26, "d2d_gbps": 1000.0},
            "checksum": CheckError("RuntimeError: no kernel", "Traceback ...\n"),
            "bitwise_restore": [
                {"variant": "capturable", "passed": False, "error": "RuntimeError: x"}
            ],
        },
    )


def test_the_gpu_check_report_has_its_header_then_each_check_in_the_order_run():
    report = _gpu_check()
    doc = report.to_json()
    header = ["benchmark", "cuda", "device", "num_gpus", "machine", "command"]
    assert list(doc) == [*header, "copies", "checksum", "bitwise_restore"]
    assert doc["benchmark"] == "gpu-check" and doc["cuda"] is True
    assert doc["machine"]["gpu"] == "NVIDIA H200"
    assert doc["checksum"] == {"error": "RuntimeError: no kernel", "traceback": "Traceback ...\n"}
    report.not_measured = ["replication and recovery across machines (one machine here)"]
    assert list(report.to_json())[-1] == "not_measured"


@pytest.mark.parametrize("finished", [False, True])
def test_the_gpu_check_report_reads_back_cut_short_or_finished(finished):
    report = _gpu_check()
    if finished:
        report.not_measured = ["across machines"]
    doc = _roundtrip(report.to_json())
    back = GpuCheckReport.from_json(doc)
    assert back == report and _roundtrip(back.to_json()) == doc
    assert list(back.errors) == ["checksum"]  # a variant's own error is one of its figures
    assert back.section("checksum") == {} and back.section("copies")["d2d_gbps"] == 1000.0
    assert not back.passed


def test_an_error_read_back_without_its_traceback_is_still_an_error():
    doc = _roundtrip(_gpu_check().to_json())
    doc["checksum"] = {"error": "RuntimeError: no kernel"}
    back = GpuCheckReport.from_json(doc)
    assert back.checks["checksum"] == CheckError("RuntimeError: no kernel")
    assert back.to_json() == doc
    with pytest.raises(KeyError, match="device"):
        GpuCheckReport.from_json({"benchmark": "gpu-check", "cuda": False})


@pytest.fixture(scope="module")
def scale() -> ScaleReport:
    """A scale report of 256 GPUs, as ``p2p-bench scale-report`` builds it (few trials)."""
    from bench import scale_model, scale_report

    parser = argparse.ArgumentParser()
    scale_report.add_arguments(parser)
    args = parser.parse_args(["--gpus", "256", "--replicas", "1,2", "--trials", "5"])
    return scale_report.build_report(args, scale_model.load("measured"))


def test_the_scale_report_has_the_keys_it_always_wrote_in_order(scale):
    doc = scale.to_json()
    assert list(doc) == [
        "kind",
        "created",
        "command",
        "job",
        "headline",
        "inputs",
        "validation_inputs",
        "validation",
        "scenarios",
        "goodput",
        "memory",
        "sensitivity",
        "sizes",
    ]
    assert doc["kind"] == "scale-report"
    assert list(doc["job"]) == [
        "gpus",
        "gpus_per_node",
        "model",
        "hardware",
        "replicas",
        "checkpoint_every_min",
        "fallback_checkpoint_every_min",
        "storage",
        "replica_memory",
        "placement",
        "step_s",
        "state_gib_per_gpu",
        "lazy_gloo",  # added after the others: older reports read back without it
    ]
    assert list(doc["headline"]) == [
        "replicas",
        "recovery_s",
        "recovery_range_s",
        "downtime_reduction_pct",
        "downtime_reduction_range_pct",
        "goodput_pct",
        "goodput_range_pct",
        "goodput_restart_pct",
        "goodput_restart_range_pct",
        "validation_worst_held_out",
        "validation_within_25_pct",
        "validation_rows",
    ]
    assert list(doc["headline"]["validation_worst_held_out"]) == ["name", "error_pct"]
    assert list(doc["inputs"]) == sorted(doc["inputs"])
    assert list(doc["validation"][0]) == [
        "name",
        "kind",
        "predicted_s",
        "measured_s",
        "error_pct",
    ]
    assert list(doc["sizes"][0]) == ["gpus", "recovery_s", "restart_downtime_s", "control_plane"]
    assert list(doc["sensitivity"]) == ["recovery_s", "downtime_reduction_pct"]


def test_each_scale_scenario_writes_only_the_figures_it_has_in_order(scale):
    scenarios = scale.to_json()["scenarios"]
    assert list(scenarios) == [
        "checkpoint-restart",
        "checkpointless k=1",
        "checkpointless k=2",
        "resize in place: shrink by a node",
        "resize in place: grow by a node",
        "torchft replica-group heal",
    ]
    assert list(scenarios["checkpoint-restart"]) == ["recovery_s", "downtime_s", "phases_s"]
    assert list(scenarios["checkpointless k=1"]) == [
        "recovery_s",
        "downtime_s",
        "recovery_gpu_fault_s",
        "recovery_node_fault_s",
        "phases_s",
        "downtime_reduction_pct",
    ]
    assert list(scenarios["resize in place: grow by a node"]) == [
        "recovery_s",
        "downtime_s",
        "phases_s",
    ]
    assert list(scenarios["torchft replica-group heal"]) == ["recovery_s", "downtime_s", "note"]


def test_the_scale_report_reads_back_from_its_document(scale):
    doc = _roundtrip(scale.to_json())
    back = ScaleReport.from_json(doc)
    assert _roundtrip(back.to_json()) == doc
    assert back.headline == scale.headline and back.validation == scale.validation
    assert isinstance(back.headline.recovery_range_s, tuple)
    assert back.inputs == scale.inputs and back.scenarios == scale.scenarios
