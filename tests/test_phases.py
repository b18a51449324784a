"""Phase timings from event logs: pure functions, synthetic logs."""

from __future__ import annotations

import pytest

from bench.phases import (
    CoordinatorFault,
    FaultRow,
    RestartedFault,
    SilentFault,
    UnmeasuredFault,
    as_json,
    checkpointless_faults,
    merged_downtime,
    not_fired,
    restart_faults,
    row_from_json,
    step_reached,
    timeline,
)


def _ev(t, event, **fields):
    return {"t": t, "event": event, **fields}


def engine_log(restored: int):
    steps = [_ev(10.0 + s, "step_done", step=s) for s in range(1, 6)]
    phases = {
        "interrupt": 0.01,
        "wait": 0.0,
        "communicators": 0.02,
        "plan": 0.05,
        "build": 0.1,
        "transfer": 0.04,
        "restore": 0.03,
        "data": 0.0,
        "replicate": 0.05,
    }
    # The survivors left the step in 10, 30 and 20 ms; the spare (rank 1) was never in it.
    spare = {p: v for p, v in phases.items() if p not in ("interrupt", "wait")}
    done = [
        _ev(
            15.45,
            "recovery_done",
            generation=2,
            rank=r,
            step=restored,
            phases={**phases, "interrupt": out},
            bytes_received=100 * (r == 1),
            restored_from="peers",
        )
        for r, out in ((0, 0.01), (2, 0.03), (3, 0.02))
    ] + [
        _ev(
            15.5,
            "recovery_done",
            generation=2,
            rank=1,
            step=restored,
            phases=spare,
            bytes_received=100,
            restored_from="peers",
        )
    ]
    after = [_ev(16.0 + s - restored, "step_done", step=s) for s in range(restored + 1, 9)]
    return [
        *steps,
        _ev(15.2, "fault_injected", fault="kill:rank=1@step=6:phase=forward"),
        _ev(15.23, "fault"),
        _ev(15.231, "generation_started", generation=2),
        *done,
        _ev(15.9, "first_step_done", generation=2),
        *after,
    ]


def test_checkpointless_phases_add_up_to_the_downtime():
    (f,) = checkpointless_faults(engine_log(restored=5))
    assert f.step_reached == 5 and f.step_restored == 5 and f.steps_lost == 0
    assert f.phases["detect"] == pytest.approx(0.03)
    assert sum(f.phases.values()) == pytest.approx(f.downtime_s)
    assert f.downtime_s == pytest.approx(0.3)  # back at step 5 when the last rank restored
    assert f.recovery_s == pytest.approx(0.7)
    assert list(f.phases)[:2] == ["detect", "interrupt"] and "recompute" not in f.phases
    assert f.bytes_received == 100  # only the spare received
    assert f.slowest_survivor_out_s == pytest.approx(0.03)
    # The report's row: one key per field, in the order the reports have always had.
    assert list(as_json([f])[0]) == [
        "spec",
        "t_fault",
        "generation",
        "step_reached",
        "step_restored",
        "steps_lost",
        "restored_from",
        "phases",
        "downtime_s",
        "recovery_s",
        "bytes_received",
        "slowest_survivor_out_s",
    ]


def test_an_older_restored_step_is_recomputed_before_the_downtime_ends():
    (f,) = checkpointless_faults(engine_log(restored=3))
    assert f.steps_lost == 2
    assert f.phases["recompute"] == pytest.approx(16.0 + 5 - 3 - 15.5)
    assert sum(f.phases.values()) == pytest.approx(f.downtime_s)


def test_a_silent_fault_has_no_recovery():
    events = [_ev(1.0, "step_done", step=1), _ev(1.5, "fault_injected", fault="bitflip:rank=1")]
    (f,) = checkpointless_faults(events)
    assert isinstance(f, SilentFault) and as_json([f]) == [
        {"spec": "bitflip:rank=1", "t_fault": 1.5, "silent": True}
    ]


def test_restart_phases_follow_the_new_attempt():
    marks = [_ev(1.0 + s, "step_done", step=s, rank=0) for s in range(1, 7)]
    marks += (
        [_ev(30.0, "started", rank=r) for r in range(4)]
        + [_ev(32.0 + r * 0.1, "imported", rank=r) for r in range(4)]
        + [_ev(32.5, "communicators", rank=r) for r in range(4)]
        + [_ev(33.0, "model_built", rank=r) for r in range(4)]
        + [_ev(34.0, "checkpoint_loaded", rank=r, step=5) for r in range(4)]
        + [_ev(34.1, "data_ready", rank=r, step=6) for r in range(4)]
    )
    marks += [_ev(34.5, "step_done", step=6, rank=0), _ev(35.0, "step_done", step=7, rank=0)]
    (f,) = restart_faults(marks, [("kill:rank=2@step=8", 7.5)])
    assert f.step_reached == 6 and f.step_restored == 5 and f.steps_lost == 1
    assert f.phases["terminate"] == pytest.approx(22.5)
    assert f.phases["restart processes"] == pytest.approx(2.3)
    assert f.phases["recompute"] == pytest.approx(0.4)
    assert sum(f.phases.values()) == pytest.approx(f.downtime_s) == pytest.approx(27.0)


def test_step_reached_and_timeline():
    steps = [(1.0, 1), (2.0, 2), (3.0, 3)]
    assert step_reached(steps, 2.5) == 2 and step_reached(steps, 0.5) == 0
    events = [_ev(t, "step_done", step=s) for t, s in steps]
    assert timeline(events, 1.0) == [(0.0, 1), (1.0, 2), (2.0, 3)]


def test_a_step_finished_by_other_ranks_after_the_fault_counts_as_lost():
    # Rank 0 finished step 5 before the fault; rank 2 finished step 6 a few ms after it, before
    # the fault was detected: restored at 5, step 6 is done again.
    events = engine_log(restored=5)
    for e in events:
        if e["event"] == "recovery_done":
            e["step_reached"] = 6 if e["rank"] == 2 else 5
    (f,) = checkpointless_faults(events)
    assert f.step_reached == 6 and f.steps_lost == 1
    # Training is back only once step 6 is done again.
    assert f.phases["recompute"] == pytest.approx(16.0 + 6 - 5 - 15.5)
    assert sum(f.phases.values()) == pytest.approx(f.downtime_s)
    # Without the ranks' reports, only rank 0's view is left (the count the check can miss).
    for e in events:
        e.pop("step_reached", None)
    (g,) = checkpointless_faults(events)
    assert g.steps_lost == 0


def _restarted(spec: str, t_fault: float, downtime_s: float) -> RestartedFault:
    return RestartedFault(
        spec, t_fault, 4, 3, 1, "checkpoint", {"terminate": downtime_s}, downtime_s
    )


def test_overlapping_downtimes_are_counted_once():
    faults: list[FaultRow] = [
        _restarted("a", 1.0, 0.4),
        _restarted("b", 1.1, 0.34),  # during a's recovery
        _restarted("c", 3.0, 0.5),
        _restarted("d", 3.1, 0.1),  # inside c's
        SilentFault("e", 2.0),
    ]
    assert merged_downtime(faults) == pytest.approx(0.44 + 0.5)
    assert merged_downtime(faults[2:3]) == pytest.approx(0.5)
    assert merged_downtime([*faults, UnmeasuredFault("f", 9.0, "no recovery after it")]) is None
    assert merged_downtime([faults[-1]]) is None
    assert merged_downtime([]) is None


def test_a_shard_with_no_copy_left_is_named_in_its_row_only_then():
    (f,) = checkpointless_faults(engine_log(restored=5))
    assert "every_copy_lost" not in as_json([f])[0]
    f.every_copy_lost = "by design"
    assert list(as_json([f])[0])[-2:] == ["every_copy_lost", "slowest_survivor_out_s"]
    f.slowest_survivor_out_s = None  # no survivor (every rank was replaced)
    assert list(as_json([f])[0])[-2:] == ["bytes_received", "every_copy_lost"]


def test_every_kind_of_row_reads_back_from_its_json():
    (recovered,) = checkpointless_faults(engine_log(restored=3))
    recovered.every_copy_lost = "by design"
    rows: list[FaultRow] = [
        recovered,
        _restarted("kill:rank=2@step=8", 7.5, 27.0),
        CoordinatorFault("kill-coordinator@step=4", 3.0, 1.2, 3, None),
        SilentFault("bitflip:rank=1", 1.5),
        UnmeasuredFault("hang:rank=0@step=9", 9.0, "no recovery after it"),
    ]
    back = [row_from_json(doc) for doc in as_json(rows)]
    assert back == rows and [type(r) for r in back] == [type(r) for r in rows]


def test_faults_that_never_fired_are_named():
    events = [
        _ev(1.0, "fault_injected", fault="kill:rank=1@step=3:phase=forward"),
        _ev(1.0, "fault_injected", fault="kill-buddies:rank=1@step=5:phase=forward"),
        _ev(1.0, "fault_injected", fault="kill-buddies:rank=1@step=5:phase=forward"),
    ]
    scheduled = [
        "kill:rank=1@step=3:phase=forward",
        "kill-buddies:rank=1@step=5:phase=forward",
        "during-recovery:rank=2@recovery=1:phase=transfer",
    ]
    assert not_fired(scheduled, events) == ["during-recovery:rank=2@recovery=1:phase=transfer"]
    assert not_fired(scheduled[:2], events) == []


def test_a_phase_a_rank_reports_beyond_the_known_ones_is_not_counted_as_interrupt():
    def log(extra: dict) -> list:
        events = engine_log(restored=5)
        for e in events:
            if e["event"] == "recovery_done":
                e["phases"] = {**e["phases"], **extra}
                e["t"] += 0.4  # room for an interrupt before the rank's phases
        return events

    (f,) = checkpointless_faults(log({"checkpoint": 0.1}))
    (g,) = checkpointless_faults(log({}))
    assert f.phases["checkpoint"] == pytest.approx(0.1)
    assert list(f.phases)[-1] == "checkpoint" and "checkpoint" not in g.phases
    assert f.phases["interrupt"] == pytest.approx(g.phases["interrupt"] - 0.1)
    assert sum(f.phases.values()) == pytest.approx(f.downtime_s)


def test_a_coordinator_fault_leaves_out_the_steps_of_another_faults_recovery():
    # Two ranks stepping every 0.1 s; the coordinator dies at 10.05 and its standby takes
    # over at 11.0; rank 1 is killed at 10.42 and the job is back at 10.9 (one 0.5 s step).
    steps = []
    for source in ("rank/0/1", "rank/1/1"):
        ends = [9.0 + 0.1 * i for i in range(15)] + [10.9 + 0.1 * i for i in range(5)]
        steps += [_ev(t, "step_done", step=i, source=source) for i, t in enumerate(ends)]
    log = [
        *steps,
        _ev(10.05, "fault_injected", fault="kill-coordinator@step=11"),
        _ev(10.42, "fault_injected", fault="kill:rank=1@step=15:phase=forward"),
        _ev(10.45, "fault"),
        _ev(10.8, "recovery_done", generation=2, rank=0, step=14, phases={}),
        _ev(10.8, "recovery_done", generation=2, rank=1, step=14, phases={}),
        _ev(10.9, "first_step_done", generation=2),
        _ev(11.0, "takeover", term=1),
    ]
    coordinator, rank = checkpointless_faults(log)
    assert coordinator.takeover_s == pytest.approx(0.95)
    # Without the rank's recovery, the slowest step is the ordinary 0.1 s one.
    assert coordinator.slowest_step_ratio == pytest.approx(1.0)
    assert rank.restored_from is None and rank.steps_lost == 0
