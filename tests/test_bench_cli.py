"""The benchmarks run end to end (tiny settings; no timing is asserted)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from bench import netns
from bench.cli import main

pytestmark = pytest.mark.slow


def _run(capsys, *argv):
    """``p2p-bench *argv`` (with ``--json`` and ``--out-dir``): what it printed, less the report
    folder it names, which holds ``report.json`` and ``report.md``."""
    assert main(list(argv)) == 0
    printed = json.loads(capsys.readouterr().out)
    folder = Path(argv[argv.index("--out-dir") + 1])
    assert printed.pop("report_dir") == str(folder)
    written = json.loads((folder / "report.json").read_text())
    md = (folder / "report.md").read_text()
    if argv[0] not in ("inject", "recover", "baseline", "compare"):  # those print a summary
        assert written == printed
        # The command that reproduces it, as given (here not the test runner's sys.argv).
        assert md.startswith(f"# p2p-bench {argv[0]}\n\n`p2p-bench {argv[0]} --")
    return printed


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
        str(tmp_path / "data"),
        "--out-dir",
        str(tmp_path / "report"),
        "--json",
    )
    assert r["first_batch_from_cache_s"] > 0 and r["samples"] > 0


def test_start_bench(capsys, tmp_path):
    # Light imports (the server preloads them): the figures' structure, not torch's import time.
    out = str(tmp_path / "r")
    r = _run(
        capsys, "start", "--processes", "2", "--imports", "json,csv", "--out-dir", out, "--json"
    )
    assert r["imports"] == r["preloaded"] == ["json", "csv"]
    for way in ("spawn", "forkserver"):
        assert r[way]["all_ready_s"] > 0 and r[way]["one_ready_s"] > 0
        assert r[way]["cpu_s_per_process"] >= 0
    assert r["forkserver"]["server_ready_s"] > 0 and r["processes"] == 2
    assert r["one_ready_speedup"] == r["spawn"]["one_ready_s"] / r["forkserver"]["one_ready_s"]


def test_control_plane_bench(capsys, tmp_path):
    r = _run(
        capsys,
        "control-plane",
        "--ranks",
        "32",
        "--workers",
        "2",
        "--exits",
        "5",
        "--hangs",
        "1",
        "--heartbeat-timeout",
        "1",
        "--heartbeat-interval",
        "0.2",
        "--cpu-window",
        "0.5",
        "--out-dir",
        str(tmp_path),
        "--json",
    )
    (size,) = r["sizes"]
    # More exits in a row than --max-restarts (3): the emulated ranks must report progress.
    assert size["ranks"] == 32 and size["exit_trials"] == 5 and size["hang_detect_s_p50"] >= 1
    # The active coordinator was SIGKILLed and the standby took over: every member the job had
    # (4 agents, the processes holding the 32 ranks, the idle spares) switched to it; the bench
    # raises naming how many did not, and checks the standby is the coordinator afterwards.
    assert size["takeover_timeout_s"] == 1.0 and size["takeover_votes"] >= 3
    assert size["takeover_not_told"] == 0  # each got the takeover message itself
    assert size["takeover_ms_p99"] >= size["takeover_ms_p50"] > 0 and size["election_ms"] > 0
    if size["unexpected_faults"] == 0:  # a loaded machine may lose a member on its own
        assert size["takeover_members"] >= 32 + 4 - 1


def test_rendezvous_bench(capsys, tmp_path):
    from bench.rendezvous_bench import address_bytes, reads_per_member

    argv = ["--ranks", "16", "--min-requests", "300", "--clients", "2", "--json"]
    argv += ["--out-dir", str(tmp_path)]
    r = _run(capsys, "rendezvous", *argv)
    (size,) = r["sizes"]
    default, engine, lazy = size["default"], size["engine"], size["lazy"]
    assert size["members"] == 16 and r["clients"] == 2
    assert default["requests"] == 16 * (1 + reads_per_member(16, "default")) == 16 * 33
    assert engine["requests"] == 16 * (1 + reads_per_member(16, "engine")) == 16 * 2
    assert lazy["requests"] == 16 * (1 + reads_per_member(16, "lazy")) == 16 * 5
    assert default["address_bytes"] == address_bytes(16, engine=False) > engine["address_bytes"]
    assert lazy["reply_mb"] == engine["reply_mb"] * 2 / 16  # two addresses a member, not 16
    assert default["replayed_members"] * 32 >= 300 and engine["replayed_members"] >= 300
    assert default["store_cpu_s"] >= 0 and engine["wall_s"] > 0 and lazy["store_cpu_s"] >= 0
    assert size["lazy_ratio"] > 0


def test_replicate_bench(capsys, tmp_path):
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
        "--out-dir",
        str(tmp_path),
        "--json",
    )
    assert r["replication_gbps"] > 0 and r["snapshot_mib_per_rank"] > 0


def test_bad_bench_input_is_one_line(capsys, tmp_path):
    assert main(["data", "--size-mb", "0"]) == 2
    assert "--size-mb" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert main(["data", "--dir", str(tmp_path / "file" / "sub")]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"p2p-bench data: error: --dir {tmp_path}/file/sub: cannot write there (Not a "
        "directory): give a folder you can write\n"
    )
    for flag in ("--work-dir", "--checkpoint-dir"):  # refused before any run
        assert main(["compare", flag, str(tmp_path / "file"), "--fault", "kill:rank=1@step=2"]) == 2
        assert f"{flag} {tmp_path}/file: cannot write there (a file is there)" in (
            capsys.readouterr().err
        )


def test_a_measurement_that_cannot_be_made_is_one_line_and_exit_code_1(capsys, monkeypatch):
    import bench.data_bench
    from bench.errors import BenchFailed

    why = "no generation_complete within 960s (9 of 16 ranks joined)"

    def run(args):
        raise BenchFailed(why)

    monkeypatch.setattr(bench.data_bench, "run", run)
    assert main(["data"]) == 1
    assert capsys.readouterr().err == f"p2p-bench data: failed: {why}\n"


FAST = ["--model", "tiny", "--heartbeat-interval", "0.1", "--heartbeat-timeout", "3"]


def _inject(capsys, tmp_path, *argv):
    """``p2p-bench inject`` with its report in ``tmp_path/report``; the summary it printed."""
    return _run(
        capsys,
        "inject",
        *argv,
        "--out-dir",
        str(tmp_path / "report"),
        "--work-dir",
        str(tmp_path / "work"),
        "--json",
    )


def _report(path):
    return json.loads((path / "report.json").read_text())


def test_compare_measures_both_modes_and_the_checkpointless_run_is_bitwise(
    capsys, tmp_path, references
):
    out = tmp_path / "report"
    summary = _run(
        capsys,
        "compare",
        *FAST,
        *references,
        "--steps",
        "6",
        "--fault",
        "kill:rank=1@step=5",
        "--checkpoint-every",
        "3",
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        "--out-dir",
        str(out),
        "--work-dir",
        str(tmp_path / "work"),
        "--json",
    )
    assert summary["bitwise_equal"] is True
    assert summary["downtime_reduction_pct"] is not None
    # Each mode checkpoints in a folder of its own: the restart run never starts from the
    # engine's checkpoints (the step it restored, below, is its own).
    from recovery.checkpoint import complete_steps

    assert complete_steps(str(tmp_path / "ckpt" / "checkpointless"))
    assert complete_steps(str(tmp_path / "ckpt" / "restart")) == [3, 6]
    assert {p.name for p in out.iterdir()} >= {"report.json", "report.md", "phases.png"}
    report = _report(out)
    (ours,) = report["modes"]["checkpointless"]["faults"]
    (theirs,) = report["modes"]["restart"]["faults"]
    for phase in ("detect", "interrupt", "communicators", "plan", "transfer", "restore"):
        assert phase in ours["phases"]
    assert abs(sum(ours["phases"].values()) - ours["downtime_s"]) < 1e-6
    # The baseline loses exactly the steps since its last checkpoint: step 4 was reached when
    # the fault hit during step 5, the last checkpoint is step 3.
    assert theirs["step_reached"] == 4 and theirs["step_restored"] == 3
    assert theirs["steps_lost"] == 1
    assert set(theirs["phases"]) >= {"terminate", "restart processes", "load checkpoint"}


def test_inject_a_kill_the_coordinators_loss_and_a_hang(capsys, tmp_path, references):
    summary = _inject(
        capsys,
        tmp_path,
        *FAST,
        *references,
        "--steps",
        "6",
        "--fault",
        "kill:rank=1@step=3:phase=backward",
        "--fault",
        "kill-coordinator@step=4",
        "--fault",
        "hang:rank=2@step=5",
    )
    assert summary["bitwise_equal"] is True
    faults = _report(tmp_path / "report")["modes"]["checkpointless"]["faults"]
    kill, coordinator, hang = faults
    assert [kill["spec"], hang["spec"]] == [
        "kill:rank=1@step=3:phase=backward",
        "hang:rank=2@step=5:phase=forward",
    ]
    for f in (kill, hang):
        assert all(v >= 0 for v in f["phases"].values()) and f["downtime_s"] > 0
    # The coordinator's loss stops nothing; its standby then handles the hang.
    assert coordinator["takeover_s"] > 0 and coordinator["downtime_s"] == 0
    started = [e for e in _events(tmp_path / "report") if e["event"] == "generation_started"]
    assert started[-1]["source"] == "coordinator/1" and started[-1]["lost"] == [2]
    # A hang is only seen when the heartbeat timeout (3 s) expires.
    assert hang["phases"]["detect"] > 2.5 > kill["phases"]["detect"]


needs_netns = pytest.mark.skipif(
    netns.unavailable() is not None, reason=f"no network namespaces: {netns.unavailable()}"
)


def _three_nodes(capsys, tmp_path, references, fault: str) -> dict:
    """``inject`` into 3 nodes of 1 rank, 8 steps, with one ``fault``: its summary. The tests of
    node losses and partitions share this job, and so its fault-free reference run."""
    argv = ["--nnodes", "3", "--nproc-per-node", "1", "--steps", "8", "--fault", fault]
    return _inject(capsys, tmp_path, *FAST, *references, *argv)


def _partition(capsys, tmp_path, references, node: int):
    """Three nodes of one rank in network namespaces, ``node``'s link down in step 4: the run
    (bitwise equal, every node ending 0) and the job's event log."""
    summary = _three_nodes(capsys, tmp_path, references, f"partition:node={node}@step=4")
    run = summary["modes"]["checkpointless"]
    assert summary["bitwise_equal"] is True and run["not_fired"] == []
    assert run["exit_codes"] == [0, 0, 0]
    return run, _events(tmp_path / "report")


@needs_netns
def test_a_partition_of_the_coordinators_node_is_survived_and_its_side_decides_nothing(
    capsys, tmp_path, references
):
    # Node 0's link goes down with the active coordinator on it. That coordinator runs on, cut
    # off: it hears 1 of 3 nodes and holds every decision; the standby on node 1 takes over
    # with nodes 1 and 2's votes and replaces node 0's rank. When the link comes back, node 0
    # is told the job went on without it, and its coordinator ends (fenced, or stopped with its
    # node) having decided nothing since.
    run, events = _partition(capsys, tmp_path, references, 0)
    (fault,) = run["faults"]
    assert fault["restored_from"] == "peers" and fault["downtime_s"] > 0
    by = {(e["source"], e["event"]) for e in events}
    assert ("coordinator", "quorum_lost") in by and ("coordinator/1", "takeover") in by
    # The agents found node 1's standby at the address its p2p-run was given (--local-addr).
    (standby,) = {e["coordinator"] for e in events if e["event"] == "coordinator_takeover"
                  and e["source"].startswith("agent/")}  # fmt: skip
    assert re.fullmatch(r"10\.\d+\.0\.2:\d+", standby), standby
    t_cut = next(e["t"] for e in events if e["event"] == "fault_injected")
    decisions = ("fault", "generation_started", "kill_requested", "spare_requested", "job_ended")
    cut_off = [e for e in events if e["source"] == "coordinator" and e["t"] > t_cut]
    assert cut_off and not [e for e in cut_off if e["event"] in decisions], cut_off
    assert {e["identity"] for e in events if e["event"] == "lost_process_heard"} >= {"agent/0"}
    node0 = (Path(run["run_dir"]) / "p2p-run-0.log").read_text()
    assert "this node was declared lost" in node0 and "the job went on without it" in node0


@needs_netns
def test_a_standby_cut_off_with_a_minority_disturbs_nothing_when_the_partition_heals(
    capsys, tmp_path, references
):
    # Node 1 runs the standby coordinator. Cut off, it hears no active coordinator and asks
    # for votes, but only its own node would give one: its pre-vote raises no term, so once
    # the link is back nothing fences the coordinator that ran the job meanwhile (a term
    # raised by a lost election used to, and the stale standby then took over).
    _, events = _partition(capsys, tmp_path, references, 1)
    names = {e["event"] for e in events}
    assert "pre_vote" in names and not names & {"election", "takeover", "fenced"}
    assert [e["source"] for e in events if e["event"] == "job_ended"] == ["coordinator"]


def _events(report_dir):
    from launcher.events import read_events

    return read_events(_report(report_dir)["modes"]["checkpointless"]["run_dir"])


def test_the_coordinator_hangs_mid_recovery_a_standby_takes_over_and_it_is_fenced_off(
    capsys, tmp_path, references
):
    summary = _inject(
        capsys,
        tmp_path,
        *FAST,
        *references,
        "--steps",
        "6",
        "--fault",
        "kill:rank=1@step=3",
        "--fault",
        # Forming the new groups needs the coordinator's store; nothing after it does.
        "hang-coordinator@recovery=1:phase=communicators",
        "--fault",
        "kill:rank=2@step=5",
    )
    assert summary["bitwise_equal"] is True
    faults = _report(tmp_path / "report")["modes"]["checkpointless"]["faults"]
    hang = next(f for f in faults if f["spec"].startswith("hang-coordinator"))
    assert hang["takeover_s"] > 0
    events = _events(tmp_path / "report")
    (took,) = [e for e in events if e["event"] == "takeover_state"]
    assert took["source"] == "coordinator/1" and took["restarted"], "the recovery started again"
    # Resumed once the standby took over, the old coordinator learns it was replaced.
    assert [e["source"] for e in events if e["event"] == "fenced"] == ["coordinator"]
    late = [e for e in events if e["event"] == "generation_started" and e["t"] > took["t"]]
    assert late and {e["source"] for e in late} == {"coordinator/1"}
    assert 2 in {r for e in late for r in e["lost"]}, "the later fault: the new coordinator's"
    # The survivors left the generation the hung store could not form, and joined the next.
    given_up = [e["reason"] for e in events if e["event"] == "recovery_abandoned"]
    assert given_up and all(r.startswith("Interrupted") for r in given_up), given_up
    assert not [e for e in events if e["event"] == "fault" and "arrive" in e.get("reason", "")]


def test_losing_node_0_with_the_coordinator_is_an_ordinary_node_loss(capsys, tmp_path, references):
    summary = _three_nodes(capsys, tmp_path, references, "kill-node:node=0@step=3")
    assert summary["bitwise_equal"] is True
    (fault,) = _report(tmp_path / "report")["modes"]["checkpointless"]["faults"]
    assert fault["restored_from"] == "peers" and fault["downtime_s"] > 0
    started = [e for e in _events(tmp_path / "report") if e["event"] == "generation_started"]
    assert started[-1]["source"] == "coordinator/1" and started[-1]["lost"] == [0]


def test_the_check_fails_when_a_run_is_silently_corrupted(capsys, tmp_path, references):
    from bench.cli import main

    code = main(
        [
            "inject",
            *FAST,
            *references,
            "--steps",
            "6",
            "--fault",
            "bitflip:rank=1@step=2",
            "--out-dir",
            str(tmp_path / "report"),
            "--work-dir",
            str(tmp_path / "work"),
            "--json",
        ]
    )
    summary = json.loads(capsys.readouterr().out)
    assert code == 1 and summary["bitwise_equal"] is False
    differences = summary["modes"]["checkpointless"]["differences"]
    assert "rank 1's final state differs" in differences


USER_SCRIPT = str(Path(__file__).resolve().parent / "scripts" / "user_train.py")


def _inject_script(tmp_path, references, faults, *script_args):
    from bench.cli import main

    return main(
        [
            "inject",
            "--script",
            USER_SCRIPT,
            *references,
            "--heartbeat-interval",
            "0.1",
            "--steps",
            "6",
            *[arg for fault in faults for arg in ("--fault", fault)],
            "--out-dir",
            str(tmp_path / "report"),
            "--work-dir",
            str(tmp_path / "work"),
            "--json",
            "--",
            "--steps",
            "6",
            *script_args,
        ]
    )


def test_inject_into_a_users_script_that_knows_nothing_of_it(capsys, tmp_path, references):
    # Its dataset draws from the global generators as it is read, in two worker processes per
    # rank, and an epoch ends in step 5: after a recovery the batches after the restored step
    # are read again by new workers, the spare's included, with the same draws.
    faults = ("kill:rank=1@step=3:phase=backward", "kill:rank=2@step=5:phase=optimizer")
    assert _inject_script(tmp_path, references, faults, "--lr", "0.02", "--workers", "2") == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["bitwise_equal"] is True
    report = _report(tmp_path / "report")
    assert report["job"]["script"].endswith("user_train.py --steps 6 --lr 0.02 --workers 2")
    for fault in report["modes"]["checkpointless"]["faults"]:
        assert fault["downtime_s"] > 0 and set(fault["phases"]) >= {"detect", "plan", "transfer"}
    assert len(report["modes"]["checkpointless"]["faults"]) == len(faults)
    # The probe recorded the script's batches: the spare's, from the step it redid, too.
    spare = json.loads((tmp_path / "work" / "checkpointless" / "probe" / "rank1.json").read_text())
    assert min(int(s) for s in spare["steps"]) <= 3 and spare["step"] == 6
    assert all(s["batch"] for s in spare["steps"].values())


def test_the_check_of_a_users_script_fails_when_its_run_is_corrupted(capsys, tmp_path, references):
    faults = ["bitflip:rank=0@step=2"]  # the same job as above: the fault-free run is shared
    assert _inject_script(tmp_path, references, faults, "--lr", "0.02", "--workers", "2") == 1
    summary = json.loads(capsys.readouterr().out)
    assert summary["bitwise_equal"] is False
    assert "rank 0's final state differs" in summary["modes"]["checkpointless"]["differences"]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("kill:rank=1", "bad fault spec"),
        ("explode:rank=1@step=3", "unknown fault kind"),
        ("kill:rank=9@step=3", "rank 9 does not exist"),
        ("kill:rank=1@step=99", "step 99 is outside"),
        ("kill:node=1@step=3", "kill targets a rank"),
        ("kill-coordinator:rank=0@step=3", "kill-coordinator names no rank or node"),
        ("kill-node:node=0@step=3", "use --nnodes 3 or more"),
        ("partition:rank=1@step=3", "partition targets a node"),
        ("partition:node=1@step=3", "neither may decide for it"),
    ],
)
def test_bad_fault_specs_are_one_clear_line(capfd, spec, message):
    from bench.cli import main

    assert main(["inject", "--fault", spec]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and "Traceback" not in err[0], err


@pytest.mark.parametrize(
    "specs, expected",
    [
        (["kill:rank=1@step=3"], [1, 0]),
        (["kill:rank=1@step=3", "hang:rank=2@step=5"], [1, 1]),
        # A node's spares die with it: the replacements wait on the node that survives.
        (["kill-node:node=1@step=3"], [2, 0]),
        (["kill-node:node=0@step=3"], [0, 2]),
        (["bitflip:rank=1@step=3"], [1, 0]),
        (["kill-coordinator@step=3"], [1, 0]),
        # A partitioned node's spares are cut off with it.
        (["partition:node=1@step=3"], [2, 0]),
    ],
)
def test_spares_cover_every_lost_rank_on_nodes_that_survive(specs, expected):
    from bench.fault_runs import spares_for
    from bench.faults import parse_fault

    assert spares_for([parse_fault(s) for s in specs], nnodes=2, nproc_per_node=2) == expected


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--script", "no/such/train.py"], "--script no/such/train.py: no such file"),
        (["--", "--lr", "1"], "unexpected arguments --lr 1: only a --script takes them"),
        (["--replicas", "4"], "--replicas 4: every shard is copied to k other ranks"),
        (["--checkpoint-every", "-1"], "argument --checkpoint-every: -1 is below 0"),
    ],
)
def test_bad_script_arguments_are_one_clear_line(capfd, argv, message):
    from bench.cli import main

    assert main(["inject", "--fault", "kill:rank=1@step=3", *argv]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["inject", "--model", "huge"], "argument --model: invalid choice: 'huge'"),
        (["inject", "--steps", "1"], "argument --steps: 1 is below 2, the least it takes"),
        (["compare", "--timeout", "0"], "argument --timeout: 0 is not above 0"),
        (["recover", "--heartbeat-timeout", "0.2"], "--heartbeat-timeout 0.2 must be longer"),
        (["replicate", "--blocks", "0"], "argument --blocks: 0 is below 1"),
        (["replicate", "--chunk-mb", "x"], "argument --chunk-mb: 'x' is not a number"),
        (["control-plane", "--workers", "-1"], "argument --workers: -1 is below 1"),
        (["control-plane", "--ranks", "20"], "--ranks 20: use a multiple of 8 of at least 16"),
        (["data", "--world-size", "100"], "--global-batch 64 is smaller than --world-size 100"),
        (["resize", "--step-time", "-1"], "argument --step-time: -1 is below 0"),
        (["scale-report", "--gpus-per-node", "0"], "argument --gpus-per-node: 0 is below 1"),
        (["hostile", "--per-kind", "0"], "argument --per-kind: 0 is below 1"),
        (["baseline", "--out-dir", "/proc/no/such"], "--out-dir /proc/no/such: cannot write there"),
    ],
)
def test_a_flag_out_of_range_is_one_line_before_anything_runs(capfd, tmp_path, argv, message):
    from bench.cli import main

    fault = (
        ["--fault", "kill:rank=1@step=3"]
        if argv[0] in ("inject", "compare", "recover", "baseline")
        else []
    )
    assert main([*argv, *fault]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and err[0].startswith(f"p2p-bench {argv[0]}: "), err


def test_the_model_presets_the_flags_offer_are_the_models():
    from bench.flags import MODEL_PRESETS
    from bench.models import PRESETS

    assert tuple(PRESETS) == MODEL_PRESETS


def test_a_run_past_its_deadline_is_a_one_line_failure_with_its_files_kept(capfd, tmp_path):
    from bench.cli import main

    argv = ["inject", "--model", "tiny", "--steps", "4", "--fault", "kill:rank=1@step=3"]
    assert main([*argv, "--timeout", "0.5", "--quiet"]) == 1
    err = capfd.readouterr().err.strip().splitlines()
    assert err[0].startswith("p2p-bench inject: failed: the job in "), err
    assert "still ran after 0.5 s and was killed" in err[0]
    kept = err[1].split("kept in ")[1]
    assert (Path(kept) / "checkpointless" / "p2p-run-0.log").exists()
    shutil.rmtree(kept)


def test_recover_fires_a_fault_in_the_transfer_phase_of_the_recovery(capsys, tmp_path, references):
    # The peer-restore path must call the hook of its transfer phase: a fault asked for there
    # fires (a second recovery follows) and the result is still bitwise. With k=2 a copy of
    # every shard outlives both faults.
    summary = _run(
        capsys,
        "recover",
        *FAST,
        *references,
        "--replicas",
        "2",
        "--steps",
        "6",
        "--fault",
        "kill:rank=1@step=3",
        "--fault",
        "during-recovery:rank=2@recovery=1:phase=transfer",
        "--out-dir",
        str(tmp_path / "report"),
        "--work-dir",
        str(tmp_path / "work"),
        "--json",
    )
    assert summary["bitwise_equal"] is True
    section = _report(tmp_path / "report")["modes"]["checkpointless"]
    assert section["not_fired"] == []
    assert [f["spec"].split(":")[0] for f in section["faults"]] == ["kill", "during-recovery"]


def test_baseline_bench(capsys, tmp_path):
    # The work dir holds an earlier run's folder with a checkpoint of a later step (not even a
    # loadable one): the run starts afresh, so the fault still loses a step.
    from bench.workdir import RUN_MARK

    earlier = tmp_path / "work" / "restart" / "checkpoints" / "step-3"
    earlier.mkdir(parents=True)
    (earlier / ".metadata").write_bytes(b"an earlier run's")
    (tmp_path / "work" / "restart" / RUN_MARK).touch()
    summary = _run(
        capsys,
        "baseline",
        "--model",
        "tiny",
        "--steps",
        "4",
        "--fault",
        "kill:rank=1@step=3",
        "--checkpoint-every",
        "2",
        "--out-dir",
        str(tmp_path / "report"),
        "--work-dir",
        str(tmp_path / "work"),
        "--json",
    )
    assert summary["steps_lost"] == [0] and summary["downtime_restart_s"] > 0


def test_resize_bench_grows_and_shrinks_in_place(capsys, tmp_path):
    # The tiny model outruns the resizes: --step-time paces it until both are done.
    r = _run(
        capsys,
        "resize",
        "--model",
        "tiny",
        "--steps",
        "60",
        "--step-time",
        "0.3",
        "--no-dcp",
        "--timeout",
        "240",
        "--work-dir",
        str(tmp_path / "work"),
        "--out-dir",
        str(tmp_path / "report"),
        "--json",
    )
    in_place = r["in_place"]
    assert in_place["exit_codes"] == [0, 0, 0]
    assert (in_place["grow"]["from"], in_place["grow"]["to"]) == (3, 4)
    assert (in_place["shrink"]["from"], in_place["shrink"]["to"]) == (4, 3)
    assert in_place["grow"]["step"] < in_place["shrink"]["step"] < 60
    assert r["grow_resize_s"] > 0 and r["dcp"] == {} and r["resize_speedup_vs_dcp"] is None


def test_every_bench_subcommand_has_a_smoke_run():
    # A run is main([...]) or _run(capsys, ...) with the subcommand first.
    import re

    from bench.cli import _COMMANDS

    here = Path(__file__).resolve().parent
    sources = "".join(p.read_text() for p in here.rglob("test_*.py"))
    runs = set(re.findall(r'(?:main\(\s*\[|_run\(\s*capsys,)\s*"([a-z][a-z-]*)"', sources))
    missing = [name for name in _COMMANDS if name not in runs]
    assert missing == [], f"p2p-bench subcommands without a smoke run in tests/: {missing}"


def test_a_kept_reference_is_reused_only_for_the_same_job(tmp_path):
    import argparse

    from bench import fault_runs
    from bench.report import LiveProgress
    from bench.runner import JobOutcome

    runs = []

    def run(run_dir, **kwargs):
        runs.append(run_dir)
        return JobOutcome(None, [0, 0], {0: {"digest": f"d{len(runs)}", "steps": {}}}, 1.0)

    def reference(steps):
        args = argparse.Namespace(
            reference_cache=str(tmp_path / "kept"),
            script=None,
            model="tiny",
            steps=steps,
            nnodes=2,
            nproc_per_node=2,
        )
        with LiveProgress(quiet=True, total_runs=1) as progress:
            return fault_runs._reference(args, tmp_path / "work", run, {}, progress)

    first, again, other = reference(6), reference(6), reference(7)
    assert len(runs) == 2  # the second run of the 6-step job was not made
    assert again.results == first.results and again.codes == [0, 0]
    assert other.results[0]["digest"] == "d2"
