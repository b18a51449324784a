"""The reports of ``p2p-bench replicate`` and ``data``, as named data.

As in :mod:`bench.reports`, each report's ``to_json()`` is the document its bench prints
(``--json``) and writes (``report.json``): the keys, their order and their values are the
report's format, which the tests, the renderers and the README's figures read; ``from_json()``
reads one back. Ratios of two figures of the same run are properties, written beside them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from bench.reports import Json


@dataclass(slots=True)
class RoundTimes:
    """The median replication round during training, part by part, in milliseconds."""

    copy: float
    checksum: float
    transfer: float
    headers_and_commit: float


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
