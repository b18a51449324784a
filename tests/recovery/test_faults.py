"""What a protected job does about an exception, and the exit code each ending gives."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from launcher.local import rank_context, rank_process
from p2p_state.replicator import ReplicationError
from recovery.comms import Interrupted
from recovery.errors import (
    ConfigurationError,
    GivenBack,
    JobStopped,
    RecoveryFailed,
    exit_code_of,
)
from recovery.faults import Action, decide, is_gloo_error
from recovery.restore import NoSurvivingCopy
from recovery.session import JobEnded, NotAMember

# As gloo words them in torch 2.13 (the origin is what counts, not the words).
GLOO_PEER_CLOSED = RuntimeError(
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
    "by peer [127.0.0.1]:39830"
)


def _decide(exc: BaseException, **kw) -> Action:
    return decide(exc, **{"standalone": False, "aborted": False, **kw})


@pytest.mark.parametrize(
    "exc",
    [
        Interrupted("a new generation arrived"),
        ReplicationError("round 3 failed"),
        dist.DistBackendError("NCCL error"),
        dist.DistNetworkError("connect failed"),
        GLOO_PEER_CLOSED,
    ],
)
def test_a_failure_of_a_peer_or_a_link_is_recovered_from(exc):
    assert _decide(exc) is Action.RECOVER


def test_a_user_error_stands_even_when_it_mentions_sockets():
    # A message check would take these for faults; the job must not swallow the user's bug.
    for exc in (
        RuntimeError("Socket options are wrong in my data loader: Timed out"),
        ValueError("shape mismatch"),
        KeyError("ProcessGroup"),
    ):
        assert _decide(exc) is Action.RAISE, exc


def test_whatever_failed_while_the_generation_was_aborted_is_a_fault():
    exc = RuntimeError("Connection reset")  # an abort's error, whatever the backend says
    assert _decide(exc) is Action.RAISE
    assert _decide(exc, aborted=True) is Action.RECOVER


def test_a_standalone_job_has_nothing_to_recover_with():
    assert _decide(GLOO_PEER_CLOSED, standalone=True) is Action.RAISE
    assert _decide(Interrupted("x"), standalone=True, aborted=True) is Action.RAISE


def test_a_missing_copy_waits_for_the_next_generation_only_during_a_recovery():
    exc = NoSurvivingCopy("rank 2 has no copy")
    assert _decide(exc) is Action.RAISE
    assert _decide(exc, recovering=True) is Action.RECOVER


def test_endings_leave_the_job_even_while_aborted():
    for exc in (
        JobEnded(3, "stopped"),
        RecoveryFailed("no copy"),
        ConfigurationError("k too large"),
        GivenBack("resize"),
        JobStopped("no spare"),
    ):
        assert _decide(exc, aborted=True) is Action.END, exc
    assert _decide(NotAMember("no rank"), aborted=True) is Action.LEAVE


def test_interpreter_exits_are_never_taken_for_faults():
    for exc in (KeyboardInterrupt(), SystemExit(3)):
        assert _decide(exc, aborted=True) is Action.RAISE


def test_only_errors_gloo_stamps_are_gloo_s():
    assert is_gloo_error(GLOO_PEER_CLOSED)
    assert not is_gloo_error(RuntimeError("[my_loader.py:3] read gloo/ data"))
    assert not is_gloo_error(RuntimeError("Connection closed by peer"))
    assert not is_gloo_error(ValueError(str(GLOO_PEER_CLOSED)))


def test_each_ending_has_its_exit_code():
    assert exit_code_of(GivenBack("x")) == 0
    assert exit_code_of(JobStopped("x")) == 1
    assert exit_code_of(RecoveryFailed("x")) == 1
    assert exit_code_of(ConfigurationError("x")) == 2
    assert exit_code_of(JobEnded(3, "x")) == 3
    assert exit_code_of(JobEnded(0, "x")) == 1  # a rank still training when the job ended
    assert exit_code_of(RuntimeError("x")) is None


def _peer_dies(rank: int, port: int, out: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=20))
    t = torch.ones(4)
    dist.all_reduce(t)
    if rank == 1:
        os._exit(9)
    time.sleep(0.5)
    try:
        dist.all_reduce(t)
        out.put("no error")
    except Exception as e:
        out.put(_decide(e).value)
    out.close()
    out.join_thread()  # os._exit does not wait for the queue's feeder thread
    os._exit(0)


@pytest.mark.slow
def test_the_error_gloo_raises_when_a_peer_dies_is_a_fault():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = rank_context()
    out = ctx.Queue()
    procs = [rank_process(_peer_dies, (r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        assert out.get(timeout=60) == Action.RECOVER.value
    finally:
        for p in procs:
            p.join(timeout=10)
            p.kill()
