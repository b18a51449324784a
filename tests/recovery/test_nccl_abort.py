"""NCCL fault handling that can be checked without a GPU: the abort's order and thread, the
environment every group is created with, and a failed step's frames released before recovery.

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
from recovery.comms import (
    ENV_NCCL_ASYNC_ERROR_HANDLING,
    NCCL_ASYNC_ERROR_HANDLING,
    Comms,
    CommsSpec,
    abort_together,
    create_comms,
)
from recovery.faults import Action
from recovery.job import ProtectedJob

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
    """A stand-in NCCL backend and process group that records calls in one shared log."""

    def __init__(self, name: str, log: list[str], *, fail: bool = False, block=None) -> None:
        self.name, self.log, self.fail, self.block = name, log, fail, block

    def _group_start(self) -> None:
        self.log.append("group_start")

    def _group_end(self) -> None:
        self.log.append("group_end")

    def abort(self) -> None:
        self.log.append(f"abort {self.name}")
        if self.block is not None:
            assert self.block.wait(HANG_DEADLINE_S)
        if self.fail:
            raise RuntimeError("NCCL error: unhandled system error")


def test_nccl_groups_are_aborted_together_inside_one_nccl_group() -> None:
    log: list[str] = []
    groups = [_Recorder("replication", log, fail=True), _Recorder("default", log)]
    abort_together(groups, groups[-1], generation=3)
    # Every abort between one start and one end, a failing abort not stopping the next.
    assert log == ["group_start", "abort replication", "abort default", "group_end"]


def test_comms_abort_orders_newest_group_first_with_the_default_last(monkeypatch) -> None:
    log: list[str] = []
    comms = Comms(_spec())
    comms.default = _Recorder("default", log)
    comms.groups = {"replication": _Recorder("replication", log), "ckpt": _Recorder("ckpt", log)}
    monkeypatch.setattr(comms_mod, "_nccl_backend", lambda pg: pg)
    comms.abort()
    assert log == ["group_start", "abort ckpt", "abort replication", "abort default", "group_end"]
    comms.abort()  # idempotent
    assert log.count("group_start") == 1


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
    assert "group_end" not in log and thread.is_alive()
    release.set()
    thread.join(HANG_DEADLINE_S)
    assert not thread.is_alive() and log[-1] == "group_end"
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


def test_every_group_is_created_with_the_nccl_handling_the_abort_needs(monkeypatch) -> None:
    monkeypatch.setenv(ENV_NCCL_ASYNC_ERROR_HANDLING, "3")  # torch's default tears down
    seen: list[tuple[str, str | None]] = []

    def record(what):
        def create(*args, **kwargs):
            seen.append((what, comms_mod.os.environ.get(ENV_NCCL_ASYNC_ERROR_HANDLING)))
            return types.SimpleNamespace(set_timeout=lambda t: None)

        return create

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setattr(comms_mod, "_init_default", record("default"))
    monkeypatch.setattr(comms_mod.dist, "new_group", record("new_group"))
    comms = create_comms(_spec(master.port), register=lambda c: None)
    comms.group("replication", "gloo")
    comms.group("ckpt", "gloo")
    assert seen == [
        ("default", NCCL_ASYNC_ERROR_HANDLING),
        ("new_group", NCCL_ASYNC_ERROR_HANDLING),
        ("new_group", NCCL_ASYNC_ERROR_HANDLING),
    ]
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
