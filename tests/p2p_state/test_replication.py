"""Replication with real processes and real gloo groups: 4 ranks on 2 emulated nodes, FSDP2."""

from __future__ import annotations

import logging
import queue
import threading

import pytest
import torch

from launcher.local import WorkerGroupConfig, run_local
from p2p_state.memory import BufferPool, MemoryKind
from p2p_state.replicator import ReplicationError, Replicator
from p2p_state.snapshot import DoubleBuffer, SnapshotHeader
from tests.p2p_state import _workers

pytestmark = pytest.mark.slow

NUM_STEPS = 4
# Small chunks so every transfer of the tiny model takes several chunk rounds.
CHUNK_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def replicated_run():
    cfg = WorkerGroupConfig(world_size=4, ranks_per_node=2, timeout_s=240)
    return run_local(_workers.replicate_and_restore, cfg, (NUM_STEPS, CHUNK_BYTES))


@pytest.fixture(scope="module")
def reference_run():
    cfg = WorkerGroupConfig(world_size=4, ranks_per_node=2, timeout_s=240)
    return run_local(_workers.continue_without_fault, cfg, (NUM_STEPS,))


def test_planner_predicts_the_layouts_fsdp2_produces(replicated_run):
    assert all(r["planner_predicts_fsdp_layouts"] for r in replicated_run)


def test_buddies_are_on_the_other_node(replicated_run):
    for r in replicated_run:
        assert len(r["holders"]) == 1
        assert r["holders"][0] // 2 != r["rank"] // 2


def test_every_replica_equals_its_owners_snapshot_after_every_step(replicated_run):
    by_rank = {r["rank"]: r for r in replicated_run}
    checked = 0
    for step in range(1, NUM_STEPS + 1):
        for holder in by_rank.values():
            entry = holder["per_step"][step - 1]
            assert entry["committed"] == step
            for owner, digest in entry["replicas"].items():
                assert digest == by_rank[owner]["per_step"][step - 1]["own"]
                checked += 1
    assert checked == 4 * NUM_STEPS


def test_restore_from_buddy_reproduces_live_state_bitwise(replicated_run):
    for r in replicated_run:
        assert r["after"] == r["final"], f"rank {r['rank']} state differs after restore"
        assert r["extras"] == {"sampler_offset": NUM_STEPS * 8}
        assert r["same_objects"], "restore must write into the live parameters in place"


def test_restored_run_continues_exactly_like_the_fault_free_run(replicated_run, reference_run):
    for restored, reference in zip(replicated_run, reference_run):
        assert restored["final"] == reference["final"]
        assert restored["loss_after"] == reference["loss_after"]


def test_flipped_byte_in_a_ddp_replica_is_detected_and_never_served():
    cfg = WorkerGroupConfig(world_size=2, ranks_per_node=1, timeout_s=120)
    for r in run_local(_workers.corrupt_replica, cfg, (CHUNK_BYTES,)):
        assert r["ok_before"] is True
        assert "failed its checksum" in r["caught"]
        assert r["held_after"] == [1], "a corrupt replica must drop out of the holdings"
        assert r["older_ok"] is True


def test_replica_mid_transfer_when_sender_dies_is_never_complete():
    die_at = 3
    cfg = WorkerGroupConfig(world_size=2, ranks_per_node=1, timeout_s=120, expected_exit={1: -9})
    survivor, _ = run_local(_workers.sender_dies_mid_transfer, cfg, (4096, die_at))
    assert "replication failed" in survivor["error"]
    # The slot being filled held step die_at - 2; the last complete replica survives untouched.
    assert survivor["held"] == {1: [die_at - 1]}
    assert survivor["last_good_ok"] is True
    assert survivor["committed"] == die_at - 1


def test_layout_mismatch_names_both_layouts():
    cfg = WorkerGroupConfig(world_size=2, ranks_per_node=1, timeout_s=120)
    for r in run_local(_workers.mismatched_layouts, cfg):
        msg = r["error"]
        assert "rank 0 has layout" in msg and "rank 1 has layout" in msg
        assert "param/" in msg


def test_configuration_that_does_not_fit_is_refused_with_the_numbers_and_the_fix():
    cfg = WorkerGroupConfig(world_size=2, ranks_per_node=1, timeout_s=120)
    for r in run_local(_workers.refuses_what_does_not_fit, cfg):
        assert "snapshots (2 x" in r["error"] and "replicas for ranks" in r["error"]
        assert "max_memory_fraction" in r["error"] and "lower the replication factor" in r["error"]


def test_a_worker_that_does_not_stop_is_left_with_where_it_is_stuck(caplog):
    release = threading.Event()

    def stuck_in_a_collective():
        release.wait(30)

    rep = Replicator.__new__(Replicator)  # only the worker's bookkeeping is exercised
    rep.rank, rep._fence_handle, rep._forward_fence_handle, rep._queue = (
        3,
        None,
        None,
        queue.Queue(),
    )
    rep._left_behind = False
    rep._worker = threading.Thread(target=stuck_in_a_collective, daemon=True)
    rep._worker.start()
    try:
        with caplog.at_level(logging.ERROR, logger="p2p_state.replicator"):
            assert rep._stop_worker(0.2) is False
        assert "rank 3: replication worker still busy after 200 ms" in caplog.text
        assert "in stuck_in_a_collective" in caplog.text and "release.wait(30)" in caplog.text
    finally:
        release.set()
        rep._worker.join(5)


def _stopped_replicator(worker: threading.Thread) -> Replicator:
    """A replicator's bookkeeping only: own snapshots of steps 4 and 5, a replica of rank 1's."""
    rep = Replicator.__new__(Replicator)
    rep._lock, rep._worker, rep._failure, rep._last_copy = threading.Lock(), worker, None, None
    rep.own = DoubleBuffer(1024, MemoryKind.HOST, torch.device("cpu"))
    rep.replicas = {1: DoubleBuffer(2048, MemoryKind.HOST, torch.device("cpu"))}
    for buf in (rep.own, rep.replicas[1]):
        for step in (4, 5):
            buf.publish(buf.writable(), SnapshotHeader(step, 1, "0" * 16, buf.nbytes, 0, 1))
    return rep


def test_an_abandoned_replicator_gives_back_all_but_the_kept_copies():
    worker = threading.Thread(target=lambda: None)
    worker.start()
    worker.join()
    rep = _stopped_replicator(worker)
    pool = BufferPool()
    with pytest.raises(RuntimeError, match="abandoned"):
        rep.give_back(pool)  # still replicating: its slots are in use
    rep._failure = ReplicationError("replication was abandoned after a fault")

    class CopyOnASideStream:  # what a CUDA event of the last snapshot copy is asked
        synchronized = False

        def synchronize(self):
            self.synchronized = True

    rep._last_copy = CopyOnASideStream()
    assert rep.give_back(pool, keep={5}) == 1024 + 2048
    assert rep._last_copy.synchronized, "a copy still in flight must land before its slot moves"
    assert rep.own.complete_steps() == [5] and rep.replicas[1].complete_steps() == [5]
    assert rep.give_back(pool) == 1024 + 2048 and len(pool) == 4
    assert rep.own.complete_steps() == [] and rep.replicas[1].complete_steps() == []


def test_a_recovery_keeps_the_committed_copies_until_the_restored_round_is_copied_again():
    # The restored step (5) may be a round a fault cut short: its replicas reached only some
    # holders, one of which may be the next to fail. Until the new generation commits its own
    # copy, the copies of the committed step (4, every holder's) must stay too.
    from recovery.stores import GenerationStores

    worker = threading.Thread(target=lambda: None)
    worker.start()
    worker.join()
    rep = _stopped_replicator(worker)
    rep._failure = ReplicationError("replication was abandoned after a fault")
    rep._committed = 4
    stores = GenerationStores()
    stores.add(rep, restored_step=0)
    assert stores.committed_step == 4
    pool = stores.recycle_for(5)
    assert rep.own.complete_steps() == [4, 5] and rep.replicas[1].complete_steps() == [4, 5]
    assert len(pool) == 0
    rep._committed = 5  # the usual case: the restored step is the committed one
    assert stores.recycle_for(5) is pool and len(pool) == 2
    assert rep.own.complete_steps() == [5] and rep.replicas[1].complete_steps() == [5]


def test_a_replicator_whose_worker_is_left_behind_gives_nothing_back():
    release = threading.Event()
    worker = threading.Thread(target=lambda: release.wait(30), daemon=True)
    worker.start()
    try:
        rep = _stopped_replicator(worker)
        rep._failure = ReplicationError("replication was abandoned after a fault")
        pool = BufferPool()
        assert rep.give_back(pool, keep={5}) == 0 and len(pool) == 0
        assert rep.own.complete_steps() == [4, 5] and rep.replicas[1].complete_steps() == [4, 5]
    finally:
        release.set()
        worker.join(5)


def test_an_abandoned_replicator_lets_go_of_the_old_model_and_optimizer():
    import gc
    import weakref

    from p2p_state.state import TrainingState

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    worker = threading.Thread(target=lambda: None)
    worker.start()
    worker.join()
    rep = _stopped_replicator(worker)
    rep.state = TrainingState(model, opt)
    rep.layout = rep.state.layout
    rep._fence_handle = rep._forward_fence_handle = None
    rep._left_behind, rep._queue = False, queue.Queue()
    rep._idle, rep._in_flight = threading.Condition(rep._lock), 0
    gone = weakref.ref(model)
    del model, opt
    rep.abandon()
    gc.collect()
    assert gone() is None  # its memory can go before the next generation's model is built
    assert rep.layout.entry("param/weight").shape == (4, 4)  # what the copies are read with
    assert rep.own_steps() == [4, 5]
    with pytest.raises(ReplicationError, match="abandoned"):
        rep._wait_idle(0.1)  # so replicate() refuses before it would need the state


def test_the_worker_posts_no_data_transfer_only_headers_and_commits():
    # Beside NCCL the round's transfers must be launched at the same point of every rank's
    # step: replicate() posts them on the training thread; the worker thread only waits for
    # them and talks over the control group (gloo: no kernels to order).
    steps = 3
    cfg = WorkerGroupConfig(world_size=2, ranks_per_node=1, timeout_s=120)
    for r in run_local(_workers.posting_threads, cfg, (steps, 4096)):
        assert r["committed"] == steps and r["replicas_equal"] == [True] * steps
        data = [(kind, thread) for kind, group, thread in r["posts"] if group == "data"]
        control = [(kind, thread) for kind, group, thread in r["posts"] if group == "control"]
        # Several chunk rounds per step, every one posted by the training thread.
        assert len(data) > 2 * steps and {t for _, t in data} == {"MainThread"}
        # One header exchange and one commit per step, both on the worker thread.
        assert sorted(k for k, _ in control) == ["all_reduce"] * steps + ["p2p"] * steps
        assert {t for _, t in control} == {f"p2p-replicator-{r['rank']}"}
