"""Resizing in place: shrink after a fault with no spare, grow into a joining node, give back a
node on request. Each run is compared with a reference that reshards at the same step through a
DCP checkpoint: the example job's runs are deterministic, so the two agree bit for bit."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import pytest

from bench.faults import parse_fault
from bench.resize_bench import PACE_HOOK, PACE_OFF
from bench.runner import EXAMPLE, bitwise_differences, run_example
from launcher.protocol import ENV_BENCH_STEP_S, ENV_JOB_HOOKS
from launcher.testing import LocalJob
from tests.recovery.conftest import JOB_DEADLINE_S

pytestmark = pytest.mark.slow

FAST = {"heartbeat_interval_s": 0.1, "heartbeat_timeout_s": 3.0}


def _run(tmp_path, name, cache, **kw):
    return run_example(
        tmp_path / name, cache_dir=str(cache), timeout_s=JOB_DEADLINE_S, **FAST, **kw
    )


def _dcp_reference(tmp_path, cache, *, steps, switch_at, before, after):
    """A job of ``before`` (nnodes, nproc) checkpointing at ``switch_at``, then a job of
    ``after`` resuming from that checkpoint (DCP reshards it)."""
    ckpt = tmp_path / "ckpt"
    first = _run(
        tmp_path,
        "reference-before",
        cache,
        steps=steps,
        nnodes=before[0],
        nproc_per_node=before[1],
        spares=(0,) * before[0],
        launcher_args=("--checkpoint-dir", str(ckpt), "--checkpoint-every", str(switch_at)),
    )
    assert first.codes == [0] * before[0], first.job.output(0)[-2000:]
    only = tmp_path / "ckpt-at-switch"
    shutil.copytree(ckpt / f"step-{switch_at:09d}", only / f"step-{switch_at:09d}")
    second = _run(
        tmp_path,
        "reference-after",
        cache,
        steps=steps,
        nnodes=after[0],
        nproc_per_node=after[1],
        spares=(0,) * after[0],
        # The checkpoint is vouched for by the secret of the job that wrote it.
        launcher_args=(
            "--checkpoint-dir",
            str(only),
            "--resume",
            "--secret-file",
            str(first.job.run_dir / "secret"),
        ),
    )
    assert second.codes == [0] * after[0], second.job.output(0)[-2000:]
    return first, second


def assert_same_after(outcome, reference, switch_at):
    """Final states and every step after the switch bitwise equal (the reference's runs before
    the switch are checked separately)."""
    problems = [
        p
        for p in bitwise_differences(outcome, reference)
        if not (
            p.split(", step ")[-1].split()[0].isdigit()
            and int(p.split(", step ")[-1].split()[0]) <= switch_at
        )
    ]
    assert not problems, problems[:6]


def assert_no_step_lost(job, done, switch_at):
    """The switch restored the last step done before it, and training went on from the next."""
    t_switch = min(d["t"] for d in done)
    steps = [(e["t"], e["step"]) for e in job.events("step_done")]
    assert max(s for t, s in steps if t < t_switch) == switch_at, "a step was rolled back"
    assert min(s for t, s in steps if t > t_switch) == switch_at + 1


def _global_ids(outcome, step):
    return sorted(
        i for r in outcome.results.values() for i in r["steps"].get(str(step), {}).get("ids", [])
    )


def assert_exactly_once(outcome, reference, switch_at, steps):
    """After the switch every step consumed the same global batch of sample ids as the run that
    never resized (before it, each rank's records equal that run's), so no sample is repeated
    or skipped whatever the world size of each step."""
    seen = []
    for step in range(1, steps + 1):
        ids = _global_ids(reference, step)
        if step > switch_at:
            assert _global_ids(outcome, step) == ids, f"step {step} read other samples"
        seen += ids
    assert len(seen) == len(set(seen)), "a sample was read twice within the epoch"


def test_shrink_after_a_sigkill_with_no_spare(tmp_path, data_cache):
    steps = 8
    elastic = _run(
        tmp_path,
        "elastic",
        data_cache,
        steps=steps,
        faults=[parse_fault("kill:rank=3@step=5")],
        spares=(0, 0),
        launcher_args=("--min-ranks", "3", "--spare-wait", "1"),
    )
    assert elastic.codes == [0, 0], elastic.job.output(0)[-3000:]
    (resize,) = elastic.events("resize")
    assert (resize["from"], resize["to"], resize["graceful"]) == (4, 3, False)
    done = elastic.events("recovery_done")
    assert {e["world_size"] for e in done} == {3} and len(done) == 3
    (switch_at,) = {e["step"] for e in done}
    assert sorted(elastic.results) == [0, 1, 2]

    before, after = _dcp_reference(
        tmp_path, data_cache, steps=steps, switch_at=switch_at, before=(2, 2), after=(3, 1)
    )
    # The state resharded from peers' memory equals the one DCP resharded from the checkpoint
    # of the committed step: the 3-rank continuations agree bit for bit, step after step.
    assert_same_after(elastic, after, switch_at)
    for rank in range(3):
        for step in range(1, switch_at + 1):
            assert (
                elastic.results[rank]["steps"][str(step)]
                == before.results[rank]["steps"][str(step)]
            )
    assert_exactly_once(elastic, before, switch_at, steps)


def test_grow_into_a_node_that_joins(tmp_path, data_cache):
    steps = 40
    run_dir = tmp_path / "elastic"
    out = run_dir / "out"
    job = LocalJob(
        run_dir,
        nnodes=3,
        nproc_per_node=1,
        spares=(0, 0, 0),
        script=EXAMPLE,
        script_args=[
            "--model",
            "tiny",
            "--steps",
            str(steps),
            "--cache-dir",
            str(data_cache),
            "--out",
            str(out),
        ],
        launcher_args=["--max-ranks", "4", "--scale-up-delay", "0.5"],
        **FAST,
    )
    try:
        # The new node's process needs a few seconds to start and warm up, and it only joins
        # the pool when it is ready: the job grows into it at whatever step it has reached.
        job.add_node(3)
        codes = job.wait(JOB_DEADLINE_S)
    finally:
        job.kill_everything()
    assert codes == [0, 0, 0, 0], job.output(0)[-3000:]
    (resize,) = job.events("resize")
    assert (resize["from"], resize["to"], resize["graceful"]) == (3, 4, True)
    done = job.events("recovery_done")
    (switch_at,) = {e["step"] for e in done}
    # Graceful: the switch came after a committed step, nothing was rolled back.
    before_switch = [
        e["step"] for e in job.events("step_done") if e["t"] < min(d["t"] for d in done)
    ]
    assert switch_at == max(before_switch)
    # The three survivors received their new shards (smaller, in a world of four) into buffers
    # their old copies gave back, as their new slots will be: no fresh memory on that path.
    released = job.events("previous_copies_released")
    assert len(released) == 3 and all(e["lent_bytes"] > 0 for e in released), released

    import json

    from bench.runner import JobOutcome

    results = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    elastic = JobOutcome(job, codes, results, 0.0)
    assert sorted(results) == [0, 1, 2, 3]
    before, after = _dcp_reference(
        tmp_path, data_cache, steps=steps, switch_at=switch_at, before=(3, 1), after=(2, 2)
    )
    assert_same_after(elastic, after, switch_at)
    assert_exactly_once(elastic, before, switch_at, steps)


def test_a_node_given_back_on_request_loses_no_step(tmp_path, data_cache):
    steps = 10
    run_dir = tmp_path / "elastic"
    job = LocalJob(
        run_dir,
        nnodes=2,
        nproc_per_node=2,
        spares=(0, 0),
        script=EXAMPLE,
        script_args=[
            "--model",
            "tiny",
            "--steps",
            str(steps),
            "--cache-dir",
            str(data_cache),
            "--out",
            str(run_dir / "out"),
        ],
        launcher_args=["--min-ranks", "2"],
        # Steps are paced until the given-back processes have exited, so the job cannot end
        # (and stop its nodes) before their exits are seen.
        env={ENV_JOB_HOOKS: PACE_HOOK, ENV_BENCH_STEP_S: "0.5"},
        **FAST,
    )
    try:
        deadline = time.monotonic() + JOB_DEADLINE_S
        while not any(e["step"] >= 2 for e in job.events("step_done")):
            assert time.monotonic() < deadline, job.output(0)[-2000:]
            time.sleep(0.1)
        scale = subprocess.run(
            [sys.executable, "-m", "launcher.cli", "scale", "--to", "2", "--run-dir", str(run_dir)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert scale.returncode == 0, scale.stderr
        while len(job.events("process_left")) < 2:
            assert time.monotonic() < deadline, job.output(0)[-2000:]
            assert all(n.poll() is None for n in job.nodes), "the job ended before they left"
            time.sleep(0.1)
        (run_dir / PACE_OFF).touch()
        codes = job.wait(JOB_DEADLINE_S)
    finally:
        job.kill_everything()
    assert codes == [0, 0], job.output(0)[-3000:]
    (resize,) = job.events("resize")
    assert (resize["from"], resize["to"], resize["graceful"]) == (4, 2, True)
    assert sorted(resize["leaving"]) == sorted(
        e["identity"] for e in job.events("process_started") if e["rank"] in (2, 3)
    ), "the whole of node 1 is given back"
    done = job.events("recovery_done")
    assert {e["world_size"] for e in done} == {2}
    (switch_at,) = {e["step"] for e in done}
    before_switch = [
        e["step"] for e in job.events("step_done") if e["t"] < min(d["t"] for d in done)
    ]
    assert switch_at == max(before_switch), "a step was rolled back"
    assert {e["identity"] for e in job.events("process_left")} == set(resize["leaving"])
    assert not job.events("fault")
