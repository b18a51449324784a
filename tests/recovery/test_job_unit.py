"""The protected job's control flow against a fake session: no processes, no groups.

The session is autospec'd from :class:`recovery.session.Session`, so a call the job makes that the
real session does not have fails here too. The work of each step (replication) and of each
restore (the census, the factory, the transfers) is stubbed: what is checked is what the job does
about faults, generations and endings. The restore protocol itself is covered by the
multi-process tests (test_protect.py, test_restore.py, test_user_scripts.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from unittest import mock

import pytest
import torch

from launcher.client import ControlClient
from recovery import api
from recovery.comms import Comms
from recovery.config import RecoveryConfig
from recovery.errors import ConfigurationError, GivenBack, RecoveryFailed, exit_code_of
from recovery.generation import GenerationInfo
from recovery.job import ProtectedJob
from recovery.restore import NoSurvivingCopy
from recovery.session import (
    STOP_SIGNAL,
    CoordinatorsLost,
    JobEnded,
    NotAMember,
    Session,
)

GLOO_PEER_CLOSED = "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed"


def _info(generation: int, world_size: int = 2) -> GenerationInfo:
    return GenerationInfo(
        generation=generation,
        world_size=world_size,
        ranks={r: f"rank/0/{r}" for r in range(world_size)},
        nodes=dict.fromkeys(range(world_size), 0),
        lost=(),
        replaced={},
        committed_step=0,
        store_prefix=f"gen{generation}/",
        holders={},
        directive="train",
        ack_timeout_s=5.0,
        graceful=False,
        replicas=1,
        reason="test",
        arrived_t=time.monotonic(),
    )


@pytest.fixture
def session() -> mock.MagicMock:
    s = mock.create_autospec(Session, instance=True)
    s.identity = "rank/0/0"
    s.standalone = False
    s.interrupted = False
    s.info = _info(1)
    s.client = None
    s.device_type = "cpu"
    s.take_prepared.return_value = None  # a rank: no spare's buffers allocated ahead
    s.comms = mock.create_autospec(Comms, instance=True)
    s.comms.aborted = False
    s.interrupt_time.return_value = None
    return s


class Restores:
    """Stands in for the restore protocol: each call restores ``step`` (or raises)."""

    def __init__(self, job: ProtectedJob, *outcomes: int | BaseException) -> None:
        self.job, self.outcomes, self.generations = job, list(outcomes), []

    def __call__(self, info: GenerationInfo, rec) -> None:
        self.generations.append(info.generation)
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        self.job.step_done = outcome
        self.job.recoveries.append(rec)


def _job(
    session, *restores: int | BaseException, config: RecoveryConfig | None = None
) -> tuple[ProtectedJob, Restores]:
    job = ProtectedJob(session, lambda: None, config=config, max_steps=4)
    job._fresh_start = mock.Mock(name="fresh_start")
    job._finish_step = lambda step: setattr(job, "step_done", step)
    restore = Restores(job, *restores)
    job._restore_into = restore
    job._shutdown = mock.Mock(name="shutdown", wraps=job._shutdown)
    return job, restore


def _train(job: ProtectedJob, fail: dict[int, BaseException]) -> list[int]:
    """Run the loop; ``fail[step]`` is raised inside that step's guard (once)."""
    steps = []
    with job:
        for step, _ in job:
            steps.append(step)
            with job.step():
                if step in fail:
                    raise fail.pop(step)
    return steps


def test_a_fault_in_a_step_recovers_into_the_next_generation_and_rewinds(session):
    session.next_generation.return_value = _info(2)
    job, restore = _job(session, 1)
    steps = _train(job, {3: RuntimeError(GLOO_PEER_CLOSED)})
    assert steps == [1, 2, 3, 2, 3, 4]  # restored to step 1: steps 2 and 3 are done again
    session.comms.abort.assert_called_once()  # the old generation's groups were broken
    session.next_generation.assert_called_once_with(job.config.fault_wait_s, after=0)
    session.join.assert_called_once_with(_info_of(session))
    assert restore.generations == [2]
    (rec,) = job.recoveries
    assert rec.generation == 2 and rec.step_reached == 2


class BroadcastingLoader:
    """A loader with collectives of its own (rank 0 reads, the others receive): the one whose
    ``next_batch`` is the n-th meets ``error`` there."""

    def __init__(self, fail_at: int, error: BaseException) -> None:
        self.calls, self.fail_at, self.error = 0, fail_at, error

    def next_batch(self) -> int:
        self.calls += 1
        if self.calls == self.fail_at:
            raise self.error
        return self.calls

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def set_world(self, world_size: int, rank: int) -> None:
        pass


def test_a_fault_in_the_loaders_own_collective_recovers_and_fetches_again(session):
    session.next_generation.return_value = _info(2)
    job, restore = _job(session, 1)
    job.loader = BroadcastingLoader(3, RuntimeError(GLOO_PEER_CLOSED))
    steps = _train(job, {})
    # Step 3's batch was being made: restored to step 1, the loader is asked for step 2's.
    assert steps == [1, 2, 2, 3, 4] and restore.generations == [2]
    session.comms.abort.assert_called_once()
    (rec,) = job.recoveries
    assert rec.step_reached == 2


def test_a_loaders_own_error_is_not_taken_for_a_fault(session):
    job, _ = _job(session)
    job.loader = BroadcastingLoader(2, ValueError("sample 17 is corrupt"))
    with pytest.raises(ValueError, match="sample 17 is corrupt"):
        _train(job, {})
    session.next_generation.assert_not_called()
    job._shutdown.assert_called()


def _info_of(session) -> GenerationInfo:
    return session.next_generation.return_value


def test_a_user_error_is_not_taken_for_a_fault(session):
    job, _ = _job(session)
    with pytest.raises(RuntimeError, match="my bug"):
        _train(job, {2: RuntimeError("my bug: Socket Timed out")})
    session.next_generation.assert_not_called()
    session.comms.abort.assert_not_called()
    job._shutdown.assert_called()


def test_any_error_while_the_generation_is_aborted_is_a_fault(session):
    session.next_generation.return_value = _info(2)
    session.comms.aborted = True  # the client thread aborted the groups: whatever broke is that
    job, _ = _job(session, 1)
    assert _train(job, {2: ValueError("a tensor of an aborted group")}) == [1, 2, 2, 3, 4]


def test_a_generation_between_steps_is_recovered_into_before_the_next(session):
    session.next_generation.return_value = _info(2)
    job, restore = _job(session, 2)
    with job:
        assert next(job)[0] == 1
        with job.step():
            pass
        session.interrupted = True
        session.next_generation.side_effect = lambda *a, **k: _interrupt_served(session)
        assert next(job)[0] == 3
    assert restore.generations == [2]


def _interrupt_served(session) -> GenerationInfo:
    session.interrupted = False
    return _info(2)


def test_a_fault_during_a_recovery_waits_for_the_generation_after(session):
    session.next_generation.side_effect = [_info(2), _info(3)]
    job, restore = _job(session, RuntimeError(GLOO_PEER_CLOSED), 1)
    assert _train(job, {2: RuntimeError(GLOO_PEER_CLOSED)}) == [1, 2, 2, 3, 4]
    assert restore.generations == [2, 3]
    assert session.next_generation.call_args_list[1] == mock.call(job.config.fault_wait_s, after=2)
    assert session.comms.abort.call_count == 2
    session.event.assert_any_call("recovery_abandoned", generation=2, reason=mock.ANY)


def test_a_copy_lost_during_a_recovery_waits_for_the_generation_after(session):
    session.next_generation.side_effect = [_info(2), _info(3)]
    job, restore = _job(session, NoSurvivingCopy("rank 1 has no copy"), 1)
    _train(job, {2: RuntimeError(GLOO_PEER_CLOSED)})
    assert restore.generations == [2, 3]


def test_a_process_with_no_place_in_the_new_generation_is_given_back(session):
    session.next_generation.return_value = _info(2)
    session.join.side_effect = NotAMember("no rank for rank/0/0")
    job, _ = _job(session)
    with pytest.raises(GivenBack) as e:
        _train(job, {2: RuntimeError(GLOO_PEER_CLOSED)})
    assert exit_code_of(e.value) == 0
    job._shutdown.assert_called()


def test_no_generation_in_time_reports_this_rank_failed(session):
    session.next_generation.side_effect = TimeoutError("no generation within 30 s")
    job, _ = _job(session)
    with pytest.raises(RecoveryFailed, match="no generation within 30 s"):
        _train(job, {2: RuntimeError(GLOO_PEER_CLOSED)})
    session.report_failure.assert_called_once_with(mock.ANY, fatal=False)


def test_a_job_the_coordinator_ended_leaves_with_its_code(session):
    session.next_generation.side_effect = JobEnded(3, "stopped by the user")
    job, _ = _job(session)
    with pytest.raises(JobEnded) as e:
        _train(job, {2: RuntimeError(GLOO_PEER_CLOSED)})
    assert exit_code_of(e.value) == 3


def test_no_coordinator_left_during_a_recovery_ends_naming_the_last_checkpoint(session, tmp_path):
    session.next_generation.side_effect = CoordinatorsLost(["10.0.0.1:29400", "10.0.0.2:29400"])
    session.client = mock.create_autospec(ControlClient, instance=True)
    job, _ = _job(session)
    job.config = RecoveryConfig(emergency_checkpoint_root=str(tmp_path))
    with pytest.raises(RecoveryFailed) as e:
        _train(job, {2: RuntimeError(GLOO_PEER_CLOSED)})
    assert exit_code_of(e.value) == 1
    assert str(e.value).startswith("no coordinator is left (10.0.0.1:29400, 10.0.0.2:29400): ")
    assert "could not agree on a step to stop at" in str(e.value)
    assert f"there is no complete checkpoint in {tmp_path}" in str(e.value)
    (reason,) = session.client.report_no_checkpoint.call_args.args
    assert reason in str(e.value)
    job._shutdown.assert_called()


def test_once_no_coordinator_is_left_every_round_asks_to_stop_and_no_generation_comes():
    session = Session(None, timeout_s=5.0, device_type="cpu")
    session.info = _info(3)
    assert session.pending_graceful() == 0 and session.coordinators_lost is None
    session._on_coordinators_lost({"addresses": ["10.0.0.1:29400"], "silent_s": 30.0})
    # Above any generation, so the round's agreement (a maximum) is a stop on every rank.
    assert session.pending_graceful() == STOP_SIGNAL > 1 << 32
    assert session.coordinators_lost == ["10.0.0.1:29400"]
    assert not session.interrupted  # training goes on to the step the ranks agree on
    session.client = mock.create_autospec(ControlClient, instance=True)
    with pytest.raises(CoordinatorsLost, match=r"no coordinator is left \(10.0.0.1:29400\)"):
        session.next_generation(60.0)


def test_a_configuration_error_at_the_start_ends_the_whole_job(session):
    job, _ = _job(session)
    job._fresh_start.side_effect = ConfigurationError("k=3 needs 4 ranks")
    with pytest.raises(ConfigurationError):
        job.__enter__()
    session.report_failure.assert_called_once_with("k=3 needs 4 ranks", fatal=True)
    job._shutdown.assert_called()


def test_a_stateful_object_a_snapshot_cannot_carry_ends_the_job_before_it_starts(session):
    class Ema:
        def state_dict(self) -> dict:
            return {"shadow": torch.zeros(3)}

        def load_state_dict(self, state: dict) -> None:
            raise AssertionError("never loaded")

    job = ProtectedJob(session, lambda: None, max_steps=4, stateful={"ema": Ema()})
    job._fresh_start = mock.Mock(name="fresh_start")
    with pytest.raises(ConfigurationError):
        job.__enter__()
    (message,), kw = session.report_failure.call_args
    assert "stateful={'ema': ...}" in message and kw == {"fatal": True}
    job._fresh_start.assert_not_called()


def test_a_fault_outside_the_steps_guards_ends_this_rank_in_one_line(session, caplog):
    # A logging all_reduce after the guard met a lost peer: the loop cannot be resumed.
    job, _ = _job(session)
    with pytest.raises(SystemExit) as e, api._EntryPoint(job):
        for step, _ in job:
            with job.step():
                pass
            if step == 2:
                raise RuntimeError(GLOO_PEER_CLOSED)
    assert e.value.code == 1
    assert "outside `with job.step():` after step 2" in caplog.text
    assert "inside the step's `with job.step():`" in caplog.text
    session.next_generation.assert_not_called()
    job._shutdown.assert_called()

    # The user's own error outside a guard stands, as inside one.
    job, _ = _job(session)
    with pytest.raises(ValueError, match="bad metric"), api._EntryPoint(job):
        for _step, _ in job:
            with job.step():
                pass
            raise ValueError("bad metric")


def test_a_mistake_found_in_a_step_ends_the_whole_job_with_its_message(session):
    # e.g. a loop training with the model a recovery replaced (recovery/retired.py).
    job, _ = _job(session)
    with pytest.raises(SystemExit) as e, api._EntryPoint(job):
        for step, _ in job:
            with job.step():
                if step == 3:
                    raise ConfigurationError("train through job.model")
    assert e.value.code == 2
    session.report_failure.assert_called_once_with("train through job.model", fatal=True)
    session.next_generation.assert_not_called()
    job._shutdown.assert_called()


def test_a_loader_the_engine_cannot_rewind_is_refused_with_the_way_out(session):
    dataloader = torch.utils.data.DataLoader(list(range(8)), batch_size=2)
    with pytest.raises(TypeError) as e:
        ProtectedJob(session, lambda: None, loader=dataloader)
    message = str(e.value)
    assert "a DataLoader has no next_batch, state_dict, load_state_dict, set_world" in message
    assert "DatasetLoader(dataset, global_batch=" in message and "DataLoader's .dataset" in message


def test_a_standalone_job_lets_every_error_stand(session):
    session.standalone = True
    job, _ = _job(session)
    with pytest.raises(RuntimeError, match="Connection closed"):
        _train(job, {2: RuntimeError(GLOO_PEER_CLOSED)})
    session.next_generation.assert_not_called()


def test_the_entry_point_turns_endings_into_exit_codes_and_nothing_else(session):
    session.next_generation.return_value = _info(2)
    session.join.side_effect = NotAMember("given back")
    job, _ = _job(session)
    with pytest.raises(SystemExit) as e, api._EntryPoint(job) as entered:
        assert entered is job
        for step, _ in job:
            with job.step():
                if step == 2:
                    raise RuntimeError(GLOO_PEER_CLOSED)
    assert e.value.code == 0

    job, _ = _job(session)
    job._fresh_start.side_effect = ConfigurationError("bad")
    with pytest.raises(SystemExit) as e, api._EntryPoint(job):
        pass
    assert e.value.code == 2

    job, _ = _job(session)  # the user's own error is not an ending: it stands
    with pytest.raises(KeyError), api._EntryPoint(job):
        raise KeyError("mine")


def test_a_step_outside_the_loop_is_one_clear_error(session):
    job, _ = _job(session)
    with job:
        with pytest.raises(RuntimeError, match="belongs inside"), job.step():
            pass
        next(job)
        with pytest.raises(RuntimeError, match="was not run inside"):
            next(job)


# -- the pieces the job is made of ------------------------------------------------------------


def test_the_restore_source_is_peers_then_checkpoint_then_initial_else_a_clear_failure(caplog):
    from p2p_state.snapshot import Copy
    from recovery.source import RestoreSource, choose_restore_source

    complete = [{Copy(2, 0, 4, True), Copy(2, 1, 4, False)}, {Copy(2, 1, 4, True)}]
    lost = [{Copy(2, 0, 4, True)}, set()]  # rank 1's shard has no copy left
    initial = [{Copy(2, 0, 0, True)}, set()]
    asked: list[str] = []

    def steps(root: str) -> list[int]:
        asked.append(root)
        return [2] if root == "/ckpt" else []

    def choose(held, root):
        return choose_restore_source(held, 2, checkpoint_root=root, checkpoint_steps=steps)

    assert choose(complete, "/ckpt") is RestoreSource.PEERS
    assert asked == []  # the checkpoint directory is listed only when the peers fall short
    assert choose(lost, "/ckpt") is RestoreSource.CHECKPOINT
    assert choose(initial, None) is RestoreSource.INITIAL
    with pytest.raises(RecoveryFailed, match=r"ranks \[1\].*RecoveryConfig.checkpoint is not set"):
        choose(lost, None)
    # Checkpoints asked for but the first not complete yet: the initial state is the oldest
    # checkpoint there is (every step so far is redone, as a restart would).
    with caplog.at_level(logging.WARNING, logger="recovery.source"):
        assert choose(lost, "/empty") is RestoreSource.INITIAL
    assert "ranks [1]" in caplog.text and "no checkpoint under '/empty' is complete" in caplog.text


class FakeStore:
    """A replicator as the stores see it: copies, memory given back, a commit."""

    def __init__(self, committed_step: int = -1) -> None:
        self.committed_step = committed_step
        self.given: list[set[int]] = []
        self.abandoned: list[float] = []

    def give_back(self, pool, keep=()) -> int:
        self.given.append(set(keep))
        return 100

    def abandon(self, timeout_s: float = 10.0) -> bool:
        self.abandoned.append(timeout_s)
        return True


def test_old_generations_give_back_all_but_the_restored_step_then_the_rest_once_it_committed():
    from recovery.stores import GenerationStores

    stores = GenerationStores()
    old, new = FakeStore(), FakeStore(committed_step=3)
    stores.add(old, restored_step=0)
    stores.abandon(0.05)
    assert old.abandoned == [0.05]
    pool = stores.recycle_for(5)
    assert old.given == [{5, -1}]  # the copies of the restored step stay: the fallback
    stores.add(new, restored_step=5)
    assert stores.all == [new, old] and stores.has_old
    assert stores.release_old() is None  # the new copy of step 5 is not committed yet
    new.committed_step = 5
    assert stores.release_old() == (100, pool.reused_bytes, pool.lent_bytes)
    assert old.given == [{5, -1}, set()] and stores.all == [new] and not stores.has_old


def test_a_survivors_restore_receives_into_memory_its_old_stores_give_back(session, monkeypatch):
    import torch

    from p2p_state.memory import MemoryKind
    from recovery import replication
    from recovery.hooks import JobHooks

    class Old(FakeStore):  # an abandoned replicator: a copy of step 5 and a slot of step 4
        def give_back(self, pool, keep=()) -> int:
            self.given.append(set(keep))
            if len(self.given) > 1:
                return 0
            pool.put(MemoryKind.HOST, torch.full((4096,), 9, dtype=torch.uint8))
            return 4096

    cpu = torch.device("cpu")
    monkeypatch.setattr(replication, "state_device", lambda state: cpu)
    monkeypatch.setattr(replication, "snapshot_device", lambda config, state: cpu)
    copies = replication.JobReplication(session, RecoveryConfig(), JobHooks())
    assert copies.receive_buffer(mock.Mock()) is None  # nothing held: a new buffer
    old = Old()
    copies.stores.add(old, restored_step=3)
    copies.break_off()
    lend = copies.receive_buffer(mock.Mock())
    assert lend is not None and old.given == []  # nothing given back before the plan's step
    with lend(4000, 5) as target:
        # Every buffer but the copies of the step restored and of the last committed one,
        # which the restore and a fault before the next commit read: the step 4 slot.
        assert old.given == [{5, -1}] and target.numel() == 4000
        target.fill_(1)
    # Given back whole for the new replicator's first slot, which recycle_for hands it.
    pool = copies.stores.recycle_for(5)
    assert (pool.lent_bytes, pool.fresh_bytes, pool.free_bytes) == (4000, 0, 4096)
    assert pool.take(4096, MemoryKind.HOST, cpu).numel() == 4096 and pool.reused_bytes == 4096


def test_a_user_error_during_a_recovery_shuts_the_job_down(session):
    session.next_generation.return_value = _info(2)
    job, _ = _job(session, TypeError("the factory returned a list"))
    with pytest.raises(TypeError, match="factory"):
        job._recover(RuntimeError(GLOO_PEER_CLOSED))  # as from __enter__, outside any `with`
    job._shutdown.assert_called()


def test_the_first_step_after_a_recovery_is_reported_once(session):
    from recovery.records import RecoveryLog, RecoveryRecord
    from recovery.source import RestoreSource

    log = RecoveryLog(session)
    log.step_done(1, rank=0)
    assert session.event.call_args_list == [mock.call("step_done", step=1)]
    rec = RecoveryRecord(2, "a fault", started_t=time.monotonic())
    log.done(rec, _info(2), RestoreSource.PEERS, 1)
    assert log.records == [rec] and (rec.source, rec.step) == (RestoreSource.PEERS, 1)
    session.event.reset_mock()
    log.step_done(2, rank=1)
    log.step_done(3, rank=1)
    (first,) = session.event.call_args_list  # rank 1 reports no step_done; only one first step
    assert first.args == ("first_step_done",) and first.kwargs["step"] == 2


def test_a_lost_shard_with_no_checkpoint_is_reported_fatal_before_it_is_raised(session):
    from p2p_state.snapshot import Copy
    from recovery.config import RecoveryConfig
    from recovery.hooks import JobHooks
    from recovery.rebuild import Census, Rebuilder
    from recovery.replication import JobReplication
    from recovery.source import RestoreSource

    config = RecoveryConfig()
    hooks = JobHooks()
    rebuild = Rebuilder(
        session, config, lambda: None, JobReplication(session, config, hooks), hooks
    )
    complete = Census([{Copy(2, 0, 2, True)}, {Copy(2, 1, 2, True)}], mock.Mock(), mock.Mock())
    assert rebuild.source(complete, 2) is RestoreSource.PEERS
    session.report_failure.assert_not_called()
    lost = Census([{Copy(2, 0, 2, True)}, set()], mock.Mock(), mock.Mock())
    with pytest.raises(RecoveryFailed, match=r"ranks \[1\]"):
        rebuild.source(lost, 2)
    session.report_failure.assert_called_once_with(mock.ANY, fatal=True)


def test_a_fault_waits_for_no_replication_worker_and_those_still_busy_are_counted_later(
    session, monkeypatch
):
    from recovery import replication
    from recovery.hooks import JobHooks

    class Store:  # an abandoned replicator whose worker leaves its round, or does not
        def __init__(self, busy: bool) -> None:
            self.busy, self.waits = busy, []

        def abandon(self, wait_s: float) -> bool:
            self.waits.append(wait_s)
            return not self.busy

        def left_behind(self) -> bool:
            return self.busy

    copies = replication.JobReplication(session, RecoveryConfig(), JobHooks())
    stopped, stuck = Store(False), Store(True)
    copies.stores.add(stopped, 1)
    copies.stores.add(stuck, 2)
    copies.break_off()
    assert stopped.waits == stuck.waits == [0.0]  # told to stop, not waited for
    session.event.assert_not_called()
    # The next replicator counts the workers still in a round when it is made.
    made = []
    monkeypatch.setattr(replication.dist, "get_world_size", lambda: 4)
    monkeypatch.setattr(copies, "replication_group", lambda: None)
    monkeypatch.setattr(copies.stores, "recycle_for", lambda step: "pool")
    monkeypatch.setattr(replication, "Replicator", lambda *a, **kw: made.append(kw) or mock.Mock())
    copies.start(mock.Mock(), 2, {}, recovering=True)
    session.event.assert_called_once_with("replication_workers_left_behind", workers=1)
    assert made[0]["recycle"] == "pool"


def test_a_survivors_interrupt_runs_until_it_has_left_the_step_and_broken_its_groups():
    from recovery import phases
    from recovery.records import RecoveryRecord

    def record(**t: float) -> dict[str, float]:
        rec = RecoveryRecord.after_fault(2, "fault", step_reached=5, **t)
        return {p: round(rec.phases[p], 3) for p in (phases.INTERRUPT, phases.WAIT)}

    # The coordinator's word first: from it to the groups broken; the generation was there.
    word_first = record(interrupted_t=10.0, caught_t=10.02, left_t=10.03, generation_t=10.0)
    assert word_first == {"interrupt": 0.03, "wait": 0.0}
    # A collective failed first: breaking the groups, then waiting for the coordinator.
    failed_first = record(interrupted_t=10.5, caught_t=10.0, left_t=10.01, generation_t=10.5)
    assert failed_first == {"interrupt": 0.01, "wait": 0.49}


@pytest.mark.parametrize("graceful", [False, True])
def test_a_spare_records_its_join_of_a_recovery_as_communicators(session, graceful):
    from recovery import phases

    info = dataclasses.replace(_info(3), graceful=graceful)
    session.info, session.joined_t = info, info.arrived_t + 0.25
    job, restore = _job(session, 5)
    with job:
        pass
    assert restore.generations == [3]  # it entered the generation's restore protocol
    (rec,) = job.recoveries
    # A graceful generation is joined when its members switch: no time of the spare's. What
    # counts either way is the forming of the generation's other groups (instant here).
    joined = 0.0 if graceful else 0.25
    assert rec.phases[phases.COMMUNICATORS] == pytest.approx(joined, abs=0.05)


@pytest.mark.parametrize("joined_as", ["survivor", "spare"])
def test_every_group_of_a_new_generation_is_formed_in_its_communicators_phase(
    session, tmp_path, joined_as
):
    from recovery import phases
    from recovery.checkpoint import CheckpointConfig

    log = []
    session.join.side_effect = lambda info: log.append("join")
    session.comms.group.side_effect = lambda name, backend: log.append(f"{name}/{backend}")
    if joined_as == "spare":  # it joined before it made the job
        session.info = _info(2)
        session.joined_t = session.info.arrived_t
    else:
        session.next_generation.return_value = _info(2)
    job, _ = _job(session, config=RecoveryConfig(checkpoint=CheckpointConfig(root=str(tmp_path))))
    job._restore_into = lambda info, rec: log.append("restore")
    job.add_hook(lambda point, **info: point == "recovery_phase" and log.append(info["phase"]))
    _train(job, {2: RuntimeError(GLOO_PEER_CLOSED)} if joined_as == "survivor" else {})
    # One order on every member (creating a group is collective), all before the restore.
    groups = ["replication/gloo", "checkpoint/gloo"]
    joins = ["join"] if joined_as == "survivor" else []
    assert log == [phases.COMMUNICATORS, *joins, *groups, "restore"]
