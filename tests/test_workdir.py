"""The benches' run folders start empty, their checkpoints never mix, temporary work dirs go."""

from __future__ import annotations

import argparse

import pytest

from bench import baseline, fault_runs, runner
from bench.cli import main
from bench.errors import UsageError
from bench.workdir import RUN_MARK, finish_work_dir, fresh_run_dir, temporary_work_dir


def _earlier_run(path):
    """A run folder as an earlier bench run left it, with a complete checkpoint of step 3."""
    (path / "checkpoints" / "step-3").mkdir(parents=True)
    (path / "checkpoints" / "step-3" / ".metadata").write_bytes(b"an earlier run's")
    (path / RUN_MARK).touch()
    return path


def test_an_earlier_runs_folder_is_emptied_and_a_missing_one_made(tmp_path):
    earlier = _earlier_run(tmp_path / "restart")
    assert fresh_run_dir(earlier) == earlier
    assert [p.name for p in earlier.iterdir()] == [RUN_MARK]
    made = fresh_run_dir(tmp_path / "new" / "reference")
    assert [p.name for p in made.iterdir()] == [RUN_MARK]


def test_a_folder_no_bench_made_is_refused_and_left_as_it_is(tmp_path):
    (tmp_path / "restart").mkdir()
    (tmp_path / "restart" / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match=r"restart holds files that no p2p-bench run left"):
        fresh_run_dir(tmp_path / "restart")
    assert (tmp_path / "restart" / "notes.txt").read_text() == "mine"
    (tmp_path / "file").write_text("")
    with pytest.raises(UsageError, match="is a file"):
        fresh_run_dir(tmp_path / "file")
    # An empty folder is anybody's: it is used.
    (tmp_path / "empty").mkdir()
    assert (fresh_run_dir(tmp_path / "empty") / RUN_MARK).exists()


class _Started(Exception):
    pass


def test_the_engines_and_the_restart_runs_start_in_an_emptied_folder(monkeypatch, tmp_path):
    seen = []

    def start(*args, **kwargs):
        seen.append(sorted(p.name for p in (tmp_path / "run").iterdir()))
        raise _Started

    monkeypatch.setattr(runner, "LocalJob", start)
    monkeypatch.setattr(baseline.subprocess, "Popen", start)
    _earlier_run(tmp_path / "run")
    with pytest.raises(_Started):
        runner.run_script(tmp_path / "run", script="train.py")
    _earlier_run(tmp_path / "run")
    with pytest.raises(_Started):
        baseline.run_baseline(
            tmp_path / "run", model="tiny", steps=2, world_size=2, ranks_per_node=1,
            checkpoint_every=1,
        )  # fmt: skip
    engine, restart = seen
    assert engine == [RUN_MARK]
    assert restart == [RUN_MARK, "torchrun.log"]  # the log it opens for torchrun, no checkpoint


def test_each_mode_checkpoints_in_a_folder_of_its_own_and_an_used_one_is_refused(tmp_path):
    args = argparse.Namespace(checkpoint_dir=str(tmp_path / "ckpt"))
    assert fault_runs.checkpoint_dir(args, "restart") == f"{tmp_path}/ckpt/restart"
    assert fault_runs.checkpoint_dir(argparse.Namespace(checkpoint_dir=None), "restart") is None
    fault_runs.refuse_used_checkpoint_dirs(args, "checkpointless", "restart")  # nothing yet
    (tmp_path / "ckpt" / "restart" / "step-3").mkdir(parents=True)
    (tmp_path / "ckpt" / "restart" / "step-3" / ".metadata").write_bytes(b"")
    fault_runs.refuse_used_checkpoint_dirs(args, "checkpointless")
    with pytest.raises(UsageError, match=r"restart already holds checkpoints of steps \[3\]"):
        fault_runs.refuse_used_checkpoint_dirs(args, "checkpointless", "restart")


def test_compare_refuses_a_checkpoint_dir_an_earlier_run_used_before_it_runs(capfd, tmp_path):
    ckpt = tmp_path / "ckpt"
    (ckpt / "checkpointless" / "step-10").mkdir(parents=True)
    (ckpt / "checkpointless" / "step-10" / ".metadata").write_bytes(b"")
    argv = ["compare", "--checkpoint-dir", str(ckpt), "--work-dir", str(tmp_path / "work")]
    assert main(argv) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "already holds checkpoints of steps [10]" in err
    assert not (tmp_path / "work").exists()  # refused before any run


def test_a_temporary_work_dir_goes_unless_a_run_failed(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    args = argparse.Namespace(command="inject", work_dir=None)
    work = temporary_work_dir(args)
    assert work is not None and args.work_dir == str(work) and work.parent == tmp_path
    (work / "run.log").write_text("")
    finish_work_dir(work, 0)
    assert not work.exists()
    work = temporary_work_dir(argparse.Namespace(command="inject", work_dir=None))
    finish_work_dir(work, 1)
    assert work.exists() and f"kept in {work}" in capsys.readouterr().err
    # A folder the user chose is theirs; a command without one gets none.
    assert temporary_work_dir(argparse.Namespace(command="inject", work_dir="mine")) is None
    assert temporary_work_dir(argparse.Namespace(command="data")) is None


def test_a_bench_writes_its_report_folder_with_the_command_as_given(capsys, tmp_path, monkeypatch):
    import json
    import re

    from bench import data_bench
    from bench.bench_reports import DataReport
    from bench.report_dir import command_line

    def measure(args):  # the figures are not the point here: where they go is
        return DataReport(
            corpus_mb=1, documents=2, samples=3, seq_len=4, cache_build_s=0.5,
            first_batch_from_source_s=0.2, first_batch_from_cache_s=0.1,
            samples_per_s_cache=30, samples_per_s_source=10, command=command_line(args),
        )  # fmt: skip

    monkeypatch.setattr(data_bench, "measure", measure)
    monkeypatch.chdir(tmp_path)
    assert main(["--log-level", "ERROR", "data", "--dir", "a b"]) == 0
    (folder,) = (tmp_path / "reports").iterdir()  # no --out-dir: reports/<kind>-<time>
    assert re.fullmatch(r"data-\d{8}-\d{6}", folder.name)
    printed = capsys.readouterr().out
    assert re.search(r"first batch, node cache: +100.0 ms\n", printed)
    assert printed.endswith(f"  report: reports/{folder.name}/report.md\n")
    written = json.loads((folder / "report.json").read_text())
    # The command line of the call, not of the process that made it (here: pytest's).
    assert written["command"] == "p2p-bench --log-level ERROR data --dir 'a b'"
    md = (folder / "report.md").read_text()
    assert md.startswith("# p2p-bench data\n\n`p2p-bench --log-level ERROR data --dir 'a b'`\n")
    assert re.search(r"\n  speedup +2 x\n", md)
