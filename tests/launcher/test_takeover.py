"""Coordinator takeover without processes: the mirrored state, the restarted recovery, the term
rule on every link, and the active coordinator's quorum, each from plain inputs."""

from __future__ import annotations

import time

import pytest
import zmq

from launcher import mirror, protocol
from launcher.coordinator import Coordinator, CoordinatorConfig
from launcher.events import read_events
from launcher.link import CoordinatorLinks
from launcher.membership import Membership, MembershipConfig, SendGeneration
from tests.launcher.test_membership import ack_all, job, of

SECRET = b"s" * 64


def _copy(m: Membership, now: float = 5.0) -> Membership:
    standby = Membership(m.config)
    mirror.load(standby, mirror.dump(m), now)
    return standby


def _comparable(m: Membership) -> dict:
    return {k: v for k, v in vars(m).items() if k not in ("last_seen", "config", "policy")}


def test_the_mirror_carries_every_decision_the_active_coordinator_made():
    m, _ = job(spares=1)
    ack_all(m)
    for r in range(4):
        m.report_replicated(f"rank/{r}", 7)
    m.exited("rank/1", -9, 1.0)  # generation 2 pending: spare/0 takes rank 1
    standby = _copy(m)
    assert _comparable(standby) == _comparable(m)
    assert standby.pending == m.pending and standby.committed_step == 7
    # Every member gets a fresh heartbeat at the takeover (it needs a moment to reconnect).
    assert standby.last_seen == dict.fromkeys(m.procs, 5.0)
    # It decides as the active one would have from here on.
    assert of(standby.exited("rank/3", -9, 2.0), SendGeneration) == of(
        m.exited("rank/3", -9, 2.0), SendGeneration
    )


def test_a_takeover_between_faults_sends_nothing_and_one_during_a_recovery_restarts_it():
    m, _ = job(spares=1)
    ack_all(m)
    quiet = _copy(m)
    assert not of(quiet.took_over(5.0), SendGeneration), "training between faults is left alone"
    m.exited("rank/1", -9, 1.0)
    standby = _copy(m)
    (send,) = of(standby.took_over(5.0), SendGeneration)
    g = send.generation
    assert g.generation == 3 and g.store_prefix == "gen3/", "a fresh rendezvous"
    assert g.replaced == {1: ["rank/1", "spare/0"]} and g.lost == [1]
    assert standby.pending is g and standby.awaiting == set(g.ranks.values())
    # Who arrived at a pending generation is mirrored too: a straggler is still the one blamed.
    m.arrive("rank/0", m.pending.generation)
    assert _copy(m).arrived == {"rank/0"}


def test_a_corrupt_mirror_is_refused_and_changes_nothing():
    m, _ = job()
    standby = Membership(m.config)
    before = _comparable(standby)
    for bad in (b"", b"x" * 100, mirror.dump(m)[:-5]):
        with pytest.raises(ValueError, match="not a mirrored membership state"):
            mirror.load(standby, bad, 0.0)
    assert _comparable(standby) == before


def _message(term: int, type_: str = protocol.HEARTBEAT, sender: str = "coordinator"):
    return protocol.Message(type_, sender, 0, 1, {}, 1, term)


class _FakeLinks(CoordinatorLinks):
    """The term rule of :class:`CoordinatorLinks` fed with messages instead of sockets."""

    def __init__(self, inbox: dict) -> None:
        codec = protocol.Codec(SECRET, "job", "agent/1")
        super().__init__(zmq.Context.instance(), "agent/1", codec, ["a:1"])
        self.add("b:2")
        self.inbox = inbox
        self.codec.drain = lambda sock: self.inbox.pop(self.address_of(sock), [])


def test_links_drop_an_older_term_and_follow_a_newer_one():
    links = _FakeLinks({"a:1": [_message(0)]})
    try:
        assert [m.term for m in links.receive(links.sockets["a:1"]).messages] == [0]
        # A standby of the same term that has not taken over is not obeyed.
        links.inbox["b:2"] = [_message(0, protocol.KILL, "coordinator/1")]
        assert links.receive(links.sockets["b:2"]).messages == []
        links.inbox["b:2"] = [_message(1, protocol.TAKEOVER, "coordinator/1")]
        got = links.receive(links.sockets["b:2"])
        assert got.takeover and links.active == "b:2" and links.term == 1
        assert links.codec.term == 1, "the new term goes out on everything sent"
        # The old coordinator, back from a pause, is fenced off.
        links.inbox["a:1"] = [_message(0, protocol.KILL)]
        assert links.receive(links.sockets["a:1"]).messages == []
    finally:
        links.close()


def test_a_node_that_voted_follows_the_winner_even_if_its_takeover_was_lost():
    links = _FakeLinks({})
    try:
        links.adopt(1, None)  # it voted for term 1; the old coordinator is still "active"
        links.inbox["b:2"] = [_message(1, protocol.HEARTBEAT, "coordinator/1")]
        got = links.receive(links.sockets["b:2"])
        assert got.takeover and links.active == "b:2" and links.term == 1
    finally:
        links.close()


def _coordinator(tmp_path, **config) -> Coordinator:
    """A coordinator of a 3-node job (1 rank each), in this process, hosting no store."""
    secret = tmp_path / "secret"
    protocol.write_secret(str(secret))
    return Coordinator(
        CoordinatorConfig(
            secret_file=str(secret),
            run_dir=str(tmp_path),
            host_store=False,
            membership=MembershipConfig(world_size=3, ranks_per_node=1, heartbeat_timeout_s=2.0),
            **config,
        )
    )


@pytest.fixture
def coordinator(tmp_path):
    c = _coordinator(tmp_path)
    yield c
    c.close()


def test_a_coordinator_that_hears_under_half_the_nodes_holds_its_decisions(coordinator):
    from launcher.decisions import Process

    m = coordinator.membership
    for node in range(3):
        m.hello(Process(f"agent/{node}", "agent", node, 10 + node), None, 0.0)
    assert coordinator._in_quorum(0.5)
    m.heartbeat("agent/0", 1.5)
    m.heartbeat("agent/1", 1.5)
    assert coordinator._in_quorum(2.0), "2 of 3 nodes heard: it decides"
    assert not coordinator._in_quorum(2.6), "1 of 3 (a partition?): a standby may take over"


def test_a_stall_of_a_coordinator_cut_off_with_a_minority_does_not_give_it_a_quorum(coordinator):
    """Cut off from nodes 1 and 2, it hears only node 0; then its host pauses it. The stall
    excuses every node from being declared lost, but what it hears is still 1 node of 3: it
    goes on holding its decisions (a standby on the other side may be taking over)."""
    from launcher.decisions import Process

    m = coordinator.membership
    for node in range(3):
        m.hello(Process(f"agent/{node}", "agent", node, 10 + node), None, 0.0)
        coordinator.routes[f"agent/{node}"] = f"agent/{node}".encode()
        coordinator._dispatch(_message(0, sender=f"agent/{node}"), f"agent/{node}".encode(), 0.0)
    assert coordinator._in_quorum(0.5)
    coordinator._dispatch(_message(0, sender="agent/0"), b"agent/0", 2.5)  # node 0 only
    assert not coordinator._in_quorum(2.6)
    coordinator._last_loop = 2.6
    coordinator._excuse_own_stall(5.0)  # 2.4 s without a turn of the loop
    assert all(m.last_seen[f"agent/{node}"] == 5.0 for node in range(3)), "nobody is blamed"
    assert not coordinator._in_quorum(5.0), "but nodes 1 and 2 were not heard: still holding"
    events = [e["event"] for e in read_events(coordinator.config.run_dir)]
    assert "stalled" in events and "quorum_regained" not in events


def test_what_the_cut_off_side_reports_while_holding_is_acted_on_only_with_the_quorum_back(
    coordinator,
):
    """Cut off with node 0, the coordinator hears its rank fail (its collectives with the other
    side time out). Acting on it would start a generation beside the one the standby across
    the partition starts: the report is kept, and acted on once the quorum is back, which
    only answers to heartbeats sent since it was lost can bring."""
    from launcher.decisions import Process

    m = coordinator.membership
    for node in range(3):
        for identity, role in ((f"agent/{node}", "agent"), (f"rank/{node}", "rank")):
            m.hello(Process(identity, role, node, 10 + node), node if role == "rank" else None, 0)
            coordinator.routes[identity] = identity.encode()
    for node in range(3):
        coordinator._dispatch(_message(0, sender=f"agent/{node}"), f"agent/{node}".encode(), 0.0)
    assert coordinator._in_quorum(0.5)
    coordinator._dispatch(_message(0, sender="agent/0"), b"agent/0", 2.5)
    assert not coordinator._in_quorum(2.6)
    error = protocol.Message(protocol.ERROR, "rank/0", 0, 1, {"reason": "gloo timed out"})
    coordinator._dispatch(error, b"rank/0", 2.7)

    def decisions() -> list[str]:
        events = read_events(coordinator.config.run_dir)
        return [e["event"] for e in events if e["event"] in ("kill_requested", "fault")]

    assert decisions() == [], "no decision while holding"
    assert "rank/0" in m.procs and [msg.type for msg, _ in coordinator._held] == [protocol.ERROR]

    def heartbeat(node: int, beat: int, at: float) -> None:
        msg = protocol.Message(protocol.HEARTBEAT, f"agent/{node}", 0, 1, {"beat": beat})
        coordinator._dispatch(msg, f"agent/{node}".encode(), at)

    # The partition heals. What nodes 1 and 2 queued comes first: answers to heartbeats sent
    # before the quorum was lost (they may have voted for a standby since) do not restore it.
    for node in (1, 2):
        heartbeat(node, 2000, 3.0)
    assert not coordinator._in_quorum(3.1)
    assert decisions() == [] and len(coordinator._held) == 1
    for node in (1, 2):  # their answers to one sent since, in this coordinator's term
        heartbeat(node, 2700, 3.2)
    assert coordinator._in_quorum(3.3)
    coordinator._release_held(3.3)
    assert "kill_requested" in decisions() and not coordinator._held


def test_a_fenced_coordinator_stops_before_it_checks_another_deadline(coordinator):
    """The partition heals: the node's queued messages of the old term give back the quorum,
    then one of the new term fences it. Its loop ends there; it must not first declare lost
    a member it could not hear while cut off (the standby replaced that member long ago)."""
    from launcher.decisions import Process

    m, now = coordinator.membership, coordinator.now()
    for node in range(3):
        m.hello(Process(f"agent/{node}", "agent", node, 10 + node), None, now)
        coordinator._heard[f"agent/{node}"] = now
    m.hello(Process("rank/0", "rank", 0, 20), 0, now - 10.0)  # unheard for 5 timeouts
    newer = protocol.Codec(coordinator._secret, "p2p-job", "agent/1")
    newer.run, newer.term = coordinator.codec.run, 1
    agent = zmq.Context.instance().socket(zmq.DEALER)
    agent.setsockopt(zmq.IDENTITY, b"agent/1")
    agent.setsockopt(zmq.LINGER, 0)
    agent.connect(f"tcp://127.0.0.1:{coordinator.port}")
    try:
        agent.send_multipart(newer.encode(protocol.HEARTBEAT, {}))
        assert coordinator.sock.poll(30_000), "the message never arrived"
        assert coordinator.serve(stop_after_s=30) == 0
    finally:
        agent.close()
    events = [e["event"] for e in read_events(coordinator.config.run_dir)]
    assert "fenced" in events and "fault" not in events and "kill_requested" not in events


def test_a_process_declared_lost_that_is_heard_again_is_told_the_job_went_on(coordinator):
    from launcher.decisions import Process

    m = coordinator.membership
    for node in range(3):
        m.hello(Process(f"agent/{node}", "agent", node, 10 + node), None, 0.0)
        coordinator.routes[f"agent/{node}"] = f"agent/{node}".encode()
    coordinator._apply(m.fault("agent/2", "no heartbeat for 2.0s", 3.0))  # a partition
    sent = []
    coordinator._send = lambda identity, type_, body, generation=0: sent.append((identity, type_))
    heartbeat = _message(0, protocol.HEARTBEAT, "agent/2")
    coordinator._dispatch(heartbeat, b"agent/2", time.monotonic())  # the link is back
    coordinator._dispatch(heartbeat, b"agent/2", time.monotonic())
    assert sent == [("agent/2", protocol.SHUTDOWN)], "told once, not on every message"
    assert "agent/2" not in m.procs, "and it does not come back into the job"
    events = read_events(coordinator.config.run_dir)
    assert [e["identity"] for e in events if e["event"] == "lost_process_heard"] == ["agent/2"]
    # A process never heard of is no lost one: its message is refused, nothing is sent.
    with pytest.raises(ValueError, match="before its hello"):
        coordinator._dispatch(_message(0, protocol.HEARTBEAT, "agent/7"), b"agent/7", 0.0)
    assert len(sent) == 1


def test_a_coordinator_that_receives_a_newer_term_stops(coordinator):
    coordinator._dispatch(_message(1, protocol.HEARTBEAT, "agent/0"), b"agent/0", time.monotonic())
    assert coordinator.exit_code == 0


@pytest.mark.parametrize(
    "spec, kind, at, phase",
    [
        ("kill-coordinator@step=4", "kill-coordinator", 4, "forward"),
        ("hang-coordinator@recovery=1:phase=build", "hang-coordinator", 1, "build"),
        ("kill-coordinators@step=2", "kill-coordinators", 2, "forward"),
    ],
)
def test_coordinator_faults_parse_and_print_back(spec, kind, at, phase):
    from bench.faults import parse_fault

    fault = parse_fault(spec)
    assert (fault.kind, fault.at, fault.phase) == (kind, at, phase)
    assert parse_fault(str(fault)) == fault
    assert fault.in_recovery == (phase == "build")


@pytest.fixture
def standby(tmp_path):
    from launcher.decisions import Process

    # The active coordinator at 127.0.0.1:9 never answers: it is gone.
    c = _coordinator(tmp_path, standby_of="127.0.0.1:9", node="1", takeover_timeout_s=0.5)
    active = Membership(c.config.membership)
    for node in range(3):
        active.hello(Process(f"agent/{node}", "agent", node, 10 + node), None, 0.0)
    mirror.load(c.membership, mirror.dump(active), 0.0)
    # The routes mirrored with the state: each agent's hello came on a routing id of its name.
    c.routes = {f"agent/{node}": f"agent/{node}".encode() for node in range(3)}
    c.link.has_state = True
    yield c
    c.close()


def _deliver(c: Coordinator, msg: protocol.Message) -> None:
    """``msg`` as if it came on the connection its sender said hello on."""
    c._dispatch(msg, msg.sender.encode(), 0.0)


def _voted(identity: str, term: int, granted: bool = True, pre: bool = False):
    body = {"granted": granted, **({"pre": True} if pre else {})}
    return protocol.Message(protocol.VOTED, identity, 0, 1, body, 1, term)


def test_a_standby_takes_over_with_more_than_half_the_votes_only(standby):
    link = standby.link
    standby._standby_tick(link)
    assert standby.codec.term == 0 and not link.votes_asked_at, "the active one is not silent yet"
    link.heard_active -= 1.0
    standby._standby_tick(link)
    assert standby.codec.term == 0 and not link.electing, "a pre-vote first: no term raised"
    _deliver(standby, _voted("agent/1", 0, pre=True))
    standby._standby_tick(link)
    assert standby.codec.term == 0, "1 node of 3 would vote (a partition's minority): no election"
    _deliver(standby, _voted("agent/2", 0, pre=True))
    standby._standby_tick(link)
    assert standby.codec.term == 1 and link.electing, "2 of 3 would: the election of term 1"
    _deliver(standby, _voted("agent/1", 1))
    _deliver(standby, _voted("agent/2", 0))  # an answer to another term counts for nothing
    standby._standby_tick(standby.link)
    assert standby.standby, "1 vote of 3 nodes is no majority"
    _deliver(standby, _voted("agent/2", 1))
    standby._standby_tick(standby.link)
    assert not standby.standby and standby.codec.term == 1
    took = [e for e in read_events(standby.config.run_dir) if e["event"] == "takeover"]
    assert took[0]["votes"] == ["agent/1", "agent/2"]


def test_an_election_that_wins_no_majority_in_time_goes_again_in_a_newer_term(standby):
    link = standby.link
    link.heard_active -= 1.0
    standby._standby_tick(link)
    for agent in ("agent/1", "agent/2"):
        _deliver(standby, _voted(agent, 0, pre=True))
    standby._standby_tick(link)
    _deliver(standby, _voted("agent/1", 1))
    link.votes_asked_at -= 1.0  # the takeover timeout passed without a majority
    standby._standby_tick(link)
    assert standby.codec.term == 1 and not link.electing and not link.votes and standby.standby
    for agent in ("agent/0", "agent/2"):
        _deliver(standby, _voted(agent, 1, pre=True))
    standby._standby_tick(link)
    assert standby.codec.term == 2 and link.electing


def test_a_process_that_said_hello_after_the_last_mirror_is_told_of_the_takeover(coordinator):
    from launcher.decisions import Process

    coordinator.membership.hello(Process("agent/1", "agent", 1, 11), None, 0.0)
    coordinator.routes["agent/1"] = b"agent/1"
    ctx = zmq.Context.instance()
    late = ctx.socket(zmq.DEALER)
    late.setsockopt(zmq.IDENTITY, b"spare/1/5")
    late.setsockopt(zmq.LINGER, 0)
    late.connect(f"tcp://127.0.0.1:{coordinator.port}")
    try:
        reader = protocol.Codec(coordinator._secret, "p2p-job", "spare/1/5")
        reader.run = coordinator.codec.run
        names = ["rank/1/1", "spare/1/5", "spare/2/9"]  # spare/2/9: another node's, ignored
        deadline = time.monotonic() + 30
        got = []
        while not got and time.monotonic() < deadline:  # until the connection is up
            _deliver(
                coordinator,
                protocol.Message(protocol.CHILDREN, "agent/1", 0, 1, {"identities": names}, 1, 0),
            )
            got = late.poll(200) and reader.drain(late)
        assert {m.type for m in got} == {protocol.TAKEOVER}
    finally:
        late.close()


def test_a_standby_left_behind_by_another_ones_takeover_follows_the_winner(standby):
    standby.link.heard_active -= 1.0
    standby._standby_tick(standby.link)
    assert standby.codec.term == 0
    # The agents hear the winner of term 1 (another standby) and say where it is.
    body = {"granted": False, "pre": True, "active": "127.0.0.1:7"}
    refusal = protocol.Message(protocol.VOTED, "agent/0", 0, 1, body, 1, 1)
    _deliver(standby, refusal)
    assert standby.link.active == "127.0.0.1:7" and standby.standby
    assert standby.codec.term == 1 and not standby.link.votes
    standby._standby_tick(standby.link)
    assert standby.codec.term == 1, "it waits for the new active one, it does not elect"


def test_an_agent_says_whether_it_would_vote_and_votes_only_for_a_standby_that_is_current(
    tmp_path,
):
    from launcher.agent import Agent, AgentConfig

    secret = tmp_path / "secret"
    protocol.write_secret(str(secret))
    config = AgentConfig(
        node_rank=1, nnodes=3, nproc_per_node=1, spares=0, command=("train.py",),
        coordinator="a:1", job_id="job", secret_file=str(secret), run_dir=str(tmp_path),
    )  # fmt: skip
    agent = Agent(config)
    links = _FakeLinks({})
    answers: list[dict] = []
    links.send_to = lambda address, type_, body=None: answers.append(body)  # type: ignore[method-assign]
    standby = links.sockets["b:2"]

    def ask(term: int, generation: int, pre: bool) -> dict:
        body = {"silence_s": 1.0, "generation": generation, "pre": pre}
        agent._vote(
            links, standby, protocol.Message(protocol.VOTE, "coordinator/2", 0, 1, body, 1, term)
        )
        return answers[-1]

    try:
        agent._generation = 2  # the newest generation the active coordinator sent
        agent._heard = time.monotonic()  # and it was heard just now
        assert ask(0, 2, pre=True) == {"granted": False, "pre": True, "active": "a:1"}
        agent._heard -= 1.0  # the active one fell silent here too
        assert ask(0, 1, pre=True)["granted"] is False, "it mirrored generation 1 only"
        assert ask(0, 2, pre=True) == {"granted": True, "pre": True}
        assert links.term == 0 and agent._voted_for is None, "a pre-vote changes nothing"
        assert ask(1, 2, pre=False) == {"granted": True}
        assert links.term == 1 and agent._voted_for == (1, "coordinator/2")
        assert ask(1, 2, pre=False) == {"granted": True}, "the same vote again (one was lost)"
        assert ask(1, 2, pre=True)["granted"] is True, "it would vote in term 2"
        assert ask(0, 2, pre=True)["granted"] is False, "term 1 is not newer than its own"
    finally:
        links.close()
        agent.events.close()


def _agent_config(**kw):
    from launcher.agent import AgentConfig

    defaults: dict = dict(
        node_rank=0,
        nnodes=2,
        nproc_per_node=2,
        spares=0,
        command=("train.py",),
        coordinator="10.0.0.1:29400",
        job_id="j",
        secret_file="/run/secret",
        run_dir="/run",
    )
    return AgentConfig(**{**defaults, **kw})


def test_with_no_coordinator_left_a_node_says_in_one_line_where_the_checkpoint_is():
    from launcher.agent import stop_line

    where = ["10.0.0.1:29400", "10.0.0.2:29400"]
    cfg = _agent_config(stop_checkpoint_timeout_s=90.0)
    written = {f"rank/0/{i}": {"step": 41, "root": "/ckpt"} for i in (1, 2)}
    line = stop_line(where, 30.4, written, [], cfg)
    assert line == (
        "no word from any coordinator (10.0.0.1:29400, 10.0.0.2:29400) for 30s: the ranks "
        "stopped at step 41 with a checkpoint in /ckpt; resume with p2p-run --checkpoint-dir "
        "/ckpt --resume (and this job's secret)"
    )
    missed = {"rank/0/1": {"reason": "the ranks could not agree; the last complete one is 40"}}
    assert stop_line(where, 30.0, missed, [], cfg).endswith(": " + missed["rank/0/1"]["reason"])
    late = stop_line(where, 30.0, {}, ["rank/0/1"], cfg)
    assert "wrote no checkpoint within 90s (--stop-checkpoint-timeout)" in late
    assert "nothing was left to checkpoint" in stop_line(where, 30.0, {}, [], cfg)
    assert all("\n" not in x for x in (line, late))


def test_the_local_channel_splits_lines_and_drops_what_is_malformed():
    lines = protocol.LocalLines()
    msg = protocol.encode_local(protocol.STOPPED, {"step": 7, "root": "/c"})
    assert lines.feed(msg[:5]) == []  # a partial line waits for the rest
    assert lines.feed(msg[5:] + b"not json\n[1]\n") == [
        {"step": 7, "root": "/c", "type": protocol.STOPPED}
    ]
    assert lines.feed(b"x" * (protocol.MAX_LOCAL_LINE_BYTES + 1)) == []  # dropped, not kept
    assert lines.feed(msg) == [{"step": 7, "root": "/c", "type": protocol.STOPPED}]


def test_a_process_never_welcomed_says_hello_where_its_agent_says_the_active_one_is(
    coordinator, tmp_path
):
    """A spare started before the standby joined knows only the coordinator it was started
    with; if that one dies before answering, the node's agent is how it finds the new one."""
    import socket

    from launcher.client import ClientConfig, ControlClient

    with socket.socket() as s:  # a port nobody listens on: the coordinator that died
        s.bind(("127.0.0.1", 0))
        dead = f"localhost:{s.getsockname()[1]}"  # another name: the host of another node
    agent_end, child_end = socket.socketpair()
    config = ClientConfig(
        coordinator=dead,
        job_id=coordinator.config.job_id,
        secret_file=coordinator.config.secret_file,
        identity="spare/1/2",
        role="spare",
        node=1,
        heartbeat_interval_s=0.2,
        agent_fd=child_end.fileno(),
    )
    client = ControlClient(config)
    try:
        live = f"127.0.0.1:{coordinator.port}"
        agent_end.sendall(
            protocol.encode_local(
                protocol.COORDINATORS, {"addresses": [dead, live], "active": live, "term": 0}
            )
        )
        deadline = time.monotonic() + 30
        while not client._welcome.is_set() and time.monotonic() < deadline:
            coordinator.serve(stop_after_s=0.2)
        assert client._welcome.is_set(), "the live coordinator never welcomed the spare"
        assert "spare/1/2" in coordinator.membership.procs
        # Its generations rendezvous through the store of the coordinator that welcomed it.
        assert client.store_address(1.0) == ("127.0.0.1", coordinator.store_port)
    finally:
        client.close()
        agent_end.close()
        child_end.close()


def test_a_coordinator_that_stalled_does_not_blame_the_nodes_it_could_not_hear(coordinator):
    """Its host paused it for 5 s (twice the heartbeat timeout): when it runs again it hears
    node 0's queued heartbeat first; node 1's comes a moment later. Node 1 is not lost."""
    from launcher.decisions import Process

    m = coordinator.membership
    for node in range(2):
        m.hello(Process(f"agent/{node}", "agent", node, 10 + node), None, coordinator.now())
    mirror, stalls = coordinator._mirror, [5.0]

    def mirror_then_stall() -> None:
        mirror()
        if stalls:
            coordinator.clock_offset += stalls.pop()
            m.heartbeat("agent/0", coordinator.now())

    coordinator._mirror = mirror_then_stall
    coordinator.serve(stop_after_s=0.5)
    events = read_events(coordinator.config.run_dir)
    assert [e for e in events if e["event"] == "fault"] == []
    (stalled,) = [e for e in events if e["event"] == "stalled"]
    assert stalled["seconds"] >= 5.0
    assert "agent/1" in m.procs


def test_a_slow_formation_is_logged_and_warned_of_with_the_deadline_to_use(coordinator, caplog):
    from launcher.decisions import Event
    from launcher.events import read_events

    fields = {"generation": 2, "formed_s": 3.0, "ack_timeout_s": 10.0, "advised_ack_timeout_s": 12}
    coordinator._apply([Event("slow_formation", fields)])
    assert "generation 2 took 3.0s to form" in caplog.text
    assert "use --ack-timeout 12 or more" in caplog.text
    (logged,) = [
        e for e in read_events(coordinator.config.run_dir) if e["event"] == "slow_formation"
    ]
    assert logged["advised_ack_timeout_s"] == 12


def test_what_comes_with_the_welcome_is_acted_on_a_standby_that_joined_meanwhile(tmp_path):
    """A standby that joins just after a node was welcomed is announced right behind the
    welcome, and both can be read at once: the node must still learn of it, or it could
    never follow that standby once it takes over."""
    import os
    import threading

    from launcher.agent import Agent
    from launcher.secret import create_once

    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    create_once(tmp_path / "secret")
    agent = Agent(
        _agent_config(
            coordinator=f"127.0.0.1:{port}",
            run_dir=str(tmp_path),
            secret_file=str(tmp_path / "secret"),
        )
    )
    links = agent.links = CoordinatorLinks(
        zmq.Context.instance(), agent.identity, agent.codec, [f"127.0.0.1:{port}"]
    )
    welcome = protocol.Message(protocol.WELCOME, "coordinator", 0, 1, {"standbys": []})
    standbys = protocol.Message(protocol.STANDBYS, "coordinator", 0, 2, {"addresses": ["s:3"]})

    def read_together(sock):
        sock.recv_multipart()  # what woke the node: the two messages behind it, in one read
        return [welcome, standbys]

    agent.codec.drain = read_together

    def coordinator() -> None:  # answers the hello with a frame that wakes the node
        if router.poll(30_000):
            router.send_multipart([router.recv_multipart()[0], b"wake"])

    answering = threading.Thread(target=coordinator, daemon=True)
    answering.start()
    wake_r, wake_w = os.pipe()
    try:
        first, early = agent._await_welcome(links, wake_r, {"role": "agent"})
        assert first is welcome and early == [standbys]
        assert agent._handle(links, links.active_socket, early) is None
        assert "s:3" in links.sockets
        known = [e for e in read_events(tmp_path) if e["event"] == "standbys_known"]
        assert [e["addresses"] for e in known] == [["s:3"]]
    finally:
        answering.join(timeout=30)
        os.close(wake_r)
        os.close(wake_w)
        links.close()
        router.close()
        agent.events.close()
