"""NCCL fault handling that can be checked without a GPU: the aborts started together, off the
heartbeat thread and bounded, the environment every group is created with, and a failed step's
frames released before recovery.

Stand-in groups record what is done to them; the GPU behaviour itself is checked by
``tests/recovery/test_nccl_gpu.py`` and ``p2p-bench gpu-check`` where CUDA is present.
"""

from __future__ import annotations

import gc
import threading
import types
import weakref

import pytest
import torch.distributed as dist

from recovery import comms as comms_mod
from recovery.accumulation import CarriedGradients
from recovery.comms import (
    ENV_NCCL_ASYNC_ERROR_HANDLING,
    GROUP_ENVIRONMENT,
    NCCL_ASYNC_ERROR_HANDLING,
    Comms,
    CommsSpec,
    abort_together,
    create_comms,
)
from recovery.faults import Action
from recovery.job import ProtectedJob
from recovery.unguarded import UnguardedCollectives

HANG_DEADLINE_S = 30.0


def _spec(port: int = 0) -> CommsSpec:
    return CommsSpec(
        generation=3,
        rank=0,
        world_size=1,
        store_host="127.0.0.1",
        store_port=port,
        store_prefix="gen3/",
        backend="gloo",
        timeout_s=30.0,
        join_timeout_s=10.0,
    )


class _Recorder:
    """A stand-in NCCL process group that records its abort in one shared log."""

    def __init__(self, name: str, log: list[str], *, fail: bool = False, block=None) -> None:
        self.name, self.log, self.fail, self.block = name, log, fail, block

    def abort(self) -> None:
        self.log.append(f"abort {self.name}")
        if isinstance(self.block, threading.Barrier):
            self.block.wait(HANG_DEADLINE_S)  # BrokenBarrierError if the others never start
        elif self.block is not None:
            assert self.block.wait(HANG_DEADLINE_S)
        if self.fail:
            raise RuntimeError("NCCL error: unhandled system error")
        self.log.append(f"aborted {self.name}")


def test_an_abort_that_waits_for_the_other_communicator_does_not_hang(caplog) -> None:
    # As ncclCommAbort's reclaim does: each abort returns only once every communicator was
    # told to quit. One after another, the first would wait for the second forever.
    log: list[str] = []
    both_started = threading.Barrier(2)
    groups = [_Recorder(n, log, block=both_started) for n in ("replication", "default")]
    abort_together(groups, generation=3, wait_s=HANG_DEADLINE_S)
    assert sorted(log) == [
        "abort default",
        "abort replication",
        "aborted default",
        "aborted replication",
    ]
    assert "still running" not in caplog.text and "aborting a NCCL group" not in caplog.text


def test_a_failing_abort_does_not_stop_the_others(caplog) -> None:
    log: list[str] = []
    groups = [_Recorder("replication", log, fail=True), _Recorder("default", log)]
    abort_together(groups, generation=3)
    assert "aborted default" in log and "abort replication" in log
    assert "aborting a NCCL group of generation 3: NCCL error" in caplog.text


def test_an_abort_that_never_returns_is_left_behind_at_the_deadline(caplog) -> None:
    log: list[str] = []
    never = threading.Event()
    groups = [_Recorder("wedged", log, block=never), _Recorder("default", log)]
    abort_together(groups, generation=3, wait_s=0.2)
    assert "aborted default" in log and "aborted wedged" not in log
    assert "1 of 2 NCCL group aborts still running" in caplog.text
    never.set()


def test_comms_abort_aborts_every_nccl_group_with_the_default(monkeypatch) -> None:
    log: list[str] = []
    comms = Comms(_spec())
    comms.default = _Recorder("default", log)
    comms.groups = {"replication": _Recorder("replication", log), "ckpt": _Recorder("ckpt", log)}
    monkeypatch.setattr(comms_mod, "_nccl_backend", lambda pg: pg)
    comms.abort()
    assert sorted(e for e in log if e.startswith("aborted")) == [
        "aborted ckpt",
        "aborted default",
        "aborted replication",
    ]
    comms.abort()  # idempotent
    assert log.count("abort default") == 1


def test_a_group_whose_creation_the_abort_broke_is_an_interruption(monkeypatch) -> None:
    comms = Comms(_spec())

    def new_group(**kwargs):  # the abort closes the store a member is reading
        comms.abort()
        raise dist.DistStoreError("the rendezvous store client was closed")

    monkeypatch.setattr(dist, "new_group", new_group)
    with pytest.raises(comms_mod.Interrupted, match="its replication group was being formed"):
        comms.group("replication", "gloo")
    with pytest.raises(comms_mod.Interrupted, match="before its groups were made"):
        comms.group("checkpoint", "gloo")


def test_a_group_that_fails_to_form_unaborted_keeps_its_error(monkeypatch) -> None:
    def new_group(**kwargs):
        raise dist.DistStoreError("timed out after 5s waiting for 4 keys")

    monkeypatch.setattr(dist, "new_group", new_group)
    with pytest.raises(dist.DistStoreError, match="timed out"):
        Comms(_spec()).group("replication", "gloo")


def test_an_abort_after_destroy_does_not_wait() -> None:
    comms = Comms(_spec())
    comms.destroy()
    done = threading.Thread(target=comms.abort)
    done.start()
    done.join(HANG_DEADLINE_S / 3)  # would wait the whole ABORT_WAIT_S for an abort never begun
    assert not done.is_alive() and comms.aborted


def test_a_blocked_abort_leaves_the_calling_thread_free(monkeypatch) -> None:
    log: list[str] = []
    release = threading.Event()
    comms = Comms(_spec())
    comms.default = _Recorder("default", log, block=release)
    monkeypatch.setattr(comms_mod, "_nccl_backend", lambda pg: pg)
    thread = comms.abort_in_background()
    assert thread is not None
    # The caller (the heartbeat thread) got control back while the abort is still blocked.
    deadline = threading.Event()
    while "abort default" not in log:
        assert not deadline.wait(0.01) and thread.is_alive()
    assert "aborted default" not in log and thread.is_alive()
    # The training thread, breaking the same generation, waits for that abort to end.
    second = threading.Thread(target=comms.abort)
    second.start()
    second.join(0.2)
    assert second.is_alive(), "a second abort returned while the first was still running"
    release.set()
    thread.join(HANG_DEADLINE_S)
    second.join(HANG_DEADLINE_S)
    assert not thread.is_alive() and not second.is_alive() and log[-1] == "aborted default"
    assert comms.abort_in_background() is None  # already aborted: nothing more to start


def test_the_session_aborts_off_the_heartbeat_thread() -> None:
    from recovery.session import Session

    started: list[str] = []
    stand_in = types.SimpleNamespace(
        generation=1,
        abort=lambda: started.append("abort on the caller's thread"),
        abort_in_background=lambda: started.append("background"),
    )
    Session._abort_older_than(types.SimpleNamespace(comms=stand_in), 2)
    assert started == ["background"]


def test_every_group_is_created_with_the_nccl_handling_the_abort_needs_and_gloos_small_rendezvous(
    monkeypatch, caplog
):
    monkeypatch.setenv(ENV_NCCL_ASYNC_ERROR_HANDLING, "3")  # torch's default tears down
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")  # holds the watchdog 15 s
    monkeypatch.delenv("TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC", raising=False)  # 15 s, then 60 s
    monkeypatch.setenv("GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER", "0")  # N pair numbers an address
    monkeypatch.delenv("GLOO_ENABLE_STORE_V2_API", raising=False)  # one get per member
    seen: list[tuple[str, dict[str, str | None]]] = []

    def record(what):
        def create(*args, **kwargs):
            seen.append((what, {n: comms_mod.os.environ.get(n) for n in GROUP_ENVIRONMENT}))
            return types.SimpleNamespace(set_timeout=lambda t: None)

        return create

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setattr(comms_mod, "_init_default", record("default"))
    monkeypatch.setattr(comms_mod.dist, "new_group", record("new_group"))
    comms = create_comms(_spec(master.port), register=lambda c: None)
    comms.group("replication", "gloo")
    comms.group("ckpt", "gloo")
    wanted = {ENV_NCCL_ASYNC_ERROR_HANDLING: NCCL_ASYNC_ERROR_HANDLING}
    wanted["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "0"
    wanted["TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"] = "0"
    wanted["GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER"] = "1"
    wanted["GLOO_ENABLE_STORE_V2_API"] = "1"
    assert seen == [("default", wanted), ("new_group", wanted), ("new_group", wanted)]
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=3 replaced by 0" in caplog.text
    assert "TORCH_NCCL_DUMP_ON_TIMEOUT=1 replaced by 0" in caplog.text
    assert "GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER=0 replaced by 1" in caplog.text
    comms.default = None  # a stand-in: nothing to destroy
    comms.destroy()


def test_a_failed_step_s_frames_are_released_before_recovery() -> None:
    class Activations:
        pass

    alive: list[bool] = []

    def recover(cause: BaseException) -> None:
        gc.collect()
        alive.append(held() is not None)

    job = types.SimpleNamespace(
        _current=7,
        step_done=6,
        _unguarded=UnguardedCollectives(),
        _carried=CarriedGradients(),
        _session=types.SimpleNamespace(interrupted=False),
        _finish_step=lambda step: None,
        _decide=lambda e: Action.RECOVER,
        _recover=recover,
    )
    held = None

    def forward() -> None:
        nonlocal held
        activations = Activations()
        held = weakref.ref(activations)
        try:
            raise ConnectionError("peer gone")
        except ConnectionError as e:
            raise RuntimeError("Connection closed by peer") from e

    with ProtectedJob.step(job):
        forward()
    assert alive == [False], "the failed step's frames were still alive during recovery"
    assert job._current is None


@pytest.mark.parametrize("strip", [False])
def test_the_frames_check_can_fail(strip: bool, monkeypatch) -> None:
    # Without the release, the same check sees the frames alive.
    from recovery import job as job_mod

    monkeypatch.setattr(job_mod, "without_frames", lambda e: e)
    with pytest.raises(AssertionError, match="still alive"):
        test_a_failed_step_s_frames_are_released_before_recovery()


@pytest.mark.parametrize(
    ("backend", "cuda", "expected"),
    [
        ("cpu:gloo,cuda:nccl", True, "cuda:1"),
        ("nccl", True, "cuda:1"),
        ("gloo", True, None),
        ("cpu:gloo,cuda:nccl", False, None),
    ],
)
def test_an_nccl_default_group_is_bound_to_its_gpu(monkeypatch, backend, cuda, expected) -> None:
    # Bound, it initialises NCCL eagerly and later groups are split from it.
    seen: dict = {}
    monkeypatch.setattr(comms_mod.torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(comms_mod.torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(comms_mod.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(comms_mod.dist, "init_process_group", lambda *a, **kw: seen.update(kw))
    monkeypatch.setattr(comms_mod, "_forget_stale_shardings", lambda *a: None)
    comms_mod._init_default(dist.HashStore(), backend, 0, 1, comms_mod.timedelta(seconds=5))
    device = seen["device_id"]
    assert (str(device) if device is not None else None) == expected


def test_an_nccl_side_group_gets_a_cta_limit(monkeypatch) -> None:
    class Options:  # stand-in for ProcessGroupNCCL.Options (CPU builds have no NCCL)
        def __init__(self) -> None:
            self.config = types.SimpleNamespace(max_ctas=0)

    monkeypatch.setattr(
        comms_mod.dist, "ProcessGroupNCCL", types.SimpleNamespace(Options=Options), raising=False
    )
    given: list = []

    def new_group(**kwargs):
        given.append(kwargs["pg_options"])
        return types.SimpleNamespace(set_timeout=lambda t: None)

    monkeypatch.setattr(comms_mod.dist, "new_group", new_group)
    comms = Comms(_spec())
    comms.group("replication", "nccl")
    comms.group("checkpoint", "gloo")
    assert given[0].config.max_ctas == 8 and given[1] is None
    with pytest.raises(ValueError, match="side_group_max_ctas=0"):
        CommsSpec(
            **{**{f: getattr(_spec(), f) for f in CommsSpec.__slots__}, "side_group_max_ctas": 0}
        )
