"""The elastic scaling policy: when the job replaces, shrinks or grows, as a pure function.

The membership state machine (``launcher.membership``) knows who is alive; this module decides
what the job should do about it. One call, ``decide(config, state, capacity, now)``, looks at the
capacity (live ranks and their nodes, vacant ranks and when they were lost, idle hot spares, a
world size an operator or scheduler asked for) and returns one decision and the policy's updated
memory. No sockets, no clocks, no threads: time comes in as ``now`` (seconds on a monotonic
clock), and the same inputs always give the same decision.

The rules, first match wins:

1. Vacant ranks and idle spares: ``Replace``. Same world size, no resharding, so it is never
   delayed and is not a scaling event. Vacancies left over wait for the next call.
2. Vacant ranks and no spare: ``Hold`` until the oldest vacancy is ``scale_down_wait_s`` old (a
   flapping rank may come back, a spare may appear), then shrink to the largest allowed size the
   live ranks fill, or ``Fail`` when that is below ``min_ranks``.
3. A requested world size below the current one: a graceful shrink (ranks finish their step).
4. Spare capacity for a larger allowed size, seen at every call for ``scale_up_delay_s``: grow.
5. Otherwise ``Hold(None)``.

Shrinks and grows are scaling events: each reshards the whole job, so they are spaced by an
exponential backoff (``backoff_base_s * backoff_factor ** (n - 1)`` after the n-th event of a
run, capped at ``backoff_max_s``; ``backoff_reset_s`` without an event ends the run). A shrink
after a fault skips the scale-up stabilisation but not the backoff: a node that keeps failing
must not make the job reshard in a loop. While the backoff holds a fault-driven shrink, the
job waits short-handed (the recovery engine has already rolled back to the committed step).

The global batch need not divide by the world size: any allowed size works, because the sampler
(``dataload.sampler``) gives the first ``global_batch % world_size`` ranks one sample more and
keeps the global batch constant. To run only at sizes that divide it, list them in
``ElasticConfig.allowed_sizes``; keep ``max_ranks`` at most the global batch.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

from launcher.config import setting


@dataclass(frozen=True, slots=True, kw_only=True)
class ElasticConfig:
    """Bounds, allowed world sizes and timings of an elastic job."""

    min_ranks: int = setting(
        flag="--min-ranks", help="fewest ranks (default: the start size)", flag_default=None
    )
    """Fewest ranks the job may run with; below it (and no spare) the job fails."""
    max_ranks: int = setting(
        flag="--max-ranks",
        help="most ranks; nodes with --node-rank >= --nnodes may join up to it (default: the "
        "start size)",
        flag_default=None,
    )
    """Most ranks the job may grow to."""
    size_step: int = 1
    """Allowed sizes are ``min_ranks, min_ranks + size_step, ...`` up to ``max_ranks``."""
    allowed_sizes: tuple[int, ...] | None = setting(
        None,
        flag="--allowed-sizes",
        help="comma-separated world sizes the job may run at, e.g. 2,4,8 (default: any)",
        type=str,
    )
    """Explicit allowed sizes (e.g. divisors of the global batch); overrides ``size_step``."""
    scale_up_delay_s: float = setting(
        30.0,
        flag="--scale-up-delay",
        help="spare capacity must last this long before the job grows, seconds (default {default})",
    )
    """Spare capacity must be seen continuously this long before the job grows."""
    scale_down_wait_s: float = 10.0
    """A vacancy with no spare waits this long (for the rank or a spare) before a shrink."""
    backoff_base_s: float = 5.0
    """Least time between two scaling events (0 turns the backoff off)."""
    backoff_factor: float = 2.0
    """Each further event of a run multiplies the wait after it by this."""
    backoff_max_s: float = 300.0
    """Cap on the wait between two scaling events."""
    backoff_reset_s: float = 600.0
    """A gap this long between scaling events starts the backoff over at ``backoff_base_s``."""
    graceful_timeout_s: float = setting(
        60.0,
        flag="--graceful-timeout",
        help="time a given-back rank has to leave before it is killed, seconds (default {default})",
    )
    """Time a rank given back on request has to finish its step and leave before it is killed."""

    def __post_init__(self) -> None:
        if self.min_ranks < 1:
            raise ValueError(f"ElasticConfig.min_ranks={self.min_ranks} must be >= 1")
        if self.max_ranks < self.min_ranks:
            raise ValueError(
                f"ElasticConfig.max_ranks={self.max_ranks} must be >= min_ranks={self.min_ranks}"
            )
        if self.size_step < 1:
            raise ValueError(f"ElasticConfig.size_step={self.size_step} must be >= 1")
        if self.allowed_sizes is not None:
            sizes = tuple(sorted(set(self.allowed_sizes)))
            outside = [s for s in sizes if not self.min_ranks <= s <= self.max_ranks]
            if not sizes or outside:
                raise ValueError(
                    f"ElasticConfig.allowed_sizes={self.allowed_sizes!r} must be non-empty and "
                    f"lie within [min_ranks={self.min_ranks}, max_ranks={self.max_ranks}]; "
                    f"drop {outside} or widen the bounds"
                )
            if self.size_step != 1:
                warnings.warn(
                    f"ElasticConfig.size_step={self.size_step} is ignored: allowed_sizes is set",
                    stacklevel=3,
                )
            object.__setattr__(self, "allowed_sizes", sizes)  # frozen: normalise once, here
        for name in ("scale_up_delay_s", "scale_down_wait_s", "backoff_base_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"ElasticConfig.{name}={getattr(self, name)} must be >= 0")
        if self.backoff_factor < 1:
            raise ValueError(
                f"ElasticConfig.backoff_factor={self.backoff_factor} must be >= 1 "
                "(a backoff that shrinks is no backoff)"
            )
        if self.backoff_max_s < self.backoff_base_s:
            raise ValueError(
                f"ElasticConfig.backoff_max_s={self.backoff_max_s} must be >= "
                f"backoff_base_s={self.backoff_base_s}"
            )
        if self.backoff_reset_s <= 0 or self.backoff_reset_s < self.backoff_max_s:
            raise ValueError(
                f"ElasticConfig.backoff_reset_s={self.backoff_reset_s} must be > 0 and >= "
                f"backoff_max_s={self.backoff_max_s}, or the backoff would reset before it ends"
            )
        if self.graceful_timeout_s <= 0:
            raise ValueError(
                f"ElasticConfig.graceful_timeout_s={self.graceful_timeout_s} must be > 0"
            )


def allowed_sizes(config: ElasticConfig) -> tuple[int, ...]:
    """Every world size the job may run at, ascending.

    Args:
        config: The elastic configuration.

    Returns:
        ``config.allowed_sizes`` when given, else ``min_ranks`` up to ``max_ranks`` by
        ``size_step``.
    """
    if config.allowed_sizes is not None:
        return config.allowed_sizes
    return tuple(range(config.min_ranks, config.max_ranks + 1, config.size_step))


def largest_allowed_at_most(config: ElasticConfig, n: int) -> int | None:
    """The largest allowed world size that ``n`` ranks can fill.

    Args:
        config: The elastic configuration.
        n: Number of ranks available.

    Returns:
        The largest allowed size ``<= n``, or None when ``n`` is below the smallest one.
    """
    sizes = allowed_sizes(config)
    i = bisect.bisect_right(sizes, n)
    return sizes[i - 1] if i else None


def backoff_delay_s(config: ElasticConfig, num_events: int) -> float:
    """Least time after the ``num_events``-th scaling event of a run before the next one.

    Args:
        config: The elastic configuration.
        num_events: Scaling events in the current run (>= 1).

    Returns:
        ``min(backoff_base_s * backoff_factor ** (num_events - 1), backoff_max_s)``.
    """
    try:
        delay_s = config.backoff_base_s * config.backoff_factor ** (num_events - 1)
    except OverflowError:  # a long run of events: the cap applies anyway
        delay_s = math.inf
    return min(delay_s, config.backoff_max_s)


@dataclass(frozen=True, slots=True, kw_only=True)
class Capacity:
    """What the job has right now: the input of one decision.

    Every rank below ``world_size`` is either active or vacant, never both.
    """

    world_size: int
    """The current world size."""
    active: Mapping[int, int]
    """rank -> node of every live rank."""
    vacant: Mapping[int, float] = dataclasses.field(default_factory=dict)
    """rank -> time it was lost, for ranks lost and not yet replaced."""
    spares: Mapping[str, int] = dataclasses.field(default_factory=dict)
    """identity -> node of every idle hot spare, in the order they arrived (FIFO)."""
    requested_size: int | None = None
    """A world size an operator or scheduler asked for (e.g. to give ranks back), or None."""

    def __post_init__(self) -> None:
        ranks = sorted([*self.active, *self.vacant])
        if self.world_size < 1 or ranks != list(range(self.world_size)):
            raise ValueError(
                f"Capacity: active ranks {sorted(self.active)} and vacant ranks "
                f"{sorted(self.vacant)} must split range({self.world_size}) between them"
            )
        if self.requested_size is not None and self.requested_size < 1:
            raise ValueError(f"Capacity.requested_size={self.requested_size} must be >= 1")


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyState:
    """What the policy remembers between calls; ``decide`` returns it updated."""

    last_event_s: float | None
    """Time of the last scaling event (shrink or grow), None before the first."""
    num_events: int
    """Scaling events in the current run (gaps shorter than ``backoff_reset_s``): the n of the
    backoff."""
    spare_since_s: float | None
    """Since when spare capacity has been seen at every call, None if it was not last time."""

    @classmethod
    def initial(cls) -> PolicyState:
        """The state of a job that has not scaled yet."""
        return cls(last_event_s=None, num_events=0, spare_since_s=None)


@dataclass(frozen=True, slots=True)
class Replace:
    """Vacant ranks get spares at the same world size (not a scaling event)."""

    assignments: dict[int, str]
    """vacant rank -> identity of the spare that takes it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Resize:
    """Shrink or grow to ``target`` (a scaling event)."""

    target: int
    """The new world size, always an allowed size."""
    leaving: tuple[int, ...]
    """Active ranks that leave (a shrink), ascending."""
    released_spares: tuple[str, ...]
    """Idle spares given back (a shrink on request gives them all back first)."""
    joining: tuple[str, ...]
    """Spares that become ranks ``world_size ..`` in this order (a grow)."""
    graceful: bool
    """True when no fault forces it (a requested shrink, a grow): finish the step, lose no
    work. False for a shrink after a fault."""
    graceful_timeout_s: float
    """Time a leaving rank has to finish its step and leave before it is killed."""
    reason: str
    """One line for the event log: what changes and why."""


@dataclass(frozen=True, slots=True)
class Hold:
    """Nothing to do now."""

    until: float | None
    """When a pending decision could fire (end of a wait or of the backoff), or None."""
    reason: str
    """One line: what is pending, or why nothing is."""


@dataclass(frozen=True, slots=True)
class Fail:
    """The job cannot continue; ``reason`` is one line that names the fix."""

    reason: str


Decision = Replace | Resize | Hold | Fail


def decide(
    config: ElasticConfig, state: PolicyState, capacity: Capacity, now: float
) -> tuple[Decision, PolicyState]:
    """Decide what the job does now.

    Call it on every change of capacity and on a periodic tick: stabilisation is judged at the
    calls, so spare capacity that comes and goes between two calls is not seen to go.

    Args:
        config: The elastic configuration.
        state: The state returned by the previous call (``PolicyState.initial()`` at first).
        capacity: What the job has now.
        now: Current time in seconds, on a monotonic clock.

    Returns:
        The decision and the state to pass to the next call.

    Raises:
        ValueError: ``now`` is earlier than a time the state remembers.
    """
    for remembered in (state.last_event_s, state.spare_since_s):
        if remembered is not None and now < remembered:
            raise ValueError(
                f"decide(now={now}) is earlier than {remembered} from a previous call: pass a "
                "monotonic clock (time.monotonic())"
            )
    grow_to = _grow_target(config, capacity)
    since = (state.spare_since_s if state.spare_since_s is not None else now) if grow_to else None
    state = dataclasses.replace(state, spare_since_s=since)

    if capacity.vacant and capacity.spares:
        return Replace(_assign_spares(capacity)), state
    if capacity.vacant:
        return _after_fault(config, state, capacity, now)
    size = capacity.world_size
    requested = capacity.requested_size
    if requested is not None and requested < size:
        target = largest_allowed_at_most(config, requested) or allowed_sizes(config)[0]
        if target < size:
            return _resize_when_allowed(
                config, state, now, now, _shrink(config, capacity, target, graceful=True)
            )
    if grow_to is not None and since is not None:
        joining = tuple(capacity.spares)[: grow_to - size]
        grow = Resize(
            target=grow_to,
            leaving=(),
            released_spares=(),
            joining=joining,
            graceful=True,
            graceful_timeout_s=config.graceful_timeout_s,
            reason=f"grow from {size} to {grow_to} ranks with spares {list(joining)}",
        )
        return _resize_when_allowed(config, state, now, since + config.scale_up_delay_s, grow)
    return Hold(None, f"world size {size}: nothing to replace, shrink or grow"), state


def _grow_target(config: ElasticConfig, capacity: Capacity) -> int | None:
    """The allowed size active ranks and spares could run at, if above the world size."""
    limit = min(config.max_ranks, len(capacity.active) + len(capacity.spares))
    if capacity.requested_size is not None:
        limit = min(limit, capacity.requested_size)
    target = largest_allowed_at_most(config, limit)
    return target if target is not None and target > capacity.world_size else None


def _assign_spares(capacity: Capacity) -> dict[int, str]:
    """Vacant rank -> spare: first lost, first filled; spares off the job's nodes first.

    A spare on a node that holds no live rank puts the replacement in its own failure domain;
    otherwise spares go in arrival order.
    """
    busy_nodes = set(capacity.active.values())
    spares = sorted(capacity.spares, key=lambda s: capacity.spares[s] in busy_nodes)  # stable
    vacancies = sorted(capacity.vacant, key=lambda r: (capacity.vacant[r], r))
    return dict(sorted(zip(vacancies, spares)))


def _after_fault(
    config: ElasticConfig, state: PolicyState, capacity: Capacity, now: float
) -> tuple[Decision, PolicyState]:
    """Rule 2: vacancies and no spare: wait, then shrink to what the live ranks fill or fail."""
    vacant = sorted(capacity.vacant)
    wait_end = min(capacity.vacant.values()) + config.scale_down_wait_s
    live = len(capacity.active)
    target = largest_allowed_at_most(config, live)
    if now < wait_end:
        return Hold(
            wait_end,
            f"ranks {vacant} vacant and no spare: waiting {config.scale_down_wait_s:g}s "
            "(scale_down_wait_s) for the rank or a spare before "
            + ("shrinking" if target is not None else "failing"),
        ), state
    if target is None:
        return Fail(
            f"{live} live ranks after losing ranks {vacant} and no spare; the smallest allowed "
            f"world size is {allowed_sizes(config)[0]} (min_ranks={config.min_ranks}): add "
            "spares or lower min_ranks / allowed_sizes"
        ), state
    shrink = _shrink(config, capacity, target, graceful=False)
    return _resize_when_allowed(config, state, now, wait_end, shrink)


def _shrink(config: ElasticConfig, capacity: Capacity, target: int, graceful: bool) -> Resize:
    """A shrink to ``target``: spares go first, then whole nodes, then the higher ranks.

    Idle spares are the cheapest capacity to give back (no work lost, no resharding), so all of
    them go before any rank. Nodes with the fewest active ranks go first: emptying the smallest
    nodes first frees the most whole nodes. Among equals the higher ranks go, so the low ranks
    (rank 0 among them) keep their numbers. Vacant ranks are already gone.
    """
    by_node: dict[int, list[int]] = {}
    for rank in sorted(capacity.active, reverse=True):
        by_node.setdefault(capacity.active[rank], []).append(rank)
    nodes = sorted(by_node.values(), key=lambda ranks: (len(ranks), -ranks[0]))
    order = [rank for ranks in nodes for rank in ranks]
    leaving = tuple(sorted(order[: len(capacity.active) - target]))
    why = f"ranks {sorted(capacity.vacant)} lost with no spare"
    if graceful:
        why = f"requested world size {capacity.requested_size}"
    return Resize(
        target=target,
        leaving=leaving,
        released_spares=tuple(capacity.spares),
        joining=(),
        graceful=graceful,
        graceful_timeout_s=config.graceful_timeout_s,
        reason=f"shrink from {capacity.world_size} to {target} ranks: {why}",
    )


def _resize_when_allowed(
    config: ElasticConfig, state: PolicyState, now: float, ready_at: float, resize: Resize
) -> tuple[Decision, PolicyState]:
    """``resize`` if ``now`` is past ``ready_at`` and the backoff; else Hold until both are."""
    backoff_end = -math.inf
    if state.last_event_s is not None:
        backoff_end = state.last_event_s + backoff_delay_s(config, state.num_events)
    fire_at = max(ready_at, backoff_end)
    if now < fire_at:
        why = "backoff after recent scaling events" if fire_at == backoff_end else "stabilising"
        return Hold(fire_at, f"{resize.reason}: {why}, {fire_at - now:.1f}s more"), state
    recent = state.last_event_s is not None and now - state.last_event_s < config.backoff_reset_s
    return resize, PolicyState(
        last_event_s=now,
        num_events=state.num_events + 1 if recent else 1,
        spare_since_s=None,  # the world size changed: spare capacity is judged afresh
    )
