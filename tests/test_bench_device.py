"""``--device`` of the fault benchmarks: where the ranks train, and how emulated nodes share GPUs.

The runs themselves are stood in for here (a GPU run needs a GPU; ``p2p-bench gpu-check`` makes
one); what is checked is what each run is started with.
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from bench import baseline, fault_runs, runner
from bench.errors import UsageError
from bench.reports import JobInfo


class _Started(Exception):
    """Raised by a stand-in once it has recorded how a run was started."""


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_device_cuda_without_a_gpu_is_one_clear_line(capfd):
    from bench.cli import main

    assert main(["recover", "--device", "cuda"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--device cuda: no CUDA device on this machine" in err[0], err


@pytest.mark.parametrize(
    "device, cuda, expected",
    [("auto", False, "cpu"), ("auto", True, "cuda"), ("cpu", True, "cpu"), ("cuda", True, "cuda")],
)
def test_auto_is_cuda_where_there_is_a_gpu(monkeypatch, device, cuda, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert fault_runs.job_device(argparse.Namespace(device=device)) == expected


@pytest.mark.parametrize("device", ["cpu", "cuda", None])
def test_a_run_on_the_gpus_is_wrapped_and_one_on_the_cpu_hides_them(monkeypatch, tmp_path, device):
    started: dict = {}

    def local_job(run_dir, **kwargs):
        started.update(kwargs)
        raise _Started

    monkeypatch.setattr(runner, "LocalJob", local_job)
    with pytest.raises(_Started):
        runner.run_script(tmp_path, script="train.py", script_args=["--lr", "1"], device=device)
    env = started["env"]
    if device == "cuda":
        assert started["script"] == runner.SHARED_GPU
        assert started["script_args"] == ["train.py", "--lr", "1"]
    else:
        assert started["script"] == "train.py" and started["script_args"] == ["--lr", "1"]
    assert env.get("CUDA_VISIBLE_DEVICES") == ("" if device == "cpu" else None)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_restart_baseline_runs_where_the_engine_s_run_does(monkeypatch, tmp_path, device):
    started: dict = {}

    def popen(cmd, env, **kwargs):
        started.update(cmd=cmd, env=env)
        raise _Started

    monkeypatch.setattr(baseline.subprocess, "Popen", popen)
    with pytest.raises(_Started):
        baseline.run_baseline(
            tmp_path,
            model="tiny",
            steps=2,
            world_size=2,
            ranks_per_node=1,
            checkpoint_every=1,
            device=device,
        )
    cmd, env = started["cmd"], started["env"]
    plain = cmd.index(baseline.PLAIN)
    if device == "cuda":
        assert cmd[plain - 1] == runner.SHARED_GPU and "CUDA_VISIBLE_DEVICES" not in env
    else:
        assert runner.SHARED_GPU not in cmd and env["CUDA_VISIBLE_DEVICES"] == ""


def test_a_kept_reference_is_only_reused_on_the_same_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    job = dict(script=None, model="tiny", steps=4, nnodes=2, nproc_per_node=2)
    keys = {fault_runs._job_key(argparse.Namespace(**job, device=d)) for d in ("cpu", "cuda")}
    assert len(keys) == 2


def test_the_report_says_where_the_ranks_trained():
    job = JobInfo(
        model="tiny",
        nnodes=2,
        nproc_per_node=2,
        world_size=4,
        steps=4,
        checkpoint_every=0,
        replicas=1,
    )
    assert "device" not in job.to_json()  # the CPU path's reports read as they always have
    on_gpus = dataclasses.replace(job, device="cuda")
    assert on_gpus.to_json()["device"] == "cuda"
    assert JobInfo.from_json(on_gpus.to_json()) == on_gpus
    assert JobInfo.from_json(job.to_json()).device == "cpu"


def test_device_cuda_is_refused_where_torch_sees_no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UsageError, match="use --device cpu"):
        fault_runs.job_device(argparse.Namespace(device="cuda"))
