"""Phase timings of every fault, read from a run's event log: pure functions of plain data.

Both modes are cut into consecutive phases on one clock (CLOCK_MONOTONIC, shared by the
processes of one machine), so a fault's phases add up exactly to its **downtime**: the time from
the fault until training is back at the step it had reached when the fault hit (the step in
flight is lost in both modes).

Checkpointless (the engine's event log): ``detect`` (fault -> the coordinator's decision),
``interrupt`` (its word reaching the ranks and them leaving the step, or waiting for it),
then the slowest rank's recovery phases (``communicators``, ``plan``, ``build``, ``transfer``,
``restore``, ``data``, ``replicate``), then ``recompute`` (the steps between the restored and the
reached step, if the restored step is older).

Checkpoint-restart (``examples/train_plain.py``'s timeline under torchrun): ``terminate``
(fault -> the first new process starts), ``restart processes`` (interpreters and imports),
``init communicators``, ``build model``, ``load checkpoint``, ``warm data``, ``recompute`` (from
the checkpoint's step to the reached step).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from recovery.phases import BEFORE_RANK_PHASES as _NOT_RANK_PHASES
from recovery.phases import INTERRUPT, RANK_PHASES

Event = dict[str, Any]


@dataclass(slots=True)
class RecoveredFault:
    """A fault the engine recovered from in place: one row of a checkpointless run's report."""

    spec: str
    t_fault: float
    generation: int
    """The generation whose recovery took the job past the fault."""
    step_reached: int
    step_restored: int
    steps_lost: int
    restored_from: str | None
    phases: dict[str, float]
    """Seconds per phase, in order; they add up to ``downtime_s``."""
    downtime_s: float
    recovery_s: float | None
    """From the fault to the last rank's first step after it (``None``: none reported)."""
    bytes_received: int
    every_copy_lost: str | None = None
    """Why some shard had no copy left, when the recovery did not restore from peers (``None``:
    it did, or the run did not say; left out of the JSON then)."""
    slowest_survivor_out_s: float | None = None
    """The largest ``interrupt`` a survivor recorded: from the coordinator's word (or its own
    failed collective) to out of the step with its groups broken. The critical path can hide it
    (a spare's ``communicators`` waits for the survivors). ``None``: no survivor; left out."""


@dataclass(slots=True)
class RestartedFault:
    """A fault the checkpoint-restart baseline restarted from: one row of its report."""

    spec: str
    t_fault: float
    step_reached: int
    step_restored: int | None
    """The checkpoint's step (``None``: the restart never loaded one)."""
    steps_lost: int | None
    restored_from: str
    phases: dict[str, float]
    downtime_s: float


@dataclass(slots=True)
class CoordinatorFault:
    """A fault of the active coordinator: the training never waits for the control plane."""

    spec: str
    t_fault: float
    takeover_s: float
    steps_in_window: int
    slowest_step_ratio: float | None
    downtime_s: float = 0.0
    recovery_s: float = 0.0


@dataclass(slots=True)
class SilentFault:
    """Silent data corruption: nothing crashes, so there is nothing to recover from."""

    spec: str
    t_fault: float
    silent: bool = True


@dataclass(slots=True)
class UnmeasuredFault:
    """A fault the run has no measurement of, and why."""

    spec: str
    t_fault: float
    error: str


FaultRow = RecoveredFault | RestartedFault | CoordinatorFault | SilentFault | UnmeasuredFault
"""One fault's row of a report (its JSON form: :func:`as_json`)."""


_LEFT_OUT_WHEN_NONE = frozenset({"every_copy_lost", "slowest_survivor_out_s"})


def as_json(rows: Sequence[FaultRow]) -> list[dict[str, Any]]:
    """The rows as the report's JSON holds them (a field per key, in field order; an unset
    ``every_copy_lost`` or ``slowest_survivor_out_s`` is left out)."""
    return [
        {
            k: v
            for k, v in dataclasses.asdict(row).items()
            if v is not None or k not in _LEFT_OUT_WHEN_NONE
        }
        for row in rows
    ]


def row_from_json(doc: dict[str, Any]) -> FaultRow:
    """A row read back from :func:`as_json`'s form (its keys say which kind it is)."""
    kind: type[FaultRow]
    if "silent" in doc:
        kind = SilentFault
    elif "error" in doc:
        kind = UnmeasuredFault
    elif "takeover_s" in doc:
        kind = CoordinatorFault
    elif "generation" in doc:
        kind = RecoveredFault
    else:
        kind = RestartedFault
    return kind(**doc)


def _first(events: Sequence[Event], name: str, after: float, **match: Any) -> Event | None:
    found = [
        e
        for e in events
        if e["event"] == name and e["t"] >= after and all(e.get(k) == v for k, v in match.items())
    ]
    return min(found, key=lambda e: e["t"]) if found else None


def step_reached(steps: Sequence[tuple[float, int]], t: float) -> int:
    """The last step completed before ``t`` (0 if none): ``steps`` is ``[(time, step), ...]``."""
    return max((s for when, s in steps if when < t), default=0)


def _back_at(steps: Sequence[tuple[float, int]], step: int, after: float) -> float | None:
    """When ``step`` was completed again after ``after``."""
    times = [when for when, s in steps if s >= step and when >= after]
    return min(times) if times else None


def injected_faults(events: Sequence[Event]) -> list[tuple[str, float]]:
    """``(spec, time)`` of every injected fault (ranks dying together count once), in order."""
    first: dict[str, float] = {}
    for e in events:
        if e["event"] == "fault_injected":
            first[e["fault"]] = min(first.get(e["fault"], e["t"]), e["t"])
    return sorted(first.items(), key=lambda kv: kv[1])


def coordinator_fault(
    events: Sequence[Event],
    spec: str,
    t_fault: float,
    recoveries: Sequence[tuple[float, float]] = (),
) -> CoordinatorFault | UnmeasuredFault:
    """A fault of the active coordinator: how long until a standby took over, and how the
    training went meanwhile (it never waits for the control plane, so no recovery runs).

    ``slowest_step_ratio``: over every rank, its slowest step overlapping the window from the
    fault to the takeover, over the median of its own steps before the fault. Steps that
    overlap ``recoveries`` (``(start, end)`` of other faults' recoveries: a rank killed during
    the takeover) are left out: their time is those faults' downtime, reported in their rows.
    """
    took = next(
        (e["t"] for e in events if e["event"] == "takeover" and e["t"] >= t_fault and "term" in e),
        None,
    )
    if took is None:
        return UnmeasuredFault(spec, t_fault, "no standby took over")
    ratio: float | None = None
    in_window = 0
    for source in {e["source"] for e in events if e["event"] == "step_done"}:
        ends = sorted(e["t"] for e in events if e["event"] == "step_done" and e["source"] == source)
        durations = [(a, b - a) for a, b in itertools.pairwise(ends)]
        before = sorted(d for a, d in durations if a + d < t_fault)
        window = [
            d
            for a, d in durations
            if a + d >= t_fault
            and a <= took
            and not any(a < end and a + d > start for start, end in recoveries)
        ]
        if before and window:
            in_window = max(in_window, len(window))
            worst = max(window) / before[len(before) // 2]
            ratio = worst if ratio is None else max(ratio, worst)
    return CoordinatorFault(spec, t_fault, took - t_fault, in_window, ratio)


def _without_recovery(spec: str) -> bool:
    """A fault the ranks do not recover from: the coordinator's, or a silent one."""
    return spec.startswith(("kill-coordinator", "hang-coordinator", "bitflip"))


def _recoveries(events: Sequence[Event], faults: Sequence[float]) -> list[tuple[float, float]]:
    """``(fault, training back)`` for the faults at times ``faults``: until the first step of
    the first generation recovered after each (its last ``recovery_done`` if no step
    followed)."""
    out = []
    for t_fault in faults:
        done = [e for e in events if e["event"] == "recovery_done" and e["t"] >= t_fault]
        if not done:
            continue
        generation = min(e["generation"] for e in done)
        ends = [
            e["t"]
            for e in events
            if e["event"] in ("first_step_done", "recovery_done")
            and e.get("generation") == generation
        ]
        out.append((t_fault, max(ends)))
    return out


def not_fired(scheduled: Sequence[str], events: Sequence[Event]) -> list[str]:
    """The faults of the schedule (``str(Fault)``) that never fired in the run."""
    fired = {spec for spec, _ in injected_faults(events)}
    return [spec for spec in scheduled if spec not in fired]


def merged_downtime(faults: Sequence[FaultRow]) -> float | None:
    """Seconds of downtime over all ``faults``, counting time once where the downtimes of
    faults overlap (a fault during another's recovery).

    Silent faults have no downtime; ``None`` if a fault has no measurement (or there is none).
    """
    spans = [f for f in faults if not isinstance(f, SilentFault)]
    intervals: list[tuple[float, float]] = []
    for f in spans:
        if isinstance(f, UnmeasuredFault):
            return None
        intervals.append((f.t_fault, f.t_fault + f.downtime_s))
    if not intervals:
        return None
    intervals.sort()
    total, start, end = 0.0, *intervals[0]
    for a, b in intervals[1:]:
        if a > end:
            total += end - start
            start, end = a, b
        else:
            end = max(end, b)
    return total + end - start


def checkpointless_faults(events: Sequence[Event]) -> list[FaultRow]:
    """Per injected fault of an engine run: its phases, downtime and steps lost.

    A fault's recovery is the first generation completed after it (a fault during a recovery
    shares that recovery with the fault before it). The step a fault interrupted the training
    at is the last one any rank completed before it left the step (reported with its
    recovery), or rank 0's last step before the fault if that is later: ranks may finish a
    step in the milliseconds between a fault and its detection, and that step is redone too.
    """
    steps = [(e["t"], e["step"]) for e in events if e["event"] == "step_done"]
    out: list[FaultRow] = []
    for spec, t_fault in injected_faults(events):
        if spec.startswith("bitflip"):
            out.append(SilentFault(spec, t_fault))
            continue
        if spec.startswith(("kill-coordinator", "hang-coordinator")):
            others = [t for s, t in injected_faults(events) if not _without_recovery(s)]
            out.append(coordinator_fault(events, spec, t_fault, _recoveries(events, others)))
            continue
        seen = _first(events, "fault", t_fault)
        done = [e for e in events if e["event"] == "recovery_done" and e["t"] >= t_fault]
        if seen is None or not done:
            out.append(UnmeasuredFault(spec, t_fault, "no recovery after it"))
            continue
        generation = min(e["generation"] for e in done)
        ranks = [e for e in done if e["generation"] == generation]
        critical = max(ranks, key=lambda e: e["t"])
        reached = max(step_reached(steps, t_fault), *(e.get("step_reached", -1) for e in ranks))
        restored = critical["step"]
        phases = {"detect": max(0.0, seen["t"] - t_fault)}
        # Phases a rank reports beyond the known ones are its own time too, in the order it
        # reports them after those; left out, they would be counted as `interrupt`.
        extra = [p for p in critical["phases"] if p not in (*RANK_PHASES, *_NOT_RANK_PHASES)]
        rank_phases = {p: critical["phases"].get(p, 0.0) for p in (*RANK_PHASES, *extra)}
        span = critical["t"] - seen["t"]
        phases["interrupt"] = max(0.0, span - sum(rank_phases.values()))
        scale = 1.0 if span >= sum(rank_phases.values()) else span / sum(rank_phases.values())
        phases.update({p: v * scale for p, v in rank_phases.items()})
        end = critical["t"]
        if restored < reached:
            back = _back_at(steps, reached, critical["t"])
            end = back if back is not None else end
            phases["recompute"] = end - critical["t"]
        firsts = [
            e["t"]
            for e in events
            if e["event"] == "first_step_done" and e.get("generation") == generation
        ]
        survivors = [e["phases"][INTERRUPT] for e in ranks if INTERRUPT in e["phases"]]
        out.append(
            RecoveredFault(
                spec=spec,
                t_fault=t_fault,
                generation=generation,
                step_reached=reached,
                step_restored=restored,
                steps_lost=max(0, reached - restored),
                restored_from=critical.get("restored_from"),
                phases=phases,
                downtime_s=end - t_fault,
                recovery_s=(max(firsts) - t_fault) if firsts else None,
                bytes_received=sum(e.get("bytes_received", 0) for e in ranks),
                slowest_survivor_out_s=max(survivors, default=None),
            )
        )
    return out


def restart_faults(
    marks: Sequence[Event], kills: Sequence[tuple[str, float]]
) -> list[RestartedFault | UnmeasuredFault]:
    """Per fault of a checkpoint-restart run (``train_plain.py``'s timeline and the bench's
    own kill times): its phases, downtime and steps lost."""
    steps = [(m["t"], m["step"]) for m in marks if m["event"] == "step_done"]
    out: list[RestartedFault | UnmeasuredFault] = []
    for spec, t_fault in kills:
        started = [m["t"] for m in marks if m["event"] == "started" and m["t"] >= t_fault]
        if not started:
            out.append(UnmeasuredFault(spec, t_fault, "the job did not restart"))
            continue
        b1 = min(started)
        attempt = [m for m in marks if m["t"] >= b1]

        def latest(name: str, attempt: list[Event] = attempt) -> float | None:
            times = [m["t"] for m in attempt if m["event"] == name]
            return max(times) if times else None

        bounds = [
            ("terminate", b1),
            ("restart processes", latest("imported")),
            ("init communicators", latest("communicators")),
            ("build model", latest("model_built")),
            ("load checkpoint", latest("checkpoint_loaded")),
            ("warm data", latest("data_ready")),
        ]
        reached = step_reached(steps, t_fault)
        loaded = next((m["step"] for m in attempt if m["event"] == "checkpoint_loaded"), None)
        phases, prev = {}, t_fault
        for name, when in bounds:
            if when is None:
                break
            phases[name] = max(0.0, when - prev)
            prev = max(prev, when)
        end = prev
        if loaded is not None and loaded < reached:
            back = _back_at(steps, reached, prev)
            if back is not None:
                phases["recompute"] = back - prev
                end = back
        out.append(
            RestartedFault(
                spec=spec,
                t_fault=t_fault,
                step_reached=reached,
                step_restored=loaded,
                steps_lost=None if loaded is None else max(0, reached - loaded),
                restored_from="checkpoint",
                phases=phases,
                downtime_s=end - t_fault,
            )
        )
    return out


def timeline(events: Sequence[Event], t0: float) -> list[tuple[float, int]]:
    """``[(seconds since t0, step), ...]`` of every completed step (rank 0's view)."""
    return sorted((e["t"] - t0, e["step"]) for e in events if e["event"] == "step_done")
