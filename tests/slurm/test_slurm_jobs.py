"""p2p-run under a real Slurm cluster: batch jobs, one step per node, faults as Slurm makes them.

Two example jobs of world size 2 (one rank per node, tiny settings): a fault-free one whose
node 0 starts 3 s late (the secret race), and one that loses a rank to ``kill -9``, gets a node
added with ``srun --jobid``, loses a node's step to ``scancel`` and a node to ``scontrol update
state=down``, and must end bitwise equal to the first. A third job checks the start-up deadline.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.runner import bitwise_differences
from tests.slurm.conftest import Jobs, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STEPS = 10
# Small: one rank per node, the training's tiny preset. Heartbeat and acknowledgement deadlines
# are generous: this machine's two cores are shared, and a false "lost" would add a generation.
P2P_ARGS = (
    "--nproc-per-node 1 --heartbeat-interval 0.5 --heartbeat-timeout 8 --ack-timeout 30 "
    "--join-timeout 60"
)


def _results(out: Path) -> SimpleNamespace:
    """Every rank's ``rank<r>.json`` as :func:`bench.runner.bitwise_differences` reads them."""
    return SimpleNamespace(
        results={int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    )


def _train_args(tmp_path) -> str:
    return f"--steps {STEPS} --cache-dir {tmp_path / 'cache'}"


@pytest.fixture(scope="module")
def reference(slurm_cluster, tmp_path_factory):
    """The fault-free example job, node 0 starting 3 s after node 1 (its results and facts)."""
    tmp = tmp_path_factory.mktemp("reference")
    jobs = Jobs(slurm_cluster, tmp)
    try:
        job_id = jobs.submit(
            "tests/slurm/late_node0.sbatch", P2P_ARGS=P2P_ARGS, TRAIN_ARGS=_train_args(tmp)
        )
        info = jobs.wait_done(job_id)
        run_dir = jobs.run_dir(job_id)
        yield {
            "info": info,
            "output": jobs.output(job_id),
            "run_dir": run_dir,
            "node1_started": (run_dir / "node1_started").stat().st_mtime,
            "secret_made": (run_dir / "secret").stat().st_mtime,
        }
    finally:
        jobs.teardown()


def test_node_0_late_by_3s_the_others_wait_for_its_secret(reference):
    assert reference["info"]["JobState"] == "COMPLETED", reference["output"]
    assert reference["info"]["ExitCode"] == "0:0"
    assert "does not exist" not in reference["output"]
    # Node 1 was running before the secret existed, and the job still started.
    assert reference["secret_made"] > reference["node1_started"]
    assert sorted(p.name for p in (reference["run_dir"] / "out").iterdir()) == [
        "rank0.json",
        "rank1.json",
    ]


def test_faults_from_slurm_are_recovered_and_the_job_ends_bitwise_equal(jobs, reference, tmp_path):
    job_id = jobs.submit(
        "examples/slurm/train.sbatch",
        "-N3",
        P2P_NODES="2",
        P2P_NPROC="1",
        P2P_SPARES="1",
        P2P_ARGS=P2P_ARGS.replace("--nproc-per-node 1 ", ""),
        TRAIN_ARGS=_train_args(tmp_path),
        P2P_JOB_HOOKS="tests.slurm.gate:attach",
        P2P_GATES="2,4,6",
    )
    run_dir = jobs.run_dir(job_id)
    gates = run_dir / "gates"

    def story() -> list:  # the membership decisions, for a failure's message
        keep = {"fault", "generation_started", "spare_assigned", "stragglers", "job_ended"}
        return [e for e in jobs.events(job_id) if e.get("event") in keep]

    def release(step: int) -> None:
        jobs.wait_event(job_id, "generation_started")  # the job runs
        wait_for(
            lambda: (
                {p.name for p in gates.glob(f"at{step}.r*")} >= {f"at{step}.r0", f"at{step}.r1"}
            ),
            f"both ranks at step {step}",
            context=lambda: jobs.output(job_id),
        )
        (gates / f"go{step}").touch()

    # 1. kill -9 of a rank: a spare takes its place (off the survivors' node: node 1's own).
    jobs.wait_event(job_id, "generation_complete", generation=1)
    # Spares join the pool once warm; a rank lost before then goes to the first one that joins.
    wait_for(
        lambda: {e["node"] for e in jobs.events(job_id, "spare_joined")} >= {0, 1},
        "both nodes' spares in the pool",
    )
    (rank1,) = jobs.events(job_id, "process_started", role="rank", rank=1)
    release(2)
    os.kill(rank1["pid"], signal.SIGKILL)
    jobs.wait_event(job_id, "generation_complete", generation=2)
    assigned = jobs.events(job_id, "spare_assigned", rank=1)[-1]
    assert assigned["identity"].startswith("spare/1/"), story()

    # 2. a replacement node joins the running job on the allocation's third node.
    adder = jobs.popen(
        ["examples/slurm/add_node.sh", job_id, "n3", "2"],
        P2P_NODES="2",
        P2P_NPROC="1",
        P2P_SPARES="1",
        P2P_ARGS=P2P_ARGS.replace("--nproc-per-node 1 ", ""),
        TRAIN_ARGS=_train_args(tmp_path),
        P2P_JOB_HOOKS="tests.slurm.gate:attach",
        P2P_GATES="2,4,6",
    )
    jobs.wait_event(job_id, "hello", identity="agent/2")
    wait_for(lambda: len(jobs.events(job_id, "spare_joined", node=2)) == 2, "node 2's spares")

    # 3. scancel of node 1's step: its rank goes to a spare of the new node.
    steps = jobs.steps(job_id)
    release(4)
    jobs.cluster.run("scancel", steps["n2"])
    jobs.wait_event(job_id, "generation_complete", generation=3)
    assert jobs.events(job_id, "fault", identity="agent/1")
    assigned = jobs.events(job_id, "spare_assigned", rank=1)[-1]
    assert assigned["identity"].startswith("spare/2/"), story()

    # 4. the new node marked down: its rank goes to node 0's spare.
    release(6)
    jobs.cluster.run("scontrol", "update", "nodename=n3", "state=down", "reason=test")
    jobs.wait_event(job_id, "generation_complete", generation=4)
    assert jobs.events(job_id, "fault", identity="agent/2")
    assigned = jobs.events(job_id, "spare_assigned", rank=1)[-1]
    assert assigned["identity"].startswith("spare/0/"), story()

    info = jobs.wait_done(job_id)
    # The added node's srun saw its node fail (--no-kill) and exits 0: that step does not fail.
    assert adder.wait(timeout=60) == 0, adder.stdout.read()
    output = jobs.output(job_id)
    # The job finished: the batch script (and so the job) succeeds although two nodes' steps
    # were killed.
    assert info["JobState"] == "COMPLETED", output
    assert info["ExitCode"] == "0:0", output
    (ended,) = jobs.events(job_id, "job_ended")
    assert ended["code"] == 0, story()
    # Bitwise: the same world size throughout, so the same final state and data order.
    got, want = _results(run_dir / "out"), _results(reference["run_dir"] / "out")
    assert sorted(got.results) == [0, 1] and len(got.results[0]["steps"]) == STEPS
    # Rank 0 lived through all three recoveries, each restored from peers, not a checkpoint.
    assert [(r["generation"], r["source"]) for r in got.results[0]["recoveries"]] == [
        (2, "peers"),
        (3, "peers"),
        (4, "peers"),
    ], story()
    diffs = bitwise_differences(got, want)
    assert not diffs, diffs


def test_a_node_that_never_comes_ends_start_up_with_one_line_naming_it(jobs):
    job_id = jobs.submit("tests/slurm/never_joins.sbatch", JOIN_TIMEOUT="8")
    info = jobs.wait_done(job_id, timeout_s=90)
    assert info["JobState"] == "COMPLETED", jobs.output(job_id)
    base = jobs.run_dir(job_id)
    for side, text in (
        ("alone0", "node(s) [1] did not join within 8s (--join-timeout)"),
        ("alone1", f"secret file {base / 'alone1' / 'secret'} did not appear within 8s"),
    ):
        assert (base / side / "code").read_text().split() == [f"node{side[-1]}", "exit", "3"]
        lines = [
            line
            for line in (base / side / "stderr").read_text().splitlines()
            if line.startswith("p2p-run")
        ]
        assert len(lines) == 1 and text in lines[0], (side, lines)
        assert "Traceback" not in (base / side / "stderr").read_text()
