"""The reports of ``p2p-bench replicate``, ``data``, ``rendezvous``, ``gpu-check`` and
``scale-report``, as named data.

As in :mod:`bench.reports`, each report's ``to_json()`` is the document its bench prints
(``--json``) and writes (``report.json``): the keys, their order and their values are the
report's format, which the tests, the renderers and the README's figures read; ``from_json()``
reads one back. Ratios of two figures of the same run are properties, written beside them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from bench.reports import Json, Machine
from bench.scale_model import Input


@dataclass(slots=True)
class RoundTimes:
    """The median replication round during training, part by part, in milliseconds."""

    copy: float
    checksum: float
    transfer: float
    headers_and_commit: float
    post: float = 0.0
    """Posting the transfers, on the training thread like the copy."""


@dataclass(slots=True)
class HostInfo:
    """The host a CPU-only bench ran on, in short."""

    cpus: int | None
    python: str
    torch: str


@dataclass(slots=True)
class ReplicateReport:
    """``p2p-bench replicate``: replication against a plain send/recv, a step and a memcpy.

    Bandwidths are medians over every rank's rounds in GB/s; step times are medians of the
    slowest rank's step in milliseconds.
    """

    model: str
    num_params: int
    world_size: int
    ranks_per_node: int
    device: str
    """``cpu`` or ``cuda``: where the ranks train."""
    replication_backend: str
    replica_memory: str
    snapshot_mib_per_rank: float
    chunk_mib: float
    replication_gbps: float
    """The replicator's transfer alone."""
    raw_sendrecv_gbps: float
    """One plain isend/irecv of the same bytes on the same process group."""
    round_gbps: float
    """The whole round: transfer, checksum, headers and commit."""
    step_time_ms_off: float
    step_time_ms_on: float
    snapshot_gbps: float
    """The snapshot copy of the live state, on rank 0 alone."""
    memcpy_gbps: float
    """A plain copy of one buffer of the same size."""
    round_ms_in_training: RoundTimes
    measured_steps_per_mode: int
    machine: HostInfo
    command: str

    @property
    def replication_vs_raw(self) -> float:
        return self.replication_gbps / self.raw_sendrecv_gbps

    @property
    def overhead_pct(self) -> float:
        """How much longer a step takes with replication on, in percent."""
        return (self.step_time_ms_on / self.step_time_ms_off - 1) * 100

    @property
    def snapshot_vs_memcpy(self) -> float:
        return self.snapshot_gbps / self.memcpy_gbps

    def to_json(self) -> Json:
        """The object ``p2p-bench replicate --json`` prints."""
        return {
            "benchmark": "replicate",
            "model": self.model,
            "num_params": self.num_params,
            "world_size": self.world_size,
            "ranks_per_node": self.ranks_per_node,
            "device": self.device,
            "replication_backend": self.replication_backend,
            "replica_memory": self.replica_memory,
            "snapshot_mib_per_rank": self.snapshot_mib_per_rank,
            "chunk_mib": self.chunk_mib,
            "replication_gbps": self.replication_gbps,
            "raw_sendrecv_gbps": self.raw_sendrecv_gbps,
            "replication_vs_raw": self.replication_vs_raw,
            "round_gbps": self.round_gbps,
            "step_time_ms_off": self.step_time_ms_off,
            "step_time_ms_on": self.step_time_ms_on,
            "overhead_pct": self.overhead_pct,
            "snapshot_gbps": self.snapshot_gbps,
            "memcpy_gbps": self.memcpy_gbps,
            "snapshot_vs_memcpy": self.snapshot_vs_memcpy,
            "round_ms_in_training": dataclasses.asdict(self.round_ms_in_training),
            "measured_steps_per_mode": self.measured_steps_per_mode,
            "machine": dataclasses.asdict(self.machine),
            "command": self.command,
        }

    @classmethod
    def from_json(cls, doc: Json) -> ReplicateReport:
        """A report read back from its document (``KeyError``: a key it needs is missing)."""
        nested = {"round_ms_in_training", "machine"}
        figures = {f.name: doc[f.name] for f in dataclasses.fields(cls) if f.name not in nested}
        return cls(
            **figures,
            round_ms_in_training=RoundTimes(**doc["round_ms_in_training"]),
            machine=HostInfo(**doc["machine"]),
        )


@dataclass(slots=True)
class DataReport:
    """``p2p-bench data``: a replacement rank's first batch from the node cache against the
    same batch re-read and re-tokenised from the source."""

    corpus_mb: float
    documents: int
    samples: int
    seq_len: int
    cache_build_s: float
    """Building the node's cache, once before any fault (in neither figure)."""
    first_batch_from_source_s: float
    first_batch_from_cache_s: float
    samples_per_s_cache: float
    samples_per_s_source: float
    """Samples produced per second of tokenising the whole corpus."""
    command: str

    @property
    def first_batch_speedup(self) -> float:
        return self.first_batch_from_source_s / self.first_batch_from_cache_s

    def to_json(self) -> Json:
        """The object ``p2p-bench data --json`` prints."""
        return {
            "benchmark": "data",
            "corpus_mb": self.corpus_mb,
            "documents": self.documents,
            "samples": self.samples,
            "seq_len": self.seq_len,
            "cache_build_s": self.cache_build_s,
            "first_batch_from_source_s": self.first_batch_from_source_s,
            "first_batch_from_cache_s": self.first_batch_from_cache_s,
            "first_batch_speedup": self.first_batch_speedup,
            "samples_per_s_cache": self.samples_per_s_cache,
            "samples_per_s_source": self.samples_per_s_source,
            "command": self.command,
        }

    @classmethod
    def from_json(cls, doc: Json) -> DataReport:
        """A report read back from its document (``KeyError``: a key it needs is missing)."""
        return cls(**{f.name: doc[f.name] for f in dataclasses.fields(cls)})


@dataclass(slots=True)
class RendezvousPattern:
    """One way of forming a gloo group through the store, per group (see
    :mod:`bench.rendezvous_bench`)."""

    address_bytes: int
    """One member's address as gloo writes it."""
    requests: int
    """Every member's write and reads."""
    reply_mb: float
    """Addresses read, all members together."""
    store_cpu_s: float
    """The store process's CPU time, scaled to every member's reads."""
    wall_s: float
    """Elapsed with the bench's clients, scaled the same way."""
    replayed_members: int
    """Members whose reads were replayed (the rest scaled from them)."""


@dataclass(slots=True)
class RendezvousSize:
    """Torch's default way and the engine's at one group size."""

    members: int
    default: RendezvousPattern
    engine: RendezvousPattern
    lazy: RendezvousPattern | None = None
    """The engine's way with ``--lazy-gloo`` (reports from before it have none)."""

    @property
    def store_cpu_ratio(self) -> float:
        return self.default.store_cpu_s / max(self.engine.store_cpu_s, 1e-9)

    @property
    def lazy_ratio(self) -> float:
        """Store CPU, the engine's way over its lazy one."""
        assert self.lazy is not None
        return self.engine.store_cpu_s / max(self.lazy.store_cpu_s, 1e-9)


@dataclass(slots=True)
class RendezvousReport:
    """``p2p-bench rendezvous``: what forming one gloo group costs the rendezvous store."""

    sizes: list[RendezvousSize]
    clients: int
    machine: HostInfo
    command: str

    def to_json(self) -> Json:
        """The object ``p2p-bench rendezvous --json`` prints."""
        return {
            "benchmark": "rendezvous",
            "clients": self.clients,
            "sizes": [
                {
                    "members": s.members,
                    "default": dataclasses.asdict(s.default),
                    "engine": dataclasses.asdict(s.engine),
                    "store_cpu_ratio": s.store_cpu_ratio,
                    **(
                        {"lazy": dataclasses.asdict(s.lazy), "lazy_ratio": s.lazy_ratio}
                        if s.lazy is not None
                        else {}
                    ),
                }
                for s in self.sizes
            ],
            "machine": dataclasses.asdict(self.machine),
            "command": self.command,
        }

    @classmethod
    def from_json(cls, doc: Json) -> RendezvousReport:
        """A report read back from its document (``KeyError``: a key it needs is missing)."""
        return cls(
            sizes=[
                RendezvousSize(
                    s["members"],
                    RendezvousPattern(**s["default"]),
                    RendezvousPattern(**s["engine"]),
                    RendezvousPattern(**s["lazy"]) if "lazy" in s else None,
                )
                for s in doc["sizes"]
            ],
            clients=doc["clients"],
            machine=HostInfo(**doc["machine"]),
            command=doc["command"],
        )


CheckResult = Json | list[Json]
"""What a check of ``p2p-bench gpu-check`` measured, as it wrote it."""


@dataclass(slots=True)
class CheckError:
    """A check of ``p2p-bench gpu-check`` that raised: no figures, and no verdict."""

    error: str
    """``Type: message``."""
    traceback: str | None = None

    def to_json(self) -> Json:
        out: Json = {"error": self.error}
        if self.traceback is not None:
            out["traceback"] = self.traceback
        return out

    @staticmethod
    def describes(section: object) -> bool:
        """Whether a section of a report's document is the error of a check that raised (a
        check's own figures may hold an ``error`` beside their verdict, ``passed``)."""
        return isinstance(section, dict) and "error" in section and "passed" not in section


#: The keys of a gpu-check document before its checks.
_GPU_CHECK_HEADER = ("benchmark", "cuda", "device", "num_gpus", "machine", "command")


@dataclass(slots=True)
class GpuCheckReport:
    """``p2p-bench gpu-check`` on a machine with CUDA: each check's result, in the order run.

    The bench writes the report after every check, so a run cut short leaves the checks it
    finished and no :attr:`not_measured`.
    """

    device: str
    """The CUDA device's name."""
    num_gpus: int
    machine: Machine
    command: str
    checks: dict[str, CheckResult | CheckError] = field(default_factory=dict)
    """By name (``copies``, ``checksum``, ... ``unit_tests``): the check's own JSON value,
    as :mod:`bench.gpu_check` and :mod:`bench.gpu_state_checks` return it, or its error."""
    not_measured: list[str] | None = None
    """What the run could not measure (``None``: the run has not finished)."""

    def section(self, name: str) -> Json:
        """A check's figures (empty if it did not run or raised)."""
        value = self.checks.get(name)
        return value if isinstance(value, dict) else {}

    @property
    def errors(self) -> dict[str, CheckError]:
        """The checks that raised, by name."""
        return {k: v for k, v in self.checks.items() if isinstance(v, CheckError)}

    @property
    def passed(self) -> bool:
        """Whether every check with a verdict passed (timings have none)."""
        # A check that raised has no verdict, and none is assumed; nor is one for figures
        # that hold an error.
        if self.errors or any("error" in self.section(name) for name in self.checks):
            return False
        restores = self.checks.get("bitwise_restore", [])
        return bool(
            self.section("unit_tests").get("passed", True)
            and all(r["passed"] for r in (restores if isinstance(restores, list) else []))
            and self.section("stream_race").get("passed", True)
            and self.section("kill_and_recover").get("passed", True)
        )

    def to_json(self) -> Json:
        """The document ``p2p-bench gpu-check`` writes (``report.json``) and prints."""
        out: Json = {
            "benchmark": "gpu-check",
            "cuda": True,
            "device": self.device,
            "num_gpus": self.num_gpus,
            "machine": self.machine.to_json(),
            "command": self.command,
        }
        for name, value in self.checks.items():
            out[name] = value.to_json() if isinstance(value, CheckError) else value
        if self.not_measured is not None:
            out["not_measured"] = self.not_measured
        return out

    @classmethod
    def from_json(cls, doc: Json) -> GpuCheckReport:
        """A report read back from its document, one cut short included (``KeyError``: a key
        of the header is missing, as in the document of a machine without CUDA)."""
        rest = {k: v for k, v in doc.items() if k not in _GPU_CHECK_HEADER}
        not_measured = rest.pop("not_measured", None)
        checks: dict[str, CheckResult | CheckError] = {
            name: CheckError(value["error"], value.get("traceback"))
            if CheckError.describes(value)
            else value
            for name, value in rest.items()
        }
        return cls(
            device=doc["device"],
            num_gpus=doc["num_gpus"],
            machine=Machine(**doc["machine"]),
            command=doc["command"],
            checks=checks,
            not_measured=not_measured,
        )


@dataclass(slots=True)
class ScaleJob:
    """The job ``p2p-bench scale-report`` models."""

    gpus: int
    gpus_per_node: int
    model: str
    """A preset's name, or ``custom`` (``--params``)."""
    hardware: str
    replicas: list[int]
    """Every ``k`` modelled; the first is the headline's."""
    checkpoint_every_min: float
    fallback_checkpoint_every_min: float
    storage: str
    replica_memory: str
    placement: str
    step_s: float
    state_gib_per_gpu: float
    lazy_gloo: bool = False
    """Its gloo groups connect pairs on first use (``--lazy-gloo``, or by default at its size)."""


@dataclass(slots=True)
class ValidationRow:
    """A modelled phase sum against the same one measured on this machine."""

    name: str
    kind: str
    """``calibration``: the run the fixed costs come from; ``held-out``: one the model never
    saw."""
    predicted_s: float
    measured_s: float
    error_pct: float
    """``100 * (predicted - measured) / measured``, one decimal."""


@dataclass(slots=True)
class WorstHeldOut:
    """The held-out validation row furthest from its measurement."""

    name: str
    error_pct: float


@dataclass(slots=True)
class ScaleHeadline:
    """The report's figures for its first ``k``; ranges are ``(low, high)`` from the inputs'
    bounds."""

    replicas: int
    recovery_s: float
    recovery_range_s: tuple[float, float]
    downtime_reduction_pct: float
    downtime_reduction_range_pct: tuple[float, float]
    goodput_pct: float
    goodput_range_pct: tuple[float, float]
    goodput_restart_pct: float
    goodput_restart_range_pct: tuple[float, float]
    validation_worst_held_out: WorstHeldOut
    validation_within_25_pct: int
    validation_rows: int

    @classmethod
    def from_json(cls, doc: Json) -> ScaleHeadline:
        values = {f.name: doc[f.name] for f in dataclasses.fields(cls)}
        for name, value in values.items():
            if name.endswith("_range_s") or name.endswith("_range_pct"):
                values[name] = (value[0], value[1])
        values["validation_worst_held_out"] = WorstHeldOut(**doc["validation_worst_held_out"])
        return cls(**values)


@dataclass(slots=True)
class Scenario:
    """One way of getting back to training after a fault (or a resize), modelled."""

    recovery_s: float
    """From the fault to training again."""
    downtime_s: float
    """What the job loses per fault, lost work included."""
    recovery_gpu_fault_s: float | None = None
    recovery_node_fault_s: float | None = None
    phases_s: dict[str, float] | None = None
    downtime_reduction_pct: float | None = None
    """Against checkpoint-restart."""
    note: str | None = None

    def to_json(self) -> Json:
        """The figures the scenario has, in field order."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass(slots=True)
class ScaleSize:
    """The headline's ``k`` modelled at one of :data:`bench.scale_report.SIZES`."""

    gpus: int
    recovery_s: float
    restart_downtime_s: float
    control_plane: str
    """Where the control plane's figure at this size comes from."""


@dataclass(slots=True)
class ScaleReport:
    """``p2p-bench scale-report``: recovery time, goodput and memory of a job at scale,
    modelled from figures measured here and published ones (``docs/scale-model.md``)."""

    created: str
    """UTC, ISO 8601, to the second."""
    command: str
    job: ScaleJob
    headline: ScaleHeadline
    inputs: dict[str, Input]
    """Every input of the model at the job's size, by name, sorted."""
    validation_inputs: dict[str, Input]
    """The inputs of this machine the validation rows use."""
    validation: list[ValidationRow]
    scenarios: dict[str, Scenario]
    goodput: dict[str, Json]
    """Per scenario: a month of faults (:func:`bench.scale_goodput.simulate`'s figures) and
    the overheads."""
    memory: list[Json]
    """Per ``k``: :func:`bench.scale_model.memory`."""
    sensitivity: dict[str, list[Json]]
    """Per result: :func:`bench.scale_model.sensitivity`'s rows, largest swing first."""
    sizes: list[ScaleSize]

    def to_json(self) -> Json:
        """The document ``p2p-bench scale-report`` writes and prints."""
        return {
            "kind": "scale-report",
            "created": self.created,
            "command": self.command,
            "job": dataclasses.asdict(self.job),
            "headline": dataclasses.asdict(self.headline),
            "inputs": {k: v.as_dict() for k, v in self.inputs.items()},
            "validation_inputs": {k: v.as_dict() for k, v in self.validation_inputs.items()},
            "validation": [dataclasses.asdict(row) for row in self.validation],
            "scenarios": {k: v.to_json() for k, v in self.scenarios.items()},
            "goodput": self.goodput,
            "memory": self.memory,
            "sensitivity": self.sensitivity,
            "sizes": [dataclasses.asdict(size) for size in self.sizes],
        }

    @classmethod
    def from_json(cls, doc: Json) -> ScaleReport:
        """A report read back from its document (``KeyError``: a key it needs is missing)."""
        return cls(
            created=doc["created"],
            command=doc["command"],
            job=ScaleJob(**doc["job"]),
            headline=ScaleHeadline.from_json(doc["headline"]),
            inputs={k: Input(**v) for k, v in doc["inputs"].items()},
            validation_inputs={k: Input(**v) for k, v in doc["validation_inputs"].items()},
            validation=[ValidationRow(**row) for row in doc["validation"]],
            scenarios={k: Scenario(**v) for k, v in doc["scenarios"].items()},
            goodput=doc["goodput"],
            memory=doc["memory"],
            sensitivity=doc["sensitivity"],
            sizes=[ScaleSize(**size) for size in doc["sizes"]],
        )
