"""p2p-run end to end: real processes, real sockets, 2 emulated nodes x 2 ranks + 1 spare."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.events import read_events
from launcher.lifetime import alive
from tests.jobs import WORKER, running_in_session, wait_for

pytestmark = pytest.mark.slow


def test_sigkill_hands_the_rank_to_a_spare_and_refills_the_pool(start_job):
    job = start_job(extra=["--import-torch"])
    job.wait_event("generation_complete", generation=1)
    victim = job.pid_of(1)
    os.kill(victim, signal.SIGKILL)
    job.wait_event("generation_complete", generation=2)
    (fault,) = job.events("fault", identity="rank/0/2")
    assert "code -9" in fault["reason"]
    (assigned,) = job.events("spare_assigned", rank=1)
    (started,) = job.events("generation_started", generation=2)
    assert started["lost"] == [1] and started["replaced"]["1"][1] == assigned["identity"]
    # The pool is refilled: a new spare process starts after the assignment.
    spares = job.wait_event("process_started", role="spare")
    wait_for(lambda: len(job.events("process_started", role="spare")) == 2, "a new spare")
    assert len(spares) >= 1
    detect_ms = (fault["t"] - job.events("process_exited", identity="rank/0/2")[0]["t"]) * 1e3
    assert detect_ms < 5000  # generous hang bound; the figure is measured by the bench
    assert job.stop() == [0, 0]


def test_sigstop_is_declared_hung_after_the_timeout_and_killed(start_job):
    job = start_job()
    job.wait_event("generation_complete", generation=1)
    victim = job.pid_of(2)
    os.kill(victim, signal.SIGSTOP)
    (killed,) = job.wait_event("process_killed", pid=victim)
    assert killed["reason"] == "missed heartbeats"
    job.wait_event("generation_complete", generation=2)
    (fault,) = job.events("fault", identity="rank/1/1")
    assert "no heartbeat" in fault["reason"]
    wait_for(lambda: not alive(victim), "the hung rank to be gone")
    assert job.stop() == [0, 0]


def test_losing_a_nodes_agent_loses_its_ranks(start_job):
    job = start_job(spares=(2, 0))
    job.wait_event("generation_complete", generation=1)
    node1_ranks = [job.pid_of(2), job.pid_of(3)]
    job.nodes[1].send_signal(signal.SIGKILL)
    job.wait_event("fault", identity="agent/1")
    for identity in ("rank/1/1", "rank/1/2"):
        (f,) = job.wait_event("fault", identity=identity)
        assert "node 1 lost" in f["reason"]
    wait_for(lambda: not any(alive(p) for p in node1_ranks), "node 1's ranks to die with it")
    job.wait_event("generation_complete", generation=2)


#: The worker as is (spawned: it imports no torch), or importing torch (forked from each node's
#: fork server, which must go with the rest).
START_METHODS = pytest.mark.parametrize(
    "extra", [[], ["--import-torch"]], ids=["spawn", "forkserver"]
)


@START_METHODS
def test_ctrl_c_leaves_no_process_behind(start_job, extra):
    job = start_job(spares=(1, 1), extra=extra)
    job.wait_event("generation_complete", generation=1)
    pids = job.all_pids()
    assert len(pids) >= 2 + 4 + 2 + (2 if extra else 0)
    for node in job.nodes:
        node.send_signal(signal.SIGINT)
    codes = [n.wait(timeout=30) for n in job.nodes]
    assert all(c != 0 for c in codes)
    wait_for(lambda: not any(alive(p) for p in pids), "every process of the job to exit", 15)


@START_METHODS
def test_a_job_ends_with_the_process_that_started_it_even_when_that_is_sigkilled(tmp_path, extra):
    # A test or a bench that dies without cleaning up (SIGKILL, the OOM killer, a CI timeout)
    # leaves no job behind: the kernel sends its p2p-run nodes SIGTERM (PR_SET_PDEATHSIG).
    owner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from tests.jobs import Job; "
            "Job(Path(sys.argv[1]), 2, 2, (1, 0), sys.argv[2:]); time.sleep(300)",
            str(tmp_path),
            *extra,
        ],
        cwd=Path(__file__).resolve().parents[2],
        start_new_session=True,  # what a failure leaves behind goes with the group below
    )
    try:
        wait_for(
            lambda: (
                len([e for e in read_events(tmp_path) if e["event"] == "process_started"]) == 5
                and (tmp_path / "coordinator.json").exists()
            ),
            "the job's 4 ranks, its spare and its coordinator",
        )
        owner.kill()
        owner.wait()
        # Its nodes, their coordinator, ranks and spare: all in the owner's session.
        wait_for(lambda: not running_in_session(owner.pid), "every process of the job to end")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(owner.pid, signal.SIGKILL)
        owner.wait()


def test_a_node_waiting_for_its_welcome_stops_on_sigterm_at_once(start_job):
    # A node whose coordinator does not answer (stopped here) says hello until --join-timeout
    # (300 s by default); a SIGTERM or a Ctrl-C must still stop it at once.
    job = start_job(nnodes=2, nproc=1, spares=(0, 0), launcher_args=["--max-ranks", "3"])
    job.wait_event("generation_complete", generation=1)
    coordinator = job.coordinator_info()["pid"]
    os.kill(coordinator, signal.SIGSTOP)
    try:
        job.add_node(2)
        job.wait_event("agent_hello", node=2)
        job.nodes[2].send_signal(signal.SIGTERM)
        assert job.nodes[2].wait(timeout=20) == 128 + signal.SIGTERM
        (stopped,) = job.events("agent_interrupted", source="agent/2")
        assert stopped["signal"] == signal.SIGTERM
    finally:
        os.kill(coordinator, signal.SIGCONT)


def test_losing_both_coordinators_stops_every_node(start_job):
    job = start_job(launcher_args=["--coordinator-timeout", "3"])
    job.wait_event("generation_complete", generation=1)
    job.wait_event("standby_joined", identity="coordinator/1")
    standby = json.loads((job.run_dir / "coordinator-1.json").read_text())
    # Both nodes know the standby (it is announced after it joins) before both go.
    _wait_until_known(job, [standby["address"]], nodes=(0, 1))
    pids = [e["pid"] for e in job.events("process_started")]
    os.kill(job.coordinator_info()["pid"], signal.SIGKILL)
    os.kill(standby["pid"], signal.SIGKILL)
    codes = [n.wait(timeout=30) for n in job.nodes]
    assert codes == [1, 1]
    assert len(job.events("coordinator_lost")) == 2
    wait_for(lambda: not any(alive(p) for p in pids), "every rank and spare to exit", 15)
    # Each process was told and left by itself (these hold no state: nothing to checkpoint).
    assert len(job.events("coordinators_lost")) == len(pids)
    assert {e["code"] for e in job.events("process_exited")} == {0}
    address = f"127.0.0.1:{job.coordinator_info()['port']}"
    for node in (0, 1):
        printed = [ln for ln in job.output(node).splitlines() if ln.startswith("p2p-run:")]
        assert len(printed) == 1 and "no word from any coordinator" in printed[0], printed
        assert address in printed[0] and standby["address"] in printed[0]
        assert "nothing was left to checkpoint" in printed[0]


def test_two_standbys_take_over_one_after_the_other(start_job):
    job = start_job(
        nnodes=3, nproc=1, spares=(0, 0, 0), launcher_args=["--standby-coordinators", "1,2"]
    )
    job.wait_event("generation_complete", generation=1)
    addresses = [
        job.wait_event("standby_joined", identity=f"coordinator/{node}")[0]["address"]
        for node in (1, 2)
    ]
    # Every node can vote for either standby before the active coordinator goes.
    _wait_until_known(job, addresses, nodes=(0, 1, 2))
    os.kill(job.coordinator_info()["pid"], signal.SIGKILL)
    (first,) = wait_for(lambda: [e for e in job.events("takeover") if "term" in e], "a takeover")
    winner = first["source"]
    other = "coordinator/2" if winner == "coordinator/1" else "coordinator/1"
    # The other standby learns of the winner from the agents and mirrors it from then on (it
    # must: a standby that mirrored an older generation than the nodes heard of gets no vote).
    job.wait_event("standby_joined", identity=other, source=winner)
    pid = json.loads((job.run_dir / f"coordinator-{winner.split('/')[1]}.json").read_text())["pid"]
    os.kill(pid, signal.SIGKILL)
    second = wait_for(
        lambda: [e for e in job.events("takeover") if "term" in e and e["source"] == other],
        "the second standby's takeover",
    )
    assert second[0]["term"] > first["term"]
    assert job.stop() == [0, 0, 0]


def _wait_until_known(job, addresses: list[str], nodes: tuple[int, ...]) -> None:
    """Wait until every node in ``nodes`` has said it knows every standby in ``addresses``."""

    def knowing() -> set[int]:
        known: dict[int, set[str]] = {}
        for e in job.events("standbys_known"):
            known.setdefault(e["node"], set()).update(e["addresses"])
        return {node for node, seen in known.items() if seen >= set(addresses)}

    wait_for(lambda: knowing() >= set(nodes), f"nodes {nodes} to know standbys {addresses}", 15)


def test_a_head_node_runs_the_coordinator_and_every_node_points_at_it(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--run-dir",
        str(tmp_path),
        "--heartbeat-interval",
        "0.1",
        "--coordinator",
        f"127.0.0.1:{port}",
    ]
    cli = [sys.executable, "-m", "launcher.cli"]
    procs = [subprocess.Popen([*cli, "coordinator", *common])]
    try:
        for node in (0, 1):
            flags = [*common, "--external-coordinator", "--node-rank", str(node)]
            procs.append(subprocess.Popen([*cli, *flags, WORKER]))
        events = lambda name: [e for e in read_events(tmp_path) if e["event"] == name]  # noqa: E731
        wait_for(lambda: events("generation_complete"), "the job's first generation")
        # Node 0 started no coordinator of its own: the head node's is the only one.
        assert {e["source"] for e in events("coordinator_started")} == {"coordinator"}
        assert [e["identity"] for e in events("standby_joined")] == ["coordinator/1"]
        (tmp_path / "stop").touch()
        assert [p.wait(timeout=60) for p in procs] == [0, 0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def _run_cli(*args, timeout=60):
    return subprocess.run(
        [sys.executable, "-m", "launcher.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--bogus", WORKER], "unrecognized arguments"),
        (["does-not-exist.py"], "script does-not-exist.py does not exist"),
        (["--nnodes", "2", "--node-rank", "2", WORKER], "--node-rank 2 is outside 0..1"),
        (["--node-rank", "1", "--nnodes", "2", WORKER], "need --coordinator"),
        (["--coordinator", "nohost", WORKER], "is not host:port"),
        (["--max-restarts", "-1", WORKER], "--max-restarts must be >= 0"),
        (["--replicate-every", "0", WORKER], "--replicate-every must be >= 1"),
        (["--standby-coordinators", "0", WORKER], "node 0 runs the active coordinator"),
        (["--external-coordinator", WORKER], "--external-coordinator needs --coordinator"),
    ],
)
def test_bad_cli_input_is_one_clear_line(tmp_path, args, message):
    r = _run_cli("--run-dir", str(tmp_path), *args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_a_folder_that_cannot_be_made_is_one_clear_line_before_anything_starts(tmp_path):
    (tmp_path / "file").write_text("")
    run = tmp_path / "run"
    for flag, bad, why in [
        ("--run-dir", tmp_path / "file" / "sub", "Not a directory"),
        ("--checkpoint-dir", tmp_path / "file" / "sub", "Not a directory"),
        ("--checkpoint-dir", tmp_path / "file", "a file is there"),
    ]:
        r = _run_cli("--run-dir", str(run), flag, str(bad), WORKER)
        assert r.returncode == 2
        assert r.stderr == (
            f"p2p-run: error: {flag} {bad}: cannot make it ({why}): give a folder you can write\n"
        )
    assert list(run.iterdir()) == []  # no coordinator, no secret: nothing was started


def test_port_in_use_is_one_clear_line(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = _run_cli("--run-dir", str(tmp_path), "--coordinator", f"127.0.0.1:{port}", WORKER)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 and "in use" in r.stderr


def test_nnodes_mismatch_is_refused_with_one_line(start_job):
    job = start_job(spares=(0, 0), nnodes=2)
    job.wait_event("hello", identity="agent/1")
    r = _run_cli(
        "--run-dir",
        str(job.run_dir),
        "--nnodes",
        "3",
        "--nproc-per-node",
        "2",
        "--node-rank",
        "2",
        "--coordinator",
        f"127.0.0.1:{job.port}",
        WORKER,
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "world of 6 ranks but the job has 4" in lines[0], r.stderr


def test_a_plain_torch_script_runs_as_under_torchrun(tmp_path):
    script = str(Path(WORKER).parent / "plain_torch.py")
    # The command line a torchrun user has, with torchrun's spellings.
    torchrun = ["--standalone", "--nproc_per_node=2", "--rdzv-backend=c10d", "--max_restarts=1"]
    r = _run_cli("--run-dir", str(tmp_path), *torchrun, "--env-store", script, timeout=120)
    assert r.returncode == 0, r.stderr
    outs = sorted((tmp_path / f"out{i}").read_text() for i in range(2))
    assert outs == ["0 2 0 3.0", "1 2 1 3.0"]


def test_a_plain_script_without_env_store_is_told_what_it_lacks(tmp_path):
    script = str(Path(WORKER).parent / "plain_torch.py")
    r = _run_cli("--run-dir", str(tmp_path), "--standalone", "--nproc-per-node", "1", script)
    assert r.returncode == 1
    (last,) = [line for line in r.stderr.splitlines() if line.startswith("p2p-run:")]
    assert "does not use the engine" in last and "needs --env-store" in last
    assert "MASTER_PORT" in r.stderr  # torch's own error, from the rank


def test_a_node_declared_lost_while_it_ran_leaves_with_code_0_and_the_job_goes_on(start_job):
    job = start_job(spares=(1, 1), launcher_args=["--coordinator-timeout", "3"])
    job.wait_event("generation_complete", generation=1)
    node1 = job.nodes[1]
    node1.send_signal(signal.SIGSTOP)  # the node hangs: its agent falls silent
    try:
        job.wait_event("fault", identity="agent/1")
        job.wait_event("generation_complete", generation=2)
    finally:
        node1.send_signal(signal.SIGCONT)
    assert node1.wait(timeout=60) == 0
    log = (job.run_dir / "p2p-run-1.log").read_text()
    assert "this node was declared lost" in log and "the job went on without it" in log
    assert job.stop() == [0, 0]


def test_a_fork_server_that_dies_is_the_loss_of_its_nodes_processes_and_the_node_spawns_on(
    start_job,
):
    # Its ranks and spare die with it (they are its children); the agent lives on, reports
    # them, and starts the spares it is asked for with a fresh interpreter each.
    job = start_job(spares=(1, 1), extra=["--import-torch"])
    job.wait_event("generation_complete", generation=1)
    (server,) = job.events("forkserver_ready", source="agent/1")
    node1 = [e["pid"] for e in job.events("process_started", source="agent/1")]
    os.kill(server["pid"], signal.SIGKILL)
    for identity in ("rank/1/1", "rank/1/2", "spare/1/3"):
        (exited,) = job.wait_event("process_exited", identity=identity, source="agent/1")
        assert exited["code"] == -signal.SIGKILL

    def recovered():  # in one generation or two: the three exits may come together or apart
        last_fault = max(e["t"] for e in job.events("fault"))
        return any(e["t"] > last_fault for e in job.events("generation_complete"))

    wait_for(recovered, "a generation formed after the losses")
    wait_for(lambda: not any(alive(p) for p in node1), "node 1's forked processes to be gone")
    later = [e for e in job.events("process_started", source="agent/1") if e["pid"] not in node1]
    assert later and all(alive(e["pid"]) for e in later)  # spawned, not forked from the dead one
    assert job.stop() == [0, 0]
