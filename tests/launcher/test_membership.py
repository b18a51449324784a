"""The membership state machine, without sockets: every decision from plain events."""

from __future__ import annotations

import pytest

from launcher.decisions import body_maps
from launcher.membership import (
    End,
    Event,
    Interrupt,
    Kill,
    Membership,
    MembershipConfig,
    Process,
    SendGeneration,
    SpawnSpare,
)


def names(actions):
    return [a.name for a in actions if isinstance(a, Event)]


def of(actions, kind):
    return [a for a in actions if isinstance(a, kind)]


def job(spares=1, world=4, rpn=2, **kw):
    """A job of ``world`` ranks on nodes of ``rpn`` with agents, ranks and spares joined."""
    m = Membership(MembershipConfig(world_size=world, ranks_per_node=rpn, **kw))
    out = []
    for node in range(world // rpn):
        out += m.hello(Process(f"agent/{node}", "agent", node, 100 + node), None, 0.0)
    for r in range(world):
        out += m.hello(Process(f"rank/{r}", "rank", r // rpn, 1000 + r), r, 0.0)
    for s in range(spares):
        out += m.hello(Process(f"spare/{s}", "spare", s % (world // rpn), 2000 + s), None, 0.0)
    return m, out


def ack_all(m, now=0.1):
    out = []
    for identity in m.pending.ranks.values():
        out += m.ack(identity, m.pending.generation, now)
    return out


def test_first_generation_starts_when_every_rank_joined():
    m, out = job(spares=0)
    sends = of(out, SendGeneration)
    assert len(sends) == 1 and sends[0].generation.generation == 1
    assert sends[0].generation.ranks == {r: f"rank/{r}" for r in range(4)}
    assert sends[0].generation.nodes == {0: 0, 1: 0, 2: 1, 3: 1}
    assert "generation_complete" in names(ack_all(m))


def test_a_generation_that_takes_a_quarter_of_the_ack_deadline_to_form_is_reported():
    m, _ = job(spares=1, ack_timeout_s=10.0)
    (done,) = [a for a in ack_all(m, 0.5) if isinstance(a, Event)]
    assert done == Event("generation_complete", {"generation": 1, "formed_s": 0.5})
    m.exited("rank/1", -9, 10.0)
    slow = [a.fields for a in ack_all(m, 13.0) if a.name == "slow_formation"]
    assert slow == [
        {"generation": 2, "formed_s": 3.0, "ack_timeout_s": 10.0, "advised_ack_timeout_s": 12}
    ]


def test_the_error_a_process_recorded_ends_the_reason_for_its_loss():
    m, _ = job(spares=1)
    ack_all(m)
    out = m.exited("rank/1", 1, 1.0, error="ValueError: bad lr")
    (fault,) = [a.fields for a in out if isinstance(a, Event) and a.name == "fault"]
    assert fault["reason"] == "exited with code 1 (ValueError: bad lr)"
    # A script without the engine cannot be recovered: the job ends, saying why it failed.
    m = Membership(MembershipConfig(world_size=1, ranks_per_node=1))
    (end,) = of(m.exited("rank/0/1", 1, 1.0, rank=0, error="KeyError: 'lr'"), End)
    assert "exited with code 1 (KeyError: 'lr') and does not use the engine" in end.reason


def test_a_crash_hands_the_rank_to_a_spare_in_one_message():
    m, _ = job(spares=1)
    ack_all(m)
    for r in range(4):
        m.report_replicated(f"rank/{r}", 7)
    out = m.exited("rank/1", -9, 1.0)
    assert "spare_assigned" in names(out)
    (send,) = of(out, SendGeneration)
    g = send.generation
    assert g.generation == 2 and g.ranks[1] == "spare/0" and g.lost == [1]
    assert g.replaced == {1: ["rank/1", "spare/0"]} and g.committed_step == 7
    assert g.holders == {0: [2], 1: [3], 2: [1], 3: [0]}, "the replica map: ring across nodes"
    body = g.to_body(full=False)
    # Every rank computes the replica map from the node map, so it is not sent.
    assert "holders" not in body and (body["replicas"], body["ranks_per_node"]) == (1, 2)
    assert body["ranks"] == {"1": "spare/0"} and body["nodes"] == {"1": 0}
    assert set(send.to) == {"rank/0", "spare/0", "rank/2", "rank/3"}
    assert "generation_complete" in names(ack_all(m, 1.1))
    # The pool is refilled on the spare's node once the job replicates again (a spare's
    # start-up would compete with the recovery for the node's CPU).
    assert not of(out, SpawnSpare)
    refill = [a for r in range(4) for a in m.report_replicated(m.ranks[r], 8, 2)]
    assert of(refill, SpawnSpare) == [SpawnSpare(0)]


def test_committed_step_is_the_minimum_over_ranks():
    m, _ = job(spares=0)
    for r, step in enumerate([5, 3, 9, 4]):
        m.report_replicated(f"rank/{r}", step)
    assert m.committed_step == 3
    assert m.report_replicated("rank/1", 6) == [Event("committed", {"step": 4})]


def test_missed_heartbeats_kill_the_hung_rank_and_replace_it():
    m, _ = job(spares=1, heartbeat_timeout_s=3.0)
    ack_all(m)
    for identity in list(m.procs):
        if identity != "rank/2":
            m.heartbeat(identity, 5.0)
    out = m.tick(5.0)
    assert of(out, Kill) == [Kill(1, "rank/2", 1002, "missed heartbeats")]
    assert of(out, SendGeneration)[0].generation.ranks[2] == "spare/0"


def test_a_lost_agent_loses_its_whole_node():
    m, _ = job(spares=1, world=4, rpn=2)
    ack_all(m)
    out = m.fault("agent/1", "no heartbeat", 2.0)
    faults = [a.fields["identity"] for a in out if isinstance(a, Event) and a.name == "fault"]
    assert {"agent/1", "rank/2", "rank/3"} <= set(faults)
    # One spare for two lost ranks: one is assigned, the other waits (no generation yet).
    assert "waiting_for_spare" in names(out)


def test_ranks_silent_with_their_agent_are_lost_with_the_node_not_one_by_one():
    m, _ = job(spares=2, world=4, rpn=2, heartbeat_timeout_s=3.0)
    ack_all(m)
    for identity in ("agent/0", "rank/0", "rank/1", "spare/0"):
        m.heartbeat(identity, 4.0)
    for identity in ("rank/2", "rank/3", "spare/1"):  # node 1: a little before its agent
        m.heartbeat(identity, 1.0)
    m.heartbeat("agent/1", 1.4)
    out = m.tick(4.2)  # the ranks are past the timeout, their agent not quite yet
    reasons = {
        a.fields["identity"]: a.fields["reason"]
        for a in out
        if isinstance(a, Event) and a.name == "fault"
    }
    assert set(reasons) == {"agent/1", "rank/2", "rank/3", "spare/1"}
    assert reasons["rank/2"].startswith("node 1 lost") and reasons["rank/3"].startswith("node 1")


def test_a_silent_rank_beside_a_live_agent_is_hung_not_a_node_loss():
    m, _ = job(spares=1, world=4, rpn=2, heartbeat_timeout_s=3.0)
    ack_all(m)
    for identity in ("agent/0", "agent/1", "rank/0", "rank/1", "rank/3", "spare/0"):
        m.heartbeat(identity, 4.0)
    m.heartbeat("rank/2", 1.0)
    out = m.tick(4.2)
    faults = [a.fields["identity"] for a in out if isinstance(a, Event) and a.name == "fault"]
    assert faults == ["rank/2"]
    assert [a.identity for a in out if isinstance(a, Kill)] == ["rank/2"]


def test_stragglers_past_the_ack_deadline_are_faults_and_start_the_next_generation():
    m, _ = job(spares=1, ack_timeout_s=2.0, heartbeat_timeout_s=100.0)
    for identity in ("rank/0", "rank/1", "rank/2"):
        m.ack(identity, 1, 0.5)
    out = m.tick(3.0)
    assert of(out, Kill)[0].identity == "rank/3"
    assert of(out, SendGeneration)[0].generation.generation == 2


def test_only_members_that_never_arrived_are_replaced_at_the_ack_deadline():
    """A survivor held up leaving its old groups keeps the generation from forming: it alone is
    replaced, and the members that arrived wait for the next generation instead of dying too."""
    m, _ = job(spares=2, ack_timeout_s=2.0, heartbeat_timeout_s=100.0, spare_wait_s=100.0)
    ack_all(m)
    (send,) = of(m.exited("rank/3", -9, 1.0), SendGeneration)
    g = send.generation
    assert g.generation == 2 and g.ranks[3] == "spare/0"
    for identity in ("rank/0", "rank/1", "spare/0"):
        assert m.arrive(identity, 2) == []
    m.arrive("rank/2", 1)  # an arrival at an older generation counts for nothing
    assert m.tick(2.9) == []  # before the deadline
    out = m.tick(3.1)
    (stragglers,) = [a for a in out if isinstance(a, Event) and a.name == "stragglers"]
    assert stragglers.fields["late"] == ["rank/0", "rank/1", "rank/2", "spare/0"]
    assert stragglers.fields["not_arrived"] == ["rank/2"]
    assert [(k.identity, k.reason) for k in of(out, Kill)] == [("rank/2", "did not arrive")]
    (nxt,) = of(out, SendGeneration)
    assert nxt.generation.generation == 3 and nxt.generation.ranks == {
        0: "rank/0",
        1: "rank/1",
        2: "spare/1",
        3: "spare/0",
    }
    # The members that arrived are awaited again, at the new generation's own deadline.
    assert of(m.tick(4.0), Kill) == []
    assert m.awaiting == set(nxt.generation.ranks.values()) and m.arrived == set()


def test_when_every_member_arrived_and_none_acknowledged_all_are_replaced():
    m, _ = job(spares=1, ack_timeout_s=2.0, heartbeat_timeout_s=100.0, spare_wait_s=100.0)
    for identity in ("rank/0", "rank/1", "rank/2", "rank/3"):
        m.arrive(identity, 1)
    m.ack("rank/0", 1, 0.5)
    out = m.tick(3.0)
    (stragglers,) = [a for a in out if isinstance(a, Event) and a.name == "stragglers"]
    assert stragglers.fields["not_arrived"] == []
    kills = [(k.identity, k.reason) for k in of(out, Kill)]
    assert kills == [(f"rank/{r}", "did not acknowledge") for r in (1, 2, 3)]


def test_a_fault_during_a_generation_change_supersedes_it():
    m, _ = job(spares=2)
    ack_all(m)
    m.exited("rank/1", -9, 1.0)
    out = m.exited("rank/2", -9, 1.1)  # before generation 2 was acknowledged
    started = [a for a in out if isinstance(a, Event) and a.name == "generation_started"]
    assert started[0].fields["generation"] == 3 and started[0].fields["supersedes"] == 2


def test_no_spare_waits_then_the_survivors_checkpoint_and_the_job_fails_clearly():
    m, _ = job(spares=0, spare_wait_s=10.0, heartbeat_timeout_s=100.0)
    ack_all(m)
    out = m.exited("rank/3", -9, 1.0)
    assert "waiting_for_spare" in names(out) and not of(out, SendGeneration)
    # The survivors are stopped at once and told how long a spare may take.
    (notice,) = of(out, Interrupt)
    assert notice.to == ("rank/0", "rank/1", "rank/2") and notice.lost == (3,)
    assert notice.wait_s == 10.0 + 10.0  # the wait for a spare, then the ack deadline
    assert m.tick(5.0) == []
    out = m.tick(11.5)
    assert not of(out, End)
    # One last generation of the survivors, renumbered, restores and checkpoints, then stops.
    (final,) = of(out, SendGeneration)
    gen = final.generation
    assert gen.directive == "checkpoint" and gen.world_size == 3 and gen.lost == [3]
    assert gen.ranks == {0: "rank/0", 1: "rank/1", 2: "rank/2"}
    assert gen.to_body(full=False)["full"] is True  # renumbered: everyone gets the full maps
    assert "no spare for ranks [3]" in gen.reason and "--spares" in gen.reason
    for identity in gen.ranks.values():
        m.report_done(identity, checkpoint_step=gen.committed_step)
    assert not of(m.exited("rank/0", 1, 12.0) + m.exited("rank/1", 1, 12.1), End)
    (end,) = of(m.exited("rank/2", 1, 12.2), End)
    assert end.code == 1 and "no spare for ranks [3]" in end.reason
    assert f"the survivors wrote a checkpoint of step {gen.committed_step}" in end.reason


def test_a_stop_whose_checkpoint_was_not_written_says_so():
    m, _ = job(spares=0, spare_wait_s=10.0, heartbeat_timeout_s=100.0)
    ack_all(m)
    m.exited("rank/3", -9, 1.0)
    m.tick(11.5)
    m.report_done("rank/0", checkpoint_step=5)  # one member wrote its part, then the save...
    out = m.exited("rank/0", 1, 12.0) + m.fault("rank/1", "reported: store timeout", 12.1)
    (end,) = of(out + m.exited("rank/2", 1, 12.2), End)  # ...failed on the others
    assert "could not write a checkpoint (rank/1, rank/2 failed" in end.reason
    assert "wrote a checkpoint" not in end.reason


def test_a_stop_that_does_not_finish_in_time_still_ends_the_job():
    m, _ = job(spares=0, spare_wait_s=10.0, heartbeat_timeout_s=100.0, stop_timeout_s=30.0)
    ack_all(m)
    m.exited("rank/3", -9, 1.0)
    m.tick(11.5)
    assert not of(m.tick(30.0), End)
    (end,) = of(m.tick(42.0), End)
    assert end.code == 1 and "did not finish in time" in end.reason


def test_a_spare_arriving_in_time_fills_the_vacancy():
    m, _ = job(spares=0, spare_wait_s=10.0)
    ack_all(m)
    m.exited("rank/3", -9, 1.0)
    out = m.hello(Process("spare/9", "spare", 1, 3000), None, 4.0)
    assert of(out, SendGeneration)[0].generation.ranks[3] == "spare/9"


def test_job_ends_when_every_rank_finished_and_late_exit_reports_change_nothing():
    m, _ = job(spares=0)
    out = []
    for r in range(4):
        out += m.exited(f"rank/{r}", 0, 2.0)
    assert of(out, End) == [End(0, "every rank finished")]
    assert m.exited("rank/1", -9, 3.0) == []


def test_plain_scripts_count_by_rank_and_their_crash_fails_the_job():
    m = Membership(MembershipConfig(world_size=2, ranks_per_node=2))
    assert of(m.exited("rank/0/1", 0, 1.0, rank=0), End) == []
    (end,) = of(m.exited("rank/0/2", 1, 1.0, rank=1), End)
    assert end.code == 1 and "does not use the engine" in end.reason


def test_a_killed_hung_rank_reported_again_by_its_agent_is_not_a_second_fault():
    m, _ = job(spares=2)
    ack_all(m)
    for identity in list(m.procs):
        if identity != "rank/0":
            m.heartbeat(identity, 5.0)
    m.tick(5.0)
    assert m.exited("rank/0", -9, 5.1, rank=0) == []


@pytest.mark.parametrize("field", ["heartbeat_timeout_s", "ack_timeout_s", "spare_wait_s"])
def test_bad_deadlines_are_refused(field):
    with pytest.raises(ValueError, match=field):
        MembershipConfig(world_size=2, ranks_per_node=1, **{field: 0})


def test_a_killed_straggler_is_reported_once_not_on_every_tick():
    m, _ = job(spares=0, ack_timeout_s=2.0, heartbeat_timeout_s=100.0, spare_wait_s=100.0)
    for identity in ("rank/0", "rank/1", "rank/2"):
        m.ack(identity, 1, 0.5)
    first = m.tick(3.0)
    assert names(first).count("stragglers") == 1
    assert "stragglers" not in names(m.tick(3.1)) + names(m.tick(3.2))


def test_spares_arriving_one_by_one_are_all_in_the_one_generation():
    m, _ = job(spares=0, world=4, spare_wait_s=100.0, heartbeat_timeout_s=100.0)
    ack_all(m)
    m.exited("rank/1", -9, 1.0)
    m.exited("rank/2", -9, 1.0)
    out = m.hello(Process("spare/a", "spare", 0, 3000), None, 2.0)
    assert not of(out, SendGeneration)  # rank 2 still waits for a spare
    (send,) = of(m.hello(Process("spare/b", "spare", 1, 3001), None, 3.0), SendGeneration)
    gen = send.generation
    assert gen.replaced == {1: ["rank/1", "spare/a"], 2: ["rank/2", "spare/b"]}
    assert gen.lost == [1, 2]
    # Each newcomer finds its own rank in what it receives.
    for rank, identity in ((1, "spare/a"), (2, "spare/b")):
        assert body_maps(gen.to_body(full=True))[0][rank] == identity


def test_a_rank_that_completed_is_not_declared_hung_while_it_exits():
    m, _ = job(spares=1, heartbeat_timeout_s=3.0)
    ack_all(m)
    for r in range(4):
        assert names(m.report_done(f"rank/{r}")) == ["rank_done"]
        m.heartbeat(f"rank/{r}", 1.0)  # a last beat in flight changes nothing
    # Slow interpreter teardown: no heartbeats from the ranks for longer than the timeout
    # (the agents and the spare keep beating).
    for identity in ("agent/0", "agent/1", "spare/0"):
        m.heartbeat(identity, 9.9)
    assert not of(m.tick(10.0), Kill) and not names(m.tick(10.0))
    out = []
    for r in range(4):
        out += m.exited(f"rank/{r}", 0, 11.0)
    (end,) = of(out, End)
    assert end.code == 0 and end.reason == "every rank finished"


def test_a_failure_after_the_others_completed_ends_the_job_with_its_reason():
    m, _ = job(spares=1, heartbeat_timeout_s=3.0)
    ack_all(m)
    for r in (0, 1, 2):
        m.report_done(f"rank/{r}")
    out = m.exited("rank/3", -9, 5.0)
    assert not of(out, SendGeneration), "no generation once the training has completed"
    out += [a for r in (0, 1, 2) for a in m.exited(f"rank/{r}", 0, 6.0)]
    (end,) = of(out, End)
    assert end.code == 1 and "rank 3" in end.reason and "completed" in end.reason


def test_a_rank_that_ends_without_saying_done_stops_every_decision():
    """A plain script's rank exits 0 without the engine's DONE: the job is ending."""
    m, _ = job(spares=1, heartbeat_timeout_s=100.0)
    ack_all(m)
    assert names(m.exited("rank/2", 0, 1.0)) == ["rank_finished"]
    out = m.tick(2.0) + m.hello(Process("spare/9", "spare", 1, 3000), None, 2.5) + m.tick(40.0)
    assert not of(out, SendGeneration) and not of(out, End)


def _replicate(m, step):
    for identity in m.ranks.values():
        m.report_replicated(identity, step, m.generation)


def test_a_fault_that_repeats_on_every_recovery_stops_the_job_after_max_restarts():
    m, _ = job(spares=5, max_restarts=2, heartbeat_timeout_s=100.0)
    ack_all(m)
    _replicate(m, 7)
    # The spare given rank 1 dies while restoring, twice: each time the job recovers again.
    out = m.exited("rank/1", -9, 1.0)
    assert of(out, SendGeneration)[0].generation.directive == "train"
    out = m.exited(m.ranks[1], 1, 2.0)
    assert of(out, SendGeneration)[0].generation.directive == "train"
    # The third loss without a new committed step uses up the budget: the survivors (the
    # failing rank is among the lost) checkpoint step 7 and the job ends, spares unused.
    out = m.exited(m.ranks[1], 1, 3.0)
    (final,) = of(out, SendGeneration)
    gen = final.generation
    assert gen.directive == "checkpoint" and gen.world_size == 3 and gen.committed_step == 7
    assert "--max-restarts 2" in gen.reason and "past step 7" in gen.reason
    assert "spare_assigned" not in names(out) and len(m.spares) == 3


def test_a_fault_in_every_first_step_says_the_training_never_got_through_one():
    m, _ = job(spares=5, max_restarts=1, heartbeat_timeout_s=100.0)
    ack_all(m)
    m.exited("rank/1", 1, 1.0)  # before any step was replicated: the same bug, every time
    (final,) = of(m.exited(m.ranks[1], 1, 2.0), SendGeneration)
    assert "after 1 recovery in a row that never got the training through its first step" in (
        final.generation.reason
    )
    assert "the failing rank's log says why" in final.generation.reason  # it recorded nothing


def test_the_exception_a_failing_rank_recorded_is_named_when_the_job_stops():
    m, _ = job(spares=5, max_restarts=1, heartbeat_timeout_s=100.0)
    ack_all(m)
    m.exited("rank/1", 1, 1.0, error="ValueError: bad lr")
    spare = m.ranks[1]
    (final,) = of(m.exited(spare, 1, 2.0, error="ValueError: bad lr"), SendGeneration)
    assert f"rank 1 ({spare}) failed with ValueError: bad lr; fix that" in final.generation.reason
    # An error recorded by a process that is not among the lost ones names nothing.
    m, _ = job(spares=5, max_restarts=1, heartbeat_timeout_s=100.0)
    ack_all(m)
    m.exited("rank/1", 1, 1.0, error="ValueError: bad lr")
    (final,) = of(m.exited(m.ranks[1], -9, 2.0), SendGeneration)
    assert "the failing rank's log says why" in final.generation.reason


def test_faults_with_progress_between_them_are_recovered_without_limit():
    m, _ = job(spares=1, max_restarts=1, heartbeat_timeout_s=100.0)
    ack_all(m)
    for k in range(5):
        _replicate(m, 10 * k)
        m.hello(Process(f"spare/new{k}", "spare", 0, 5000 + k), None, k + 0.2)
        out = m.exited(m.ranks[2], -9, k + 0.5)
        (send,) = of(out, SendGeneration)
        assert send.generation.directive == "train" and send.generation.committed_step == 10 * k
        ack_all(m, k + 0.6)
        _replicate(m, 10 * k)  # the restored step again is not progress...
        assert m.restarts == 1
        _replicate(m, 10 * k + 1)  # ...its next step is
        assert m.restarts == 0


def test_max_restarts_zero_stops_at_the_first_fault():
    m, _ = job(spares=1, max_restarts=0, heartbeat_timeout_s=100.0)
    ack_all(m)
    (final,) = of(m.exited("rank/0", -9, 1.0), SendGeneration)
    assert final.generation.directive == "checkpoint"
    assert "--max-restarts is 0" in final.generation.reason
    with pytest.raises(ValueError, match="max_restarts"):
        MembershipConfig(world_size=2, ranks_per_node=1, max_restarts=-1)
