"""The elastic scaling policy, without processes: every decision from plain data and a time."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, note, settings, target
from hypothesis import strategies as st

from launcher.policy import (
    Capacity,
    ElasticConfig,
    Fail,
    Hold,
    PolicyState,
    Replace,
    Resize,
    allowed_sizes,
    backoff_delay_s,
    decide,
    largest_allowed_at_most,
)

FRESH = PolicyState.initial()


def config(**kw) -> ElasticConfig:
    base = dict(min_ranks=1, max_ranks=16, scale_up_delay_s=30.0, scale_down_wait_s=10.0)
    return ElasticConfig(**{**base, **kw})


def capacity(world, rpn=2, vacant=None, spares=None, requested=None) -> Capacity:
    """A job of ``world`` ranks on nodes of ``rpn``, with the ``vacant`` ranks lost."""
    vacant = vacant or {}
    active = {r: r // rpn for r in range(world) if r not in vacant}
    return Capacity(
        world_size=world,
        active=active,
        vacant=vacant,
        spares=spares or {},
        requested_size=requested,
    )


# -- configuration -------------------------------------------------------------------------------


def test_allowed_sizes_from_a_step():
    c = config(min_ranks=2, max_ranks=9, size_step=3)
    assert allowed_sizes(c) == (2, 5, 8)
    got = [largest_allowed_at_most(c, n) for n in (0, 1, 2, 4, 5, 7, 8, 9, 100)]
    assert got == [None, None, 2, 2, 5, 5, 8, 8, 8]


def test_allowed_sizes_from_a_list_override_the_step_and_say_so():
    c = config(min_ranks=2, max_ranks=8, allowed_sizes=[8, 2, 4, 4])
    assert allowed_sizes(c) == (2, 4, 8)
    assert [largest_allowed_at_most(c, n) for n in (1, 3, 7, 8)] == [None, 2, 4, 8]
    with pytest.warns(UserWarning, match="size_step=3 is ignored"):
        c = config(min_ranks=2, max_ranks=8, size_step=3, allowed_sizes=(2, 8))
    assert allowed_sizes(c) == (2, 8)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(min_ranks=0), "min_ranks=0 must be >= 1"),
        (dict(min_ranks=4, max_ranks=3), "max_ranks=3 must be >= min_ranks=4"),
        (dict(size_step=0), "size_step=0 must be >= 1"),
        (dict(allowed_sizes=()), "allowed_sizes=() must be non-empty"),
        (dict(min_ranks=2, allowed_sizes=(1, 4)), "drop [1] or widen the bounds"),
        (dict(max_ranks=8, allowed_sizes=(4, 9)), "drop [9] or widen the bounds"),
        (dict(scale_up_delay_s=-1), "scale_up_delay_s=-1 must be >= 0"),
        (dict(scale_down_wait_s=-0.5), "scale_down_wait_s=-0.5 must be >= 0"),
        (dict(backoff_base_s=-1), "backoff_base_s=-1 must be >= 0"),
        (dict(backoff_factor=0.5), "backoff_factor=0.5 must be >= 1"),
        (dict(backoff_base_s=10, backoff_max_s=5), "backoff_max_s=5 must be >= backoff_base_s"),
        (dict(backoff_reset_s=100), "backoff_reset_s=100 must be > 0 and >= backoff_max_s=300"),
        (dict(graceful_timeout_s=0), "graceful_timeout_s=0 must be > 0"),
    ],
)
def test_config_errors_name_the_field_the_value_and_the_fix(kw, message):
    with pytest.raises(ValueError, match="ElasticConfig") as err:
        config(**kw)
    assert message in str(err.value)


def test_defaults_are_valid_and_as_documented():
    c = ElasticConfig(min_ranks=2, max_ranks=4)
    assert (c.size_step, c.allowed_sizes, c.scale_up_delay_s, c.scale_down_wait_s) == (
        1,
        None,
        30.0,
        10.0,
    )
    assert (c.backoff_base_s, c.backoff_factor, c.backoff_max_s, c.backoff_reset_s) == (
        5.0,
        2.0,
        300.0,
        600.0,
    )
    assert c.graceful_timeout_s == 60.0


def test_capacity_must_split_the_ranks_between_active_and_vacant():
    with pytest.raises(ValueError, match="must split range"):
        Capacity(world_size=3, active={0: 0, 1: 0}, vacant={1: 0.0})  # 1 twice, 2 missing
    with pytest.raises(ValueError, match="must split range"):
        Capacity(world_size=2, active={0: 0, 1: 0, 2: 1})
    with pytest.raises(ValueError, match="must split range"):
        Capacity(world_size=0, active={})
    with pytest.raises(ValueError, match="requested_size=0"):
        capacity(2, requested=0)


def test_backoff_schedule_doubles_up_to_the_cap():
    c = ElasticConfig(min_ranks=1, max_ranks=2)
    assert [backoff_delay_s(c, n) for n in range(1, 9)] == [5, 10, 20, 40, 80, 160, 300, 300]
    assert backoff_delay_s(c, 100_000) == 300  # no overflow on a long run


def test_time_going_backwards_is_refused():
    c = config(scale_down_wait_s=0)
    _, state = decide(c, FRESH, capacity(4, vacant={3: 50.0}), now=50.0)
    with pytest.raises(ValueError, match="monotonic clock"):
        decide(c, state, capacity(3), now=49.0)


# -- replacement ---------------------------------------------------------------------------------


def test_a_vacancy_with_a_spare_is_replaced_at_once_even_in_backoff():
    c = config(scale_down_wait_s=0)
    _, state = decide(c, FRESH, capacity(5, vacant={4: 0.0}), now=0.0)
    assert state.last_event_s == 0.0  # a shrink just happened: the backoff runs
    d, after = decide(c, state, capacity(4, vacant={1: 0.5}, spares={"s/0": 0}), now=0.5)
    assert d == Replace({1: "s/0"})
    assert (after.last_event_s, after.num_events) == (0.0, 1)  # not a scaling event


def test_replacement_prefers_a_spare_off_the_jobs_nodes_then_arrival_order():
    # Ranks 0-3 on nodes 0 and 1; rank 1 lost. "s/z" arrived first but sits on a job node.
    d, _ = decide(config(), FRESH, capacity(4, vacant={1: 0.0}, spares={"s/z": 0, "s/a": 7}), 1.0)
    assert d == Replace({1: "s/a"})
    # Every spare on a job node: first come, first taken (not alphabetical).
    d, _ = decide(config(), FRESH, capacity(4, vacant={1: 0.0}, spares={"s/z": 0, "s/a": 1}), 1.0)
    assert d == Replace({1: "s/z"})


def test_more_vacancies_than_spares_fill_the_oldest_and_leave_the_rest_to_the_next_call():
    c = config(scale_down_wait_s=0)
    cap = capacity(4, vacant={1: 5.0, 3: 2.0}, spares={"s/0": 9})
    d, state = decide(c, FRESH, cap, now=100.0)  # both waits are over: still Replace first
    assert d == Replace({3: "s/0"})
    d, _ = decide(c, state, capacity(4, vacant={1: 5.0}), now=100.0)
    assert isinstance(d, Resize) and d.target == 3 and d.leaving == ()


# -- shrinking after a fault ---------------------------------------------------------------------


def test_no_shrink_before_the_vacancy_is_scale_down_wait_old_and_one_right_after():
    c = config(scale_down_wait_s=10)
    cap = capacity(4, vacant={2: 100.0, 3: 103.0})
    for now in (100.0, 105.0, 109.999):
        d, state = decide(c, FRESH, cap, now)
        assert d == Hold(110.0, d.reason) and "scale_down_wait_s" in d.reason
        assert state == FRESH
    d, state = decide(c, FRESH, cap, now=110.0)
    assert isinstance(d, Resize)
    assert (d.target, d.leaving, d.released_spares, d.joining) == (2, (), (), ())
    assert d.graceful is False and d.graceful_timeout_s == c.graceful_timeout_s
    assert (state.last_event_s, state.num_events) == (110.0, 1)


def test_a_fault_shrink_lands_on_an_allowed_size_and_frees_the_damaged_node():
    # Ranks on nodes of 2; rank 2 lost, so node 1 holds only rank 3. 7 live, sizes even: 6.
    c = config(allowed_sizes=(2, 4, 6, 8), scale_down_wait_s=0)
    d, _ = decide(c, FRESH, capacity(8, vacant={2: 0.0}), now=0.0)
    assert isinstance(d, Resize) and d.target == 6
    assert d.leaving == (3,)  # not rank 7: rank 3 empties node 1 whole


def test_fail_when_the_live_ranks_are_below_min_ranks_after_the_wait():
    c = config(min_ranks=4, scale_down_wait_s=10)
    cap = capacity(4, vacant={0: 0.0})
    d, _ = decide(c, FRESH, cap, now=9.0)
    assert isinstance(d, Hold) and d.until == 10.0 and "failing" in d.reason
    d, _ = decide(c, FRESH, cap, now=10.0)
    assert isinstance(d, Fail)
    assert "3 live ranks" in d.reason and "min_ranks=4" in d.reason and "add spares" in d.reason
    assert "\n" not in d.reason


def test_fail_when_no_allowed_size_fits_the_live_ranks():
    c = config(min_ranks=2, max_ranks=8, allowed_sizes=(4, 8), scale_down_wait_s=0)
    d, _ = decide(c, FRESH, capacity(4, vacant={1: 0.0}), now=0.0)
    assert isinstance(d, Fail) and "smallest allowed world size is 4" in d.reason
    d, _ = decide(c, FRESH, capacity(8, vacant={1: 0.0}), now=0.0)  # 7 live: 4 fits
    assert isinstance(d, Resize) and d.target == 4


# -- shrinking on request: who leaves ------------------------------------------------------------


def test_a_requested_shrink_releases_every_idle_spare_first_and_is_graceful():
    c = config(graceful_timeout_s=45)
    d, _ = decide(c, FRESH, capacity(4, spares={"s/b": 5, "s/a": 4}, requested=2), now=0.0)
    assert isinstance(d, Resize) and d.target == 2
    assert d.released_spares == ("s/b", "s/a") and d.leaving == (2, 3)
    assert d.graceful is True and d.graceful_timeout_s == 45


def test_a_shrink_empties_the_nodes_with_the_fewest_ranks_first():
    # Node 0 holds ranks 0-1, nodes 1 and 2 hold four each: node 0 goes whole, rank 0 with it.
    active = {0: 0, 1: 0, **{r: 1 for r in range(2, 6)}, **{r: 2 for r in range(6, 10)}}
    cap = Capacity(world_size=10, active=active, requested_size=8)
    d, _ = decide(config(), FRESH, cap, now=0.0)
    assert isinstance(d, Resize) and d.leaving == (0, 1)


def test_among_equal_nodes_the_higher_ranks_leave():
    d, _ = decide(config(), FRESH, capacity(8, rpn=2, requested=5), now=0.0)
    assert isinstance(d, Resize) and d.leaving == (5, 6, 7)  # node 3 whole, then rank 5


def test_the_choice_does_not_depend_on_the_order_of_the_maps():
    active = {r: r % 3 for r in range(9)}  # nodes of 3 ranks, interleaved
    backwards = dict(reversed(list(active.items())))
    leaving = set()
    for ranks in (active, backwards, active):
        d, _ = decide(config(), FRESH, Capacity(world_size=9, active=ranks, requested_size=4), 0)
        leaving.add(d.leaving)
    assert leaving == {(2, 4, 5, 7, 8)}  # node 2 (ranks 8, 5, 2), then node 1's 7 and 4


def test_a_requested_size_rounds_down_to_an_allowed_size_and_never_below_the_smallest():
    c = config(min_ranks=2, max_ranks=8, allowed_sizes=(2, 4, 8))
    d, _ = decide(c, FRESH, capacity(8, requested=7), now=0.0)
    assert isinstance(d, Resize) and d.target == 4
    d, _ = decide(c, FRESH, capacity(8, requested=1), now=0.0)
    assert isinstance(d, Resize) and d.target == 2
    d, _ = decide(c, FRESH, capacity(2, requested=1), now=0.0)
    assert isinstance(d, Hold) and d.until is None


# -- growing -------------------------------------------------------------------------------------


def test_steady_spare_capacity_grows_the_job_after_the_stabilisation_delay():
    c = config(scale_up_delay_s=30)
    cap = capacity(4, spares={"s/1": 3, "s/0": 2, "s/2": 3})
    state = FRESH
    for now in (100.0, 110.0, 129.9):
        d, state = decide(c, state, cap, now)
        assert d == Hold(130.0, d.reason)
    assert state.spare_since_s == 100.0
    d, state = decide(c, state, cap, now=130.0)
    assert isinstance(d, Resize) and d.target == 7 and d.joining == ("s/1", "s/0", "s/2")
    assert d.leaving == () and d.released_spares == () and d.graceful is True
    assert state.spare_since_s is None and state.num_events == 1


def test_growth_stops_at_max_ranks_the_requested_size_and_the_allowed_sizes():
    spares = {f"s/{i}": 9 for i in range(10)}
    c = config(scale_up_delay_s=0, max_ranks=12)
    assert decide(c, FRESH, capacity(4, spares=spares), 0.0)[0].target == 12
    assert decide(c, FRESH, capacity(4, spares=spares, requested=6), 0.0)[0].target == 6
    c = config(scale_up_delay_s=0, allowed_sizes=(4, 8, 16))
    d, _ = decide(c, FRESH, capacity(4, spares=spares), 0.0)
    assert d.target == 8 and len(d.joining) == 4
    d, _ = decide(c, FRESH, capacity(8, spares={"s/0": 9}), 0.0)  # 9 ranks: no allowed size
    assert d == Hold(None, d.reason)


@settings(max_examples=60, deadline=None)
@given(
    intervals=st.lists(
        st.tuples(
            st.floats(0.01, 29.99),  # spares present: always shorter than scale_up_delay_s
            st.floats(0.01, 100.0),  # spares gone
            st.lists(st.floats(0.0, 1.0), max_size=3),  # ticks inside, as fractions
        ),
        min_size=1,
        max_size=12,
    )
)
def test_capacity_that_flaps_faster_than_the_delay_never_grows_the_job(intervals):
    c = config(scale_up_delay_s=30)
    state, now = FRESH, 0.0
    for on_s, off_s, ticks in intervals:
        times = [now, *(now + f * on_s for f in sorted(ticks))]
        for t in times:  # spares present
            d, state = decide(c, state, capacity(4, spares={"s/0": 5, "s/1": 6}), t)
            assert not isinstance(d, Resize), (t, d)
        now += on_s
        for t in (now, now + off_s / 2):  # spares gone
            d, state = decide(c, state, capacity(4), t)
            assert d == Hold(None, d.reason)
        now += off_s
    # The check can fail: the same capacity held for the full delay does grow the job.
    d, state = decide(c, state, capacity(4, spares={"s/0": 5}), now)
    d, state = decide(c, state, capacity(4, spares={"s/0": 5}), now + 30.0)
    assert isinstance(d, Resize) and d.target == 5


# -- backoff -------------------------------------------------------------------------------------


class Job:
    """A toy cluster that carries out the policy's decisions, to drive it over time."""

    def __init__(self, world: int, rpn: int, num_spares: int) -> None:
        self.rpn = rpn
        self.active = {r: r // rpn for r in range(world)}
        self.vacant: dict[int, float] = {}
        self.spares = {f"s/{i}": world // rpn + i for i in range(num_spares)}
        self.requested: int | None = None
        self.world = world
        self.num_made = num_spares

    def capacity(self) -> Capacity:
        return Capacity(
            world_size=self.world,
            active=dict(self.active),
            vacant=dict(self.vacant),
            spares=dict(self.spares),
            requested_size=self.requested,
        )

    def perturb(self, action: str, arg: int, now: float) -> None:
        if action == "lose" and self.active:
            rank = sorted(self.active)[arg % len(self.active)]
            del self.active[rank]
            self.vacant[rank] = now
        elif action == "lose_node" and self.active:
            node = sorted(set(self.active.values()))[arg % len(set(self.active.values()))]
            for rank in [r for r, n in self.active.items() if n == node]:
                del self.active[rank]
                self.vacant[rank] = now
        elif action == "spare_up":
            self.spares[f"s/{self.num_made}"] = arg % 8
            self.num_made += 1
        elif action == "spare_down" and self.spares:
            del self.spares[sorted(self.spares)[arg % len(self.spares)]]
        elif action == "request":
            self.requested = 1 + arg % 16
        elif action == "unrequest":
            self.requested = None

    def apply(self, d: Replace | Resize) -> None:
        if isinstance(d, Replace):
            assert d.assignments and set(d.assignments) <= set(self.vacant)
            for rank, spare in d.assignments.items():
                self.active[rank] = self.spares.pop(spare)
                del self.vacant[rank]
            return
        assert not (d.leaving and d.joining)
        assert set(d.leaving) <= set(self.active) and len(set(d.leaving)) == len(d.leaving)
        for spare in d.released_spares + d.joining:
            assert spare in self.spares
        staying = sorted(r for r in self.active if r not in d.leaving)
        nodes = [self.active[r] for r in staying] + [self.spares[s] for s in d.joining]
        assert len(nodes) == d.target, (d, len(nodes))
        self.active = dict(enumerate(nodes))  # ranks renumbered 0 .. target - 1
        for spare in d.released_spares + d.joining:
            del self.spares[spare]
        self.vacant = {}
        self.world = d.target


@st.composite
def configs(draw) -> ElasticConfig:
    min_ranks = draw(st.integers(1, 3))
    max_ranks = draw(st.integers(min_ranks, 12))
    sizes = draw(st.none() | st.sets(st.integers(min_ranks, max_ranks), min_size=1))
    base_s = draw(st.sampled_from([0.5, 1.0, 5.0]))
    max_s = base_s * draw(st.sampled_from([1, 3, 10, 100]))
    return ElasticConfig(
        min_ranks=min_ranks,
        max_ranks=max_ranks,
        size_step=1 if sizes else draw(st.integers(1, 3)),
        allowed_sizes=tuple(sizes) if sizes else None,
        scale_up_delay_s=draw(st.sampled_from([0.0, 1.0, 10.0])),
        scale_down_wait_s=draw(st.sampled_from([0.0, 1.0, 10.0])),
        backoff_base_s=base_s,
        backoff_factor=draw(st.sampled_from([1.0, 1.5, 2.0, 3.0])),
        backoff_max_s=max_s,
        backoff_reset_s=max_s * draw(st.sampled_from([1.0, 2.0, 10.0])),
    )


ACTIONS = ["tick", "lose", "lose", "lose_node", "spare_up", "spare_up", "spare_down"]
ACTIONS += ["request", "unrequest"]


def schedule_s(c: ElasticConfig, n: int) -> float:
    """The backoff after the n-th event of a run, written out independently of the module."""
    return min(c.backoff_base_s * c.backoff_factor ** min(n - 1, 200), c.backoff_max_s)


def max_events_within(c: ElasticConfig, window_s: float) -> int:
    """Most events a window shorter than backoff_reset_s can hold: gaps of at least the schedule
    from n = 1 (a run's later gaps are only longer)."""
    count, used_s = 1, 0.0
    while used_s + schedule_s(c, count) <= window_s * (1 + 1e-9):
        used_s += schedule_s(c, count)
        count += 1
    return count


@settings(max_examples=150, deadline=None)
@given(
    c=configs(),
    start=st.tuples(st.integers(1, 12), st.sampled_from([1, 2, 4]), st.integers(0, 4)),
    steps=st.lists(
        st.tuples(
            st.floats(0.0, 20.0) | st.sampled_from([0.0, 0.5, 1.0]),
            st.sampled_from(ACTIONS),
            st.integers(0, 1000),
        ),
        max_size=60,
    ),
)
def test_scaling_events_respect_the_bounds_and_the_backoff_over_any_history(c, start, steps):
    world, rpn, num_spares = start
    job = Job(max(world, c.min_ranks), rpn, num_spares)
    state, now, events, run = FRESH, 0.0, [], 0
    for dt_s, action, arg in steps:
        now += dt_s
        job.perturb(action, arg, now)
        d, state = decide(c, state, job.capacity(), now)
        if isinstance(d, Fail):
            assert job.vacant and not job.spares
            assert largest_allowed_at_most(c, len(job.active)) is None
            break
        if isinstance(d, Hold):
            assert d.until is None or d.until > now
            if "backoff" in d.reason:  # the shell is told to call back when the schedule allows
                assert math.isclose(d.until, events[-1] + schedule_s(c, run)), (d, events, run)
            continue
        job.apply(d)
        if isinstance(d, Resize):
            assert d.target in allowed_sizes(c) and c.min_ranks <= d.target <= c.max_ranks
            run = run + 1 if events and now - events[-1] < c.backoff_reset_s else 1
            events.append(now)
    note(f"scaling events at {events}")
    target(float(len(events)), label="scaling events")  # steer the search toward busy histories

    for i in range(1, len(events)):
        # The n of the backoff after event i - 1: the events since the last gap of a reset.
        n = 1
        while n < i and events[i - n] - events[i - n - 1] < c.backoff_reset_s:
            n += 1
        gap_s = events[i] - events[i - 1]
        assert gap_s >= schedule_s(c, n) * (1 - 1e-9), (i, gap_s, n, events)
    for window_s in (c.backoff_base_s, c.backoff_max_s, c.backoff_reset_s * 0.999):
        bound = max_events_within(c, window_s)
        for t in events:
            assert sum(t <= u <= t + window_s for u in events) <= bound, (window_s, events)


def test_a_failing_node_makes_the_job_shrink_on_the_backoff_schedule_and_no_faster():
    c = config(max_ranks=200, scale_down_wait_s=0, backoff_base_s=5)
    job = Job(200, 1, 0)
    state, events = FRESH, []
    for now in range(170):  # a rank lost every second, never a spare
        job.perturb("lose", 0, float(now))
        d, state = decide(c, state, job.capacity(), float(now))
        if isinstance(d, Resize):
            job.apply(d)
            events.append(now)
        else:
            assert isinstance(d, Hold) and d.until == events[-1] + schedule_s(c, len(events))
    assert events == [0, 5, 15, 35, 75, 155] and state.num_events == 6
    d, state = decide(c, state, job.capacity(), 155.0 + 600.0)  # backoff_reset_s after the last
    assert isinstance(d, Resize) and state.num_events == 1  # the run starts over
    job.apply(d)
    job.perturb("lose", 0, 756.0)
    d, _ = decide(c, state, job.capacity(), 756.0)
    assert d == Hold(760.0, d.reason) and "backoff" in d.reason


def test_a_quiet_period_shorter_than_the_reset_keeps_the_backoff_growing():
    c = config(scale_down_wait_s=0, backoff_base_s=5, backoff_reset_s=600)
    state = PolicyState(last_event_s=0.0, num_events=3, spare_since_s=None)
    d, state = decide(c, state, capacity(8, vacant={7: 599.0}), now=599.0)
    assert isinstance(d, Resize) and state.num_events == 4
    d, _ = decide(c, state, capacity(7, vacant={6: 600.0}), now=600.0)
    assert d == Hold(599.0 + 40.0, d.reason)
    assert math.isclose(backoff_delay_s(c, 4), 40.0)
