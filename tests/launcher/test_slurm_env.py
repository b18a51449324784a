"""The job's shape from Slurm, as pure functions: host lists, precedence, --print-config."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from launcher import cli, slurm
from launcher.membership import JOIN_FAILED, Membership, MembershipConfig, Process
from launcher.slurm import Flags, compress_hostlist, expand_hostlist, resolve

# -- host lists ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, hosts",
    [
        ("n1", ["n1"]),
        (
            "n[1-3,7],gpu-[01-04]a,x",
            ["n1", "n2", "n3", "n7", *(f"gpu-0{i}a" for i in range(1, 5)), "x"],
        ),
        ("node[08-11]", ["node08", "node09", "node10", "node11"]),
        ("n[098-100]", ["n098", "n099", "n100"]),
        ("n[9-10]", ["n9", "n10"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("a,b[2],c", ["a", "b2", "c"]),
    ],
)
def test_host_lists_expand_as_slurm_writes_them(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize(
    "text, message",
    [
        ("n[1-3", "'[' without its ']'"),
        ("n1-3]", "']' without its '['"),
        ("n[[1]]", "nested brackets"),
        ("n[]", "empty brackets"),
        ("n[5-2]", "runs backwards"),
        ("n[a-b]", "is not a number or a range"),
        ("n1,,n2", "empty entry"),
        ("", "empty"),
        ("n[1-99999999]", "more than"),
    ],
)
def test_bad_host_lists_say_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        expand_hostlist(text)


_name = st.from_regex(r"[a-z][a-z-]{0,4}", fullmatch=True)
_host = st.one_of(
    _name,
    st.builds(lambda p, n, w: f"{p}{n:0{w}d}", _name, st.integers(0, 120), st.integers(1, 4)),
)


@given(st.lists(_host, max_size=30, unique=True))
def test_compress_then_expand_gives_the_same_hosts_in_order(hosts):
    text = compress_hostlist(hosts)
    assert expand_hostlist(text) == hosts if hosts else text == ""


@given(_name, st.integers(0, 500), st.integers(0, 40), st.integers(1, 4))
def test_a_range_keeps_its_low_bounds_padding(prefix, low, span, width):
    text = f"{prefix}[{low:0{width}d}-{low + span}]"
    hosts = expand_hostlist(text)
    assert hosts == [f"{prefix}{n:0{width}d}" for n in range(low, low + span + 1)]


@given(st.lists(_host, min_size=1, max_size=8), st.lists(_host, min_size=1, max_size=8))
def test_a_list_is_its_entries_in_order(a, b):
    left, right = compress_hostlist(a), compress_hostlist(b)
    assert expand_hostlist(f"{left},{right}") == expand_hostlist(left) + expand_hostlist(right)


# -- resolution ---------------------------------------------------------------------------------

STEP = {  # what Slurm sets in a one-node srun step on n2 of a 3-node job
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "1",
    "SLURM_JOB_NUM_NODES": "3",
    "SLURM_NNODES": "1",
    "SLURM_NODEID": "0",
    "SLURM_JOB_NODELIST": "gpu-[01-03]",
    "SLURMD_NODENAME": "gpu-02",
    "SLURM_NTASKS_PER_NODE": "1",
}


def _addr(name: str) -> str:
    return {"gpu-01": "10.0.0.1", "n1": "127.0.0.1"}.get(name, name)


def test_outside_slurm_everything_is_the_default():
    r = resolve(Flags(), {})
    assert (r.nnodes, r.node_rank, r.nproc_per_node, r.coordinator) == (1, 0, 1, None)
    assert (r.job_id, r.run_dir, r.max_ranks) == ("p2p-job", "runs/p2p-job", None)
    assert set(r.sources.values()) <= {"default", "runs/<job_id> (default)"}


def test_a_one_node_step_takes_the_jobs_shape_not_the_steps():
    r = resolve(Flags(), STEP, _addr)
    assert r.nnodes == 3 and r.sources["nnodes"] == "SLURM_JOB_NUM_NODES"
    # SLURM_NODEID is 0 in every one-node step: the rank is the node's place in the list.
    assert r.node_rank == 1 and "SLURMD_NODENAME=gpu-02" in r.sources["node_rank"]
    assert r.coordinator == f"10.0.0.1:{slurm.default_port('4242')}"
    assert "first host gpu-01" in r.sources["coordinator"]
    assert (r.job_id, r.run_dir) == ("4242", "runs/4242")
    assert r.nproc_per_node == 1 and r.sources["nproc_per_node"] == "default"


def test_every_flag_given_wins_over_slurm():
    flags = Flags(
        nnodes="2",
        node_rank=0,
        nproc_per_node=4,
        coordinator="h:1",
        job_id="mine",
        run_dir="/shared/r",
        max_ranks=12,
    )
    r = resolve(flags, {**STEP, "SLURM_GPUS_ON_NODE": "8"}, _addr)
    assert (r.nnodes, r.node_rank, r.nproc_per_node, r.coordinator) == (2, 0, 4, "h:1")
    assert (r.job_id, r.run_dir, r.max_ranks) == ("mine", "/shared/r", 12)
    assert {r.sources[k] for k in ("nnodes", "node_rank", "coordinator", "max_ranks")} == {"flag"}


def test_gpus_on_node_give_the_ranks_less_the_spares():
    r = resolve(Flags(spares=1), {**STEP, "SLURM_GPUS_ON_NODE": "8"})
    assert r.nproc_per_node == 7 and "SLURM_GPUS_ON_NODE=8" in r.sources["nproc_per_node"]
    with pytest.raises(ValueError, match="leaves no GPU for a rank"):
        resolve(Flags(spares=1), {**STEP, "SLURM_GPUS_ON_NODE": "1"})


def _nproc(*flags: str) -> tuple[int, str]:
    args = cli.build_parser().parse_args([*flags, "train.py"])
    resolved = cli._resolve(args, {})
    return args.nproc_per_node, resolved.sources["nproc_per_node"]


def test_torchruns_gpu_cpu_and_auto_count_the_nodes_devices_less_the_spares(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    n, source = _nproc("--nproc_per_node=gpu", "--spares", "1")
    assert n == 7 and source == "--nproc-per-node gpu: 8 CUDA device(s) less --spares 1"
    with pytest.raises(cli.UsageError, match="leave none for a rank beside --spares 8"):
        _nproc("--nproc-per-node", "gpu", "--spares", "8")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(cli.UsageError, match="this node has no CUDA device; give a number"):
        _nproc("--nproc-per-node", "gpu")
    # A CPU node: one rank per CPU this process may run on, spares or not (they share them).
    cpus = len(os.sched_getaffinity(0))
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    assert _nproc("--nproc-per-node", "auto", "--spares", "1") == (
        cpus,
        f"--nproc-per-node auto: {cpus} CPUs",
    )
    assert _nproc("--nproc-per-node", "cpu")[0] == cpus
    assert _nproc("--nproc-per-node", "3") == (3, "flag")


def test_a_word_nproc_per_node_does_not_know_is_one_clear_line(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "--nproc-per-node", "gpus", "train.py"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "'gpus' is not a number of ranks, nor gpu, cpu or auto" in r.stderr


def test_tasks_per_node_are_ranks_outside_a_step_and_refused_inside_one():
    alloc = {k: v for k, v in STEP.items() if k != "SLURM_STEP_ID"}
    assert resolve(Flags(), {**alloc, "SLURM_NTASKS_PER_NODE": "4"}).nproc_per_node == 4
    with pytest.raises(ValueError, match="run one task per node"):
        resolve(Flags(), {**STEP, "SLURM_NTASKS_PER_NODE": "4"})


def test_torchrun_spellings():
    r = resolve(Flags(nnodes="2:3", rdzv_endpoint="h:29400"), {})
    assert (r.nnodes, r.max_ranks, r.coordinator) == (2, 3, "h:29400")
    r = resolve(Flags(nnodes="2:4", nproc_per_node=8), {})
    assert r.max_ranks == 32 and "MIN:MAX" in r.sources["max_ranks"]
    assert resolve(Flags(coordinator="h:1", rdzv_endpoint="h:1"), {}).coordinator == "h:1"
    with pytest.raises(ValueError, match="differ; give one"):
        resolve(Flags(coordinator="h:1", rdzv_endpoint="h:2"), {})
    for bad in ("x", "3:2", "0", "1:"):
        with pytest.raises(ValueError, match="--nnodes"):
            resolve(Flags(nnodes=bad), {})


def test_torchruns_static_rendezvous_names_the_coordinator():
    r = resolve(Flags(nnodes="2", master_addr="10.0.0.1", master_port=1234), {})
    assert r.coordinator == "10.0.0.1:1234"
    assert resolve(Flags(master_addr="10.0.0.1"), {}).coordinator == "10.0.0.1:29500"
    assert resolve(Flags(master_port=1234), {}).coordinator == "127.0.0.1:1234"
    same = Flags(rdzv_endpoint="10.0.0.1:29500", master_addr="10.0.0.1")
    assert resolve(same, {}).coordinator == "10.0.0.1:29500"
    with pytest.raises(ValueError, match=r"--master-addr/--master-port 10\.0\.0\.1:1 differ"):
        resolve(Flags(coordinator="10.0.0.1:2", master_addr="10.0.0.1", master_port=1), {})


def test_standalone_is_one_node_with_its_own_coordinator_whatever_slurm_says():
    r = resolve(Flags(standalone=True, nproc_per_node=4), {})
    assert (r.nnodes, r.node_rank, r.nproc_per_node, r.coordinator) == (1, 0, 4, None)
    assert r.sources["nnodes"] == r.sources["coordinator"] == "--standalone"
    # Inside an allocation of 3 nodes, on its third: still one node, rank 0, own coordinator;
    # the node's GPUs and the job id still come from Slurm.
    r = resolve(
        Flags(standalone=True), {**STEP, "SLURMD_NODENAME": "gpu-03", "SLURM_GPUS_ON_NODE": "8"}
    )
    assert (r.nnodes, r.node_rank, r.nproc_per_node, r.coordinator) == (1, 0, 8, None)
    assert r.job_id == STEP["SLURM_JOB_ID"]
    assert resolve(Flags(standalone=True, nnodes="1", node_rank=0), {}).nnodes == 1
    for clash, named in (
        (Flags(standalone=True, nnodes="2"), "--nnodes 2"),
        (Flags(standalone=True, node_rank=1), "--node-rank 1"),
        (Flags(standalone=True, rdzv_endpoint="h:1"), "--rdzv-endpoint h:1"),
        (Flags(standalone=True, master_addr="h"), "--master-addr h"),
    ):
        with pytest.raises(ValueError, match=f"--standalone runs one node.*drop {named} "):
            resolve(clash, {})


def test_a_node_missing_from_the_list_or_a_garbled_variable_is_one_clear_error():
    with pytest.raises(ValueError, match=r"is not in SLURM_JOB_NODELIST.*pass --node-rank"):
        resolve(Flags(), {**STEP, "SLURMD_NODENAME": "other"})
    with pytest.raises(ValueError, match="SLURM_JOB_NUM_NODES='2\\(x3\\)' is not a number"):
        resolve(Flags(), {**STEP, "SLURM_JOB_NUM_NODES": "2(x3)"})


def test_the_default_port_is_the_same_on_every_node_and_in_range():
    ports = {slurm.default_port(str(j)) for j in range(5000)}
    assert min(ports) >= slurm.PORT_BASE and max(ports) < slurm.PORT_BASE + slurm.PORT_SPAN
    assert slurm.default_port("77") == slurm.default_port("77")


# -- the CLI ------------------------------------------------------------------------------------


def _cli(*args: str, env: dict | None = None):
    return subprocess.run(
        [sys.executable, "-m", "launcher.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_print_config_shows_each_setting_and_its_source(monkeypatch, tmp_path):
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env.update({**STEP, "SLURM_JOB_NODELIST": "n[1-3]", "SLURMD_NODENAME": "n3"})
    env["PATH"] = str(tmp_path)  # no scontrol: the node name is resolved by DNS or kept
    r = _cli("--print-config", "--nnodes", "2:3", "--spares", "1", "train.py", env=env)
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line.split(None, 2)[1:] for line in r.stdout.splitlines()}
    assert rows["nnodes"] == ["2", "flag"]
    assert rows["node_rank"] == ["2", "SLURMD_NODENAME=n3 in SLURM_JOB_NODELIST"]
    assert rows["job_id"] == ["4242", "SLURM_JOB_ID"]
    assert rows["run_dir"][0] == "runs/4242"
    assert rows["coordinator"][0].endswith(f":{slurm.default_port('4242')}")
    assert rows["max_ranks"][0] == "3" and rows["spares"] == ["1", "flag"]
    # Bad Slurm input is one line and exit 2, not a traceback.
    env["SLURMD_NODENAME"] = "n9"
    r = _cli("--print-config", "train.py", env=env)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "pass --node-rank" in r.stderr and "Traceback" not in r.stderr


def test_torchruns_flags_parse_and_an_ignored_rendezvous_backend_is_said_once(tmp_path):
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    argv = ["--standalone", "--nproc_per_node", "2", "--rdzv-backend", "c10d", "--print-config"]
    r = _cli(*argv, "train.py", env=env)
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line.split(None, 2)[1:] for line in r.stdout.splitlines()}
    assert rows["nnodes"] == ["1", "--standalone"] and rows["nproc_per_node"] == ["2", "flag"]
    assert r.stderr.count("\n") == 1 and "--rdzv-backend c10d is ignored" in r.stderr
    r = _cli("--standalone", "--nnodes", "2", "train.py", env=env)
    assert r.returncode == 2 and r.stderr.startswith("p2p-run: error: --standalone runs one")
    assert r.stderr.count("\n") == 1


def test_torchruns_other_flags_are_honoured_or_said_to_be_ignored():
    def leftovers(*flags: str):
        args = cli.build_parser().parse_args([*flags, "train.py"])
        return cli._torchrun_leftovers(args), args.join_timeout_s

    assert leftovers() == ([], 300.0)
    said, join_timeout_s = leftovers(
        "--rdzv_conf", "join_timeout=900,read_timeout=60", "--monitor_interval", "0.1"
    )
    assert join_timeout_s == 900.0
    assert said == [
        "--rdzv-conf read_timeout=60 is ignored: only join_timeout applies",
        "--monitor-interval 0.1 is ignored: an agent sees an exit at once",
    ]
    assert leftovers("--start-method", "fork") == ([], 300.0)  # taken: launcher.forkserver
    for bad, message in [("timeout", "is not key=value"), ("join_timeout=soon", "not seconds")]:
        with pytest.raises(cli.UsageError, match=message):
            leftovers("--rdzv-conf", bad)


def test_an_elastic_setting_a_job_of_a_fixed_size_never_uses_is_said_once():
    def said(*flags: str) -> list[str]:
        args = cli.build_parser().parse_args(
            ["--nnodes", "2", "--nproc-per-node", "2", "--node-rank", "0", *flags, "train.py"]
        )
        cli._resolve(args, {})
        cli._validate(args, script=False)
        return cli._without_effect(args)

    both = ("--scale-up-delay", "5", "--graceful-timeout", "20")
    assert said() == [] and said("--max-ranks", "6", *both) == []
    # A job that may shrink grows back into spares, and may be told to give ranks back.
    assert said("--min-ranks", "3", *both) == []
    delay, grace = said(*both)
    assert delay.startswith("--scale-up-delay 5 has no effect: the job's size is fixed at 4 ")
    assert "so it never grows (give --max-ranks" in delay
    assert grace.startswith("--graceful-timeout 20 has no effect: the job's size is fixed at 4")
    assert "give --min-ranks below 4 to let `p2p-run scale` shrink it" in grace


def test_exit_codes_say_how_the_job_ended():
    assert cli.Exit.FINISHED == 0 and cli.Exit.USAGE == 2
    assert cli.Exit.NOT_JOINED == JOIN_FAILED == 3
    assert cli.describe_exit(0) == "the job finished"
    assert "without finishing" in cli.describe_exit(1)
    assert "nothing was started" in cli.describe_exit(2)
    assert "--join-timeout" in cli.describe_exit(3)
    assert cli.describe_exit(143) == "this node was stopped by signal 15"


def _agent(node: int) -> Process:
    return Process(f"agent/{node}", "agent", node, 100 + node)


def test_nodes_that_never_join_end_the_job_naming_them():
    m = Membership(MembershipConfig(world_size=6, ranks_per_node=2, join_timeout_s=30))
    assert m.tick(0.0) == []
    m.hello(_agent(1), None, 1.0)
    assert m.missing_nodes() == [0, 2]
    m.heartbeat("agent/1", 29.0)
    assert not [a for a in m.tick(30.0) if type(a).__name__ == "End"]
    out = m.tick(30.5)
    (end,) = [a for a in out if type(a).__name__ == "End"]
    assert end.code == JOIN_FAILED and "node(s) [0, 2] did not join within 30s" in end.reason


def test_the_join_deadline_ends_once_every_node_is_there():
    m = Membership(MembershipConfig(world_size=4, ranks_per_node=2, join_timeout_s=5))
    m.tick(0.0)
    m.hello(_agent(0), None, 1.0)
    m.hello(_agent(1), None, 2.0)
    m.tick(3.0)
    m.heartbeat("agent/0", 999.0)
    m.heartbeat("agent/1", 999.0)
    m.tick(1000.0)
    assert not m.ended
    # Without a deadline nothing ends however long nodes are missing.
    m = Membership(MembershipConfig(world_size=4, ranks_per_node=2))
    m.tick(0.0)
    m.tick(1e6)
    assert not m.ended


# -- the secret ---------------------------------------------------------------------------------


def test_racing_creators_all_get_the_one_secret_linked_into_place(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from launcher import protocol, secret

    path = tmp_path / "secret"
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda _: secret.create_once(path), range(16)))
    assert len(set(got)) == 1 and got[0] == protocol.read_secret(str(path))
    assert [p.name for p in tmp_path.iterdir()] == ["secret"]  # no temp file left behind
    assert secret.create_once(path) == got[0]  # an existing secret is kept


def test_waiting_for_the_secret_ends_when_it_appears_or_with_one_line(tmp_path):
    import threading

    from launcher import secret

    path = tmp_path / "secret"
    with pytest.raises(TimeoutError) as e:
        secret.wait_for(path, 0.3)
    message = str(e.value)
    assert "\n" not in message and str(path) in message
    assert "--join-timeout" in message and "--run-dir" in message and "--secret-file" in message
    maker = threading.Timer(0.3, secret.create_once, [path])
    maker.start()
    try:
        assert secret.wait_for(path, 30.0) == secret.create_once(path)
    finally:
        maker.join()


def test_a_node_declared_lost_while_it_ran_is_told_the_job_went_on():
    def ev(event, identity, **f):
        return {"event": event, "identity": identity, "source": "coordinator", **f}

    log = [ev("hello", "agent/0"), ev("hello", "agent/1"), ev("fault", "agent/1", reason="r")]
    assert cli.dropped_from_job(log, 1) == "r"
    assert cli.dropped_from_job(log, 0) is None
    # Another process's record, or a fault from an earlier run of the same run directory.
    assert cli.dropped_from_job([{**log[2], "source": "agent/1"}], 1) is None
    assert cli.dropped_from_job([*log, ev("hello", "agent/1")], 1) is None
    # A standby that took over declared it lost (it cut node 0 off with its coordinator).
    took_over = [
        ev("hello", "agent/0"),
        {**ev("fault", "agent/0", reason="r"), "source": "coordinator/1"},
    ]
    assert cli.dropped_from_job(took_over, 0) == "r"
