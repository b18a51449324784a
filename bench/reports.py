"""The report of ``p2p-bench inject``, ``recover``, ``baseline`` and ``compare``, as named data.

A :class:`FaultRunReport` holds what the benches measured: the machine, the job, the fault
schedule, one section per mode (:class:`CheckpointlessRun`, :class:`RestartRun`, their fault rows
the dataclasses of :mod:`bench.phases`) and the bench's summary. ``to_json()`` is the document
the benches print (``--json``) and write (``report.json``): the keys, their order and their
values are the report's format, which the tests, ``bench/report.py`` and the README's figures
read; :meth:`FaultRunReport.from_json` reads one back.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from bench.phases import FaultRow, as_json, row_from_json

Json = dict[str, Any]
"""A JSON object, as written."""


@dataclass(slots=True)
class Machine:
    """What the figures were measured on."""

    hostname: str
    cpus: int | None
    platform: str
    python: str
    torch: str
    gpu: str | None
    """The CUDA device's name (``None``: no GPU)."""

    def to_json(self) -> Json:
        return dataclasses.asdict(self)


@dataclass(slots=True)
class JobInfo:
    """The job every mode of a report ran."""

    model: str
    """The preset's name, or the ``--script``'s file name."""
    nnodes: int
    nproc_per_node: int
    world_size: int
    steps: int
    checkpoint_every: int
    replicas: int
    script: str | None = None
    """A user's script and its arguments (``None``: the example job)."""
    num_params: int | None = None
    """The example job's parameters (``None`` for a script)."""
    state_mib_per_rank: float | None = None
    """Parameters and AdamW's two moments, fp32, split over the ranks (the example job's)."""
    device: str = "cpu"
    """Where the ranks trained: ``cpu`` (gloo) or ``cuda`` (NCCL, emulated nodes sharing the
    machine's GPUs)."""

    def to_json(self, spares: list[int] | None = None) -> Json:
        """The ``job`` object; ``spares`` (the checkpointless run's) last, when given."""
        out: Json = {} if self.script is None else {"script": self.script}
        out["model"] = self.model
        if self.num_params is not None:
            out["num_params"] = self.num_params
            out["state_mib_per_rank"] = self.state_mib_per_rank
        out.update(
            nnodes=self.nnodes,
            nproc_per_node=self.nproc_per_node,
            world_size=self.world_size,
            steps=self.steps,
            checkpoint_every=self.checkpoint_every,
            replicas=self.replicas,
        )
        if self.device != "cpu":
            out["device"] = self.device
        if spares is not None:
            out["spares"] = spares
        return out

    @classmethod
    def from_json(cls, doc: Json) -> JobInfo:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in doc.items() if k in names})


@dataclass(slots=True)
class CheckpointlessRun:
    """The engine's run under p2p-run with the faults, and its bitwise check."""

    wall_s: float
    exit_codes: list[int]
    """One per node."""
    spares: list[int]
    """Hot spares per node."""
    replicas: int
    faults: list[FaultRow]
    """Per fired fault, ``t_fault`` in seconds since the run started."""
    not_fired: list[str]
    """Faults of the schedule that never fired: the run did not test them."""
    timeline: list[tuple[float, int]]
    """``(seconds since the start, step)`` of every completed step."""
    run_dir: str
    bitwise_equal: bool | None = None
    """The final state against the fault-free run (``None``: not checked)."""
    differences: list[str] = field(default_factory=list)
    error: str | None = None
    """The end of node 0's output when a node that no fault took down failed."""
    reference_wall_s: float | None = None
    """The fault-free run's wall time (``None``: no reference run)."""

    def to_json(self) -> Json:
        out: Json = {
            "wall_s": self.wall_s,
            "exit_codes": self.exit_codes,
            "spares": self.spares,
            "replicas": self.replicas,
            "faults": as_json(self.faults),
            "not_fired": self.not_fired,
            "timeline": self.timeline,
            "bitwise_equal": self.bitwise_equal,
            "differences": self.differences,
            "run_dir": self.run_dir,
        }
        if self.error is not None:
            out["error"] = self.error
        if self.reference_wall_s is not None:
            out["reference_wall_s"] = self.reference_wall_s
        return out

    @classmethod
    def from_json(cls, doc: Json) -> CheckpointlessRun:
        return cls(
            wall_s=doc["wall_s"],
            exit_codes=doc["exit_codes"],
            spares=doc["spares"],
            replicas=doc["replicas"],
            faults=[row_from_json(f) for f in doc["faults"]],
            not_fired=doc["not_fired"],
            timeline=[(t, step) for t, step in doc["timeline"]],
            run_dir=doc["run_dir"],
            bitwise_equal=doc["bitwise_equal"],
            differences=doc["differences"],
            error=doc.get("error"),
            reference_wall_s=doc.get("reference_wall_s"),
        )


@dataclass(slots=True)
class RestartRun:
    """The checkpoint-restart baseline under torchrun with the same faults."""

    wall_s: float
    exit_codes: list[int]
    """torchrun's."""
    faults: list[FaultRow]
    timeline: list[tuple[float, int]]
    """Rank 0's completed steps, as :attr:`CheckpointlessRun.timeline`."""
    checkpoint_every: int
    error: str | None = None
    """The end of the run's output when it failed."""

    @property
    def bitwise_equal(self) -> None:
        """Never checked: the baseline is not the engine's run."""
        return None

    @property
    def not_fired(self) -> list[str]:
        """The bench kills the processes itself: every fault fires."""
        return []

    def to_json(self) -> Json:
        out: Json = {
            "wall_s": self.wall_s,
            "exit_codes": self.exit_codes,
            "faults": as_json(self.faults),
            "timeline": self.timeline,
            "bitwise_equal": self.bitwise_equal,
            "checkpoint_every": self.checkpoint_every,
        }
        if self.error is not None:
            out["error"] = self.error
        return out

    @classmethod
    def from_json(cls, doc: Json) -> RestartRun:
        return cls(
            wall_s=doc["wall_s"],
            exit_codes=doc["exit_codes"],
            faults=[row_from_json(f) for f in doc["faults"]],
            timeline=[(t, step) for t, step in doc["timeline"]],
            checkpoint_every=doc["checkpoint_every"],
            error=doc.get("error"),
        )


ModeRun = CheckpointlessRun | RestartRun


@dataclass(slots=True)
class InjectSummary:
    """``p2p-bench inject``'s figures."""

    downtime_checkpointless_s: float | None
    """Over all faults, overlapping downtimes counted once (``None``: a fault unmeasured)."""
    bitwise_equal: bool | None
    notes: list[str]


@dataclass(slots=True)
class RecoverSummary:
    """``p2p-bench recover``'s figures: its first measured fault's."""

    phases_ms: dict[str, float]
    recovery_s: float | None
    """From the fault to the last rank's first step after it."""
    downtime_checkpointless_s: float | None
    bytes_received: int | None
    bitwise_equal: bool | None
    notes: list[str]


@dataclass(slots=True)
class CompareSummary:
    """``p2p-bench compare``'s figures."""

    downtime_checkpointless_s: float | None
    downtime_restart_s: float | None
    downtime_reduction_pct: float | None
    """``100 * (1 - checkpointless / restart)``, one decimal."""
    bitwise_equal: bool | None
    notes: list[str]


@dataclass(slots=True)
class BaselineSummary:
    """``p2p-bench baseline``'s figures."""

    downtime_restart_s: float | None
    steps_lost: list[int | None]
    """Per fault, in order (``None``: not measured)."""
    notes: list[str]


Summary = InjectSummary | RecoverSummary | CompareSummary | BaselineSummary

_SUMMARIES: dict[str, tuple[type[Summary], ...]] = {
    "inject": (RecoverSummary, InjectSummary),  # recover writes an inject report
    "baseline": (BaselineSummary,),
    "compare": (CompareSummary,),
}


@dataclass(slots=True)
class FaultRunReport:
    """One run of a fault benchmark: its frame, its modes and its summary."""

    kind: str
    """``inject`` (also ``recover``'s), ``baseline`` or ``compare``."""
    command: str
    """The command line that made it."""
    created: str
    """UTC, ISO 8601, to the second."""
    machine: Machine
    job: JobInfo
    faults: list[str]
    """The schedule, as ``str(Fault)``."""
    checkpointless: CheckpointlessRun | None = None
    restart: RestartRun | None = None
    summary: Summary | None = None
    """Filled in last (its notes read the rest)."""

    @property
    def modes(self) -> dict[str, ModeRun]:
        """The modes that ran, by name, checkpointless first."""
        runs: dict[str, ModeRun | None] = {
            "checkpointless": self.checkpointless,
            "restart": self.restart,
        }
        return {name: run for name, run in runs.items() if run is not None}

    def to_json(self) -> Json:
        """The document the benches print and write."""
        spares = None if self.checkpointless is None else self.checkpointless.spares
        return {
            "kind": self.kind,
            "command": self.command,
            "created": self.created,
            "machine": self.machine.to_json(),
            "job": self.job.to_json(spares),
            "faults": self.faults,
            "modes": {name: run.to_json() for name, run in self.modes.items()},
            "summary": {} if self.summary is None else dataclasses.asdict(self.summary),
        }

    @classmethod
    def from_json(cls, doc: Json) -> FaultRunReport:
        """A report read back from its document (``KeyError``: a key it needs is missing)."""
        modes = doc["modes"]
        summary: Summary | None = None
        if doc["summary"]:
            keys = set(doc["summary"])
            kinds = _SUMMARIES.get(doc["kind"], ())
            for kind in kinds:
                if keys == {f.name for f in dataclasses.fields(kind)}:
                    summary = kind(**doc["summary"])
                    break
            else:
                raise KeyError(f"a {doc['kind']} summary with keys {sorted(keys)}")
        return cls(
            kind=doc["kind"],
            command=doc["command"],
            created=doc["created"],
            machine=Machine(**doc["machine"]),
            job=JobInfo.from_json(doc["job"]),
            faults=doc["faults"],
            checkpointless=(
                CheckpointlessRun.from_json(modes["checkpointless"])
                if "checkpointless" in modes
                else None
            ),
            restart=RestartRun.from_json(modes["restart"]) if "restart" in modes else None,
            summary=summary,
        )


@dataclass(slots=True)
class InPlaceResize:
    """One resize of ``p2p-bench resize``'s in-place run: its last rank ready to train."""

    from_size: int
    to_size: int
    step: int
    """The step the job resumed from."""
    resize_s: float
    """From the first rank that was training stopping to the last rank ready."""
    phases_ms: dict[str, float]
    """The last rank's phases."""
    bytes_received: int
    """Over every rank."""

    def to_json(self) -> Json:
        return {
            "from": self.from_size,
            "to": self.to_size,
            "step": self.step,
            "resize_s": self.resize_s,
            "phases_ms": self.phases_ms,
            "bytes_received": self.bytes_received,
        }


@dataclass(slots=True)
class InPlaceRun:
    """The in-place run: it grows into a spare, then gives a rank back."""

    exit_codes: list[int]
    grow: InPlaceResize | None = None
    shrink: InPlaceResize | None = None
    """``None``: the resize did not complete."""

    def to_json(self) -> Json:
        out: Json = {"exit_codes": self.exit_codes}
        for label, resize in (("grow", self.grow), ("shrink", self.shrink)):
            if resize is not None:
                out[label] = resize.to_json()
        return out


@dataclass(slots=True)
class DcpResize:
    """One resize through a DCP checkpoint: save, every process exits, restart and load."""

    from_size: int
    to_size: int
    exit_codes: list[int]
    """The run that saved, then the run that loaded."""
    save_s: float
    stop_s: float
    restart_and_load_s: float
    """From the restarted job's start to its first batch ready."""
    resize_s: float

    def to_json(self) -> Json:
        return {
            "from": self.from_size,
            "to": self.to_size,
            "exit_codes": self.exit_codes,
            "save_s": self.save_s,
            "stop_s": self.stop_s,
            "restart_and_load_s": self.restart_and_load_s,
            "resize_s": self.resize_s,
        }


@dataclass(slots=True)
class ResizeReport:
    """``p2p-bench resize``: each resize in place against the same resize through DCP."""

    model: str
    in_place: InPlaceRun
    dcp_grow: DcpResize | None = None
    dcp_shrink: DcpResize | None = None
    """``None``: not measured (``--no-dcp``)."""

    def in_place_of(self, label: str) -> InPlaceResize | None:
        """The in-place ``grow`` or ``shrink``."""
        return self.in_place.grow if label == "grow" else self.in_place.shrink

    def dcp_of(self, label: str) -> DcpResize | None:
        """The ``grow`` or ``shrink`` through DCP."""
        return self.dcp_grow if label == "grow" else self.dcp_shrink

    def speedup_vs_dcp(self, label: str) -> float | None:
        """How many times faster in place than through DCP, one decimal."""
        ours, theirs = self.in_place_of(label), self.dcp_of(label)
        if ours is None or theirs is None or not ours.resize_s or not theirs.resize_s:
            return None
        return round(theirs.resize_s / ours.resize_s, 1)

    @property
    def resize_speedup_vs_dcp(self) -> float | None:
        """The smaller speedup of the two directions (``None`` unless both were measured)."""
        speedups = [self.speedup_vs_dcp(label) for label in ("grow", "shrink")]
        return min(s for s in speedups if s) if all(speedups) else None

    def to_json(self) -> Json:
        """The object ``p2p-bench resize --json`` prints."""
        dcp = {
            label: run.to_json()
            for label, run in (("grow", self.dcp_grow), ("shrink", self.dcp_shrink))
            if run is not None
        }
        out: Json = {"model": self.model, "in_place": self.in_place.to_json(), "dcp": dcp}
        for label in ("grow", "shrink"):
            ours, theirs = self.in_place_of(label), self.dcp_of(label)
            out[f"{label}_resize_s"] = None if ours is None else ours.resize_s
            out[f"{label}_resize_dcp_s"] = None if theirs is None else theirs.resize_s
            out[f"{label}_speedup_vs_dcp"] = self.speedup_vs_dcp(label)
        out["resize_speedup_vs_dcp"] = self.resize_speedup_vs_dcp
        return out


@dataclass(slots=True)
class HostileReport:
    """``p2p-bench hostile``: hostile input against a real coordinator, and what it changed."""

    tried_by_kind: dict[str, int]
    """Messages sent, per kind of attack."""
    tried_total: int
    crashes: int
    """1 if the coordinator process died or stopped the job."""
    state_changes_from_unauthenticated: int
    """Members the coordinator admitted beyond the two legitimate agents."""
    resizes_without_operator_key: int
    members: list[str]
    dropped: int
    """Messages the coordinator dropped."""
    peak_coordinator_rss_mb: float
    flood_sockets: int
    flood_s: float
    legit_lost_events: int
    """Times a legitimate agent was taken for lost during the flood."""
    squatted_identity_answered: bool
    """The owner of a name a squatter connected with first was welcomed all the same."""
    squatter_messages_received: int
    refused_connections: int
    over_quota: int

    @property
    def passed(self) -> bool:
        """No crash, no change of state or size from hostile input, nothing to the squatter."""
        return (
            self.crashes == 0
            and self.state_changes_from_unauthenticated == 0
            and self.resizes_without_operator_key == 0
            and self.squatter_messages_received == 0
        )

    def to_json(self) -> Json:
        return dataclasses.asdict(self)


@dataclass(slots=True)
class Takeover:
    """A standby coordinator taking over from the SIGKILLed active one, at one job size."""

    takeover_ms_p50: float
    """Per member, from the kill until it adopted the standby and sent it a heartbeat."""
    takeover_ms_p99: float
    takeover_timeout_s: float
    """The silence the standby waits for before it asks for votes."""
    takeover_members: int
    takeover_votes: int
    takeover_not_told: int
    """Members that switched on a later message of the new term (should be 0)."""
    election_ms: float
    """From the kill to the standby's ``takeover`` event."""
    unexpected_faults: int = 0
    """Members the standby took for lost after it took over (should be 0)."""


@dataclass(slots=True)
class ControlPlaneSize:
    """``p2p-bench control-plane``'s figures at one job size (``nan``: not measured)."""

    ranks: int
    coordinator_cpu_share: float
    heartbeats_per_s: float
    heartbeats_per_s_configured: float
    detect_ms_p50: float
    detect_ms_p99: float
    generation_ms_p50: float
    generation_ms_p99: float
    hang_detect_s_p50: float
    hang_detect_s_max: float
    heartbeat_timeout_s: float
    exit_trials: int
    unexpected_faults: int
    """Faults of members the bench did not stop, by either coordinator (should be 0)."""
    takeover: Takeover | None = None
    """``None``: ``--no-takeover``."""

    def to_json(self) -> Json:
        """The size's object: the takeover's figures before ``unexpected_faults``, and the
        standby's own unexpected faults last."""
        out: Json = {
            "ranks": self.ranks,
            "coordinator_cpu_share": self.coordinator_cpu_share,
            "heartbeats_per_s": self.heartbeats_per_s,
            "heartbeats_per_s_configured": self.heartbeats_per_s_configured,
            "detect_ms_p50": self.detect_ms_p50,
            "detect_ms_p99": self.detect_ms_p99,
            "generation_ms_p50": self.generation_ms_p50,
            "generation_ms_p99": self.generation_ms_p99,
            "hang_detect_s_p50": self.hang_detect_s_p50,
            "hang_detect_s_max": self.hang_detect_s_max,
            "heartbeat_timeout_s": self.heartbeat_timeout_s,
            "exit_trials": self.exit_trials,
        }
        if self.takeover is not None:
            figures = dataclasses.asdict(self.takeover)
            standby_faults = figures.pop("unexpected_faults")
            out.update(figures)
        out["unexpected_faults"] = self.unexpected_faults
        if self.takeover is not None:
            out["takeover_unexpected_faults"] = standby_faults
        return out


@dataclass(slots=True)
class ControlPlaneReport:
    """``p2p-bench control-plane``: one :class:`ControlPlaneSize` per ``--ranks``."""

    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    takeover_timeout_s: float | None
    """``None``: ``--no-takeover``."""
    sizes: list[ControlPlaneSize]
    command: str

    def to_json(self) -> Json:
        return {
            "benchmark": "control-plane",
            "heartbeat_interval_s": self.heartbeat_interval_s,
            "heartbeat_timeout_s": self.heartbeat_timeout_s,
            "takeover_timeout_s": self.takeover_timeout_s,
            "sizes": [size.to_json() for size in self.sizes],
            "command": self.command,
        }
