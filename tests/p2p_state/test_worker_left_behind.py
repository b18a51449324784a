"""A replication worker left behind once is not waited for again (no processes)."""

from __future__ import annotations

import queue
import threading

from p2p_state.replicator import Replicator


class _StuckThread:
    """A worker blocked where no stop reaches it: it never ends; joins are recorded."""

    ident = None

    def __init__(self) -> None:
        self.joins: list[float] = []

    def is_alive(self) -> bool:
        return True

    def join(self, timeout: float | None = None) -> None:
        self.joins.append(timeout)


def _replicator_with(worker: _StuckThread) -> Replicator:
    rep = object.__new__(Replicator)  # only the stopping machinery is under test
    rep.rank = 0
    rep._fence_handle = rep._forward_fence_handle = None
    rep._lock = threading.Lock()
    rep._failure = None
    rep._queue = queue.Queue()
    rep._worker = worker
    rep._left_behind = False
    return rep


def test_a_stuck_worker_is_waited_for_once_then_left():
    worker = _StuckThread()
    rep = _replicator_with(worker)
    assert rep.abandon(1.0) is False
    assert worker.joins == [1.0]
    # Every later fault abandons the old generation's stores again: no second wait.
    assert rep.abandon(1.0) is False
    assert rep.abandon(10.0) is False
    assert worker.joins == [1.0]


def test_a_worker_that_stops_is_joined():
    class _Stops(_StuckThread):
        def __init__(self) -> None:
            super().__init__()
            self.alive = True

        def is_alive(self) -> bool:
            return self.alive

        def join(self, timeout: float | None = None) -> None:
            super().join(timeout)
            self.alive = False

    worker = _Stops()
    rep = _replicator_with(worker)
    assert rep.abandon(1.0) is True and worker.joins == [1.0]
    assert rep._queue.get_nowait() is None  # it was told to stop


def test_after_a_fault_the_worker_is_told_to_stop_and_asked_later(caplog):
    worker = _StuckThread()
    rep = _replicator_with(worker)
    assert rep.abandon(0.0) is False and worker.joins == []  # no wait on the recovery's path
    assert rep._queue.get_nowait() is None  # told to stop
    # When the next replicator is made: still in its round, so left behind (logged once).
    assert rep.left_behind() is True and rep.left_behind() is True
    assert len([r for r in caplog.records if "still busy" in r.getMessage()]) == 1
    assert rep.abandon(1.0) is False and worker.joins == []  # and never waited for again
