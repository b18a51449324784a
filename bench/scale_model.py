"""The phase model of one recovery, one resize and one checkpoint-restart at a given job size.

Pure functions of labelled inputs: every figure the model uses is an :class:`Input` whose label
is ``measured`` (by this project's own benches; ``source`` names the command and the date) or
``cited`` (a published figure; ``source`` names the publication, or says ``estimate:`` and what it
was derived from). ``docs/scale-model.md`` gives every formula and why.

Units: seconds, bytes, GB/s (10**9 bytes per second).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from recovery.gloo_pairs import pairs_on_first_use

DATA = Path(__file__).with_name("data")
LABELS = ("measured", "cited")
GB = 1e9
RECOVERY_PHASES = (
    "detect",
    "interrupt",
    "communicators",
    "plan",
    "build",
    "transfer",
    "restore",
    "data",
    "replicate",
    "redone step",
)
RESIZE_PHASES = ("communicators", "plan", "build", "transfer", "restore", "data", "replicate")
RESTART_PHASES = (
    "detect",
    "scheduler restart",
    "process start",
    "init communicators",
    "build",
    "load checkpoint",
    "data",
    "lost work",
)


@dataclass(frozen=True)
class Input:
    """One labelled figure; ``low``/``high`` bound it for the sensitivity analysis."""

    value: float
    unit: str
    label: str
    source: str
    low: float | None = None
    high: float | None = None

    def __post_init__(self) -> None:
        if self.label not in LABELS:
            raise ValueError(f"label {self.label!r} is not one of {LABELS}")
        if not self.source:
            raise ValueError("every input needs a source")

    def as_dict(self) -> dict[str, Any]:
        """The report's form of the input."""
        return {k: v for k, v in asdict(self).items() if v is not None}


Inputs = dict[str, Input]


def load(name: str) -> dict[str, Any]:
    """One of the data files under ``bench/data`` (``cited``, ``hardware``, ``models``, ...)."""
    data: dict[str, Any] = json.loads((DATA / f"{name}.json").read_text())
    return data


def cited(name: str, data: dict[str, Any] | None = None) -> Input:
    """A figure of ``cited.json`` as an input."""
    c = (data or load("cited"))[name]
    return Input(c["value"], c["unit"], "cited", c["source"], c.get("low"), c.get("high"))


def series(points: dict[int, float], n: int) -> tuple[float, str]:
    """``points`` (ranks -> value) at ``n`` ranks, linear in log2(ranks) between the two nearest
    sizes, and linear in ranks beyond the largest one (the pessimistic reading for a per-rank
    cost). Returns the value and how it was obtained: ``at``, ``interpolated`` or
    ``extrapolated``."""
    xs = sorted(points)
    if not xs:
        raise ValueError("no points")
    if n in points:
        return points[n], "at"
    if len(xs) == 1 or n < xs[0]:
        return points[xs[0]], "extrapolated (smallest size measured)"
    if n > xs[-1]:
        a, b = xs[-2], xs[-1]
        slope = max(0.0, (points[b] - points[a]) / (b - a))
        return points[b] + slope * (n - b), f"extrapolated linearly in ranks from {a} and {b}"
    lo = max(x for x in xs if x < n)
    hi = min(x for x in xs if x > n)
    f = (math.log2(n) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
    return points[lo] + f * (points[hi] - points[lo]), f"interpolated between {lo} and {hi}"


def control_plane_inputs(measured: dict[str, Any], n: int) -> Inputs:
    """Detection and generation-change figures of the real coordinator at ``n`` ranks.

    The sizes of the main run, and those of runs at larger sizes (``control_plane["larger"]``,
    each with its own command and settings) above them. A hang is detected a heartbeat timeout
    after the last beat, so only sizes run with the main run's timeout count for it.
    """
    cp = measured["control_plane"]
    src = f"{cp['command']} ({cp['date']})"
    largest = max(int(s["ranks"]) for s in cp["sizes"])
    larger = [(run, s) for run in cp.get("larger", []) for s in run["sizes"]]
    timeout = cp["sizes"][-1]["heartbeat_timeout_s"]
    out: Inputs = {}
    for key, field, unit, scale in (
        ("exit_detect_s", "detect_ms_p50", "s", 1e-3),
        ("generation_s", "generation_ms_p50", "s", 1e-3),
        ("hang_detect_s", "hang_detect_s_p50", "s", 1.0),
    ):
        # Beyond the main run's sizes only: up to them, the inputs are the main run's alone.
        beyond = [
            (run, s)
            for run, s in larger
            if n > largest
            and int(s["ranks"]) > largest
            and (key != "hang_detect_s" or s["heartbeat_timeout_s"] == timeout)
        ]
        sizes = [*cp["sizes"], *(s for _, s in beyond)]
        pts = {int(s["ranks"]): s[field] * scale for s in sizes if s.get(field) is not None}
        value, how = series(pts, n)
        runs = {id(run): run for run, _ in beyond}.values()
        sources = "".join(f"; {run['command']} ({run['date']})" for run in runs)
        p99 = field.replace("p50", "p99")
        hi = max((s.get(p99) or s[field]) * scale for s in sizes)
        out[key] = Input(
            value, unit, "measured", f"{src}{sources}, {how}", value * 0.8, max(hi, value * 1.5)
        )
    return out


#: Members whose addresses one ``multi_get`` of a gloo rendezvous reads (``kDefaultBatchSize``
#: of gloo's TCP context, with :data:`recovery.comms.GLOO_ENVIRONMENT`; used by
#: :mod:`bench.rendezvous_bench` too).
GLOO_BATCH = 128
#: Pairs a member of a gloo group made with ``--lazy-gloo`` connects while the group forms: its
#: ring neighbours (``recovery.comms.Comms._connect_first``).
LAZY_PAIRS = 2


def rendezvous_inputs(measured: dict[str, Any], n: int) -> Inputs:
    """What forming a generation's gloo groups costs the rendezvous store at ``n`` ranks: the
    store's CPU time per request, measured by ``p2p-bench rendezvous`` (the engine's way), and
    how many gloo groups a generation forms."""
    rz = measured["rendezvous"]
    src = f"{rz['command']} ({rz['date']})"
    pts = {int(s["members"]): s["store_cpu_s"] / s["requests"] for s in rz["sizes"]}
    value, how = series(pts, n)
    lazy_pts = {int(s["members"]): s["lazy_store_cpu_s"] / s["lazy_requests"] for s in rz["sizes"]}
    lazy, lazy_how = series(lazy_pts, n)
    return {
        "store_request_s": Input(
            value, "s", "measured", f"{src}: store CPU per request, {how}", value * 0.5, value * 2
        ),
        "lazy_request_s": Input(
            lazy,
            "s",
            "measured",
            f"{src}: store CPU per request with --lazy-gloo (a wait or a get of one address), "
            f"{lazy_how}",
            lazy * 0.5,
            lazy * 2,
        ),
        "gloo_groups": Input(
            3,
            "groups",
            "cited",
            "recovery/comms.py, recovery/replication.py: the default group's gloo part "
            "(cpu:gloo,cuda:nccl), replication's headers and commits beside NCCL, the cold "
            "checkpoint's group; 2 with init_process_group(backend='nccl')",
            2,
            3,
        ),
    }


def gloo_rendezvous_s(inp: Inputs, n: int, *, lazy: bool = False) -> float:
    """Seconds of the store thread for a generation's gloo groups at ``n`` ranks: per group,
    every member writes its address and reads all of them, one request per 128 members; with
    ``lazy`` (``p2p-run --lazy-gloo``), reads those of the :data:`LAZY_PAIRS` pairs it connects
    while the group forms, a wait and a get each, and the members then give each other all
    their addresses in one ring all-gather."""
    if lazy:
        per_group = n * (1 + 2 * LAZY_PAIRS) * inp.get("lazy_request_s", _zero).value
        # ... and then share every member's addresses over the ring: N - 1 steps, once.
        shared = (n - 1) * inp.get("gloo_hop_s", _zero).value
        return inp.get("gloo_groups", _zero).value * per_group + shared
    per_group = n * (1 + math.ceil(n / GLOO_BATCH)) * inp.get("store_request_s", _zero).value
    return inp.get("gloo_groups", _zero).value * per_group


def job_inputs(
    *,
    params: float,
    tokens_per_step: float,
    model_source: str,
    hardware: dict[str, Any],
    step_s: float | None = None,
    data: dict[str, Any] | None = None,
) -> Inputs:
    """The cited inputs of one model on one hardware preset at any job size."""
    c = data or load("cited")
    hw = hardware
    hsrc = hw["source"]
    inp: Inputs = {
        "params": Input(params, "parameters", "cited", model_source),
        "tokens_per_step": Input(tokens_per_step, "tokens", "cited", model_source),
        "gpu_mem_gib": Input(hw["gpu_mem_gib"], "GiB", "cited", hsrc),
        "host_mem_gib": Input(hw["host_mem_gib"], "GiB", "cited", hsrc),
        "ib_gbps": Input(hw["ib_gbps"], "GB/s", "cited", hsrc, hw["ib_gbps"] * 0.7, hw["ib_gbps"]),
        "nvlink_gbps": Input(hw["nvlink_gbps"], "GB/s", "cited", hsrc),
        "pcie_gbps": Input(hw["pcie_gbps"], "GB/s", "cited", hsrc, hw["pcie_gbps"] * 0.7),
        "hbm_gbps": Input(hw["hbm_gbps"], "GB/s", "cited", hsrc, hw["hbm_gbps"] * 0.6),
        "peak_tflops": Input(hw["peak_tflops"], "TFLOP/s", "cited", hsrc),
        "nics_per_node": Input(hw["nics_per_node"], "NICs", "cited", hsrc, 1, hw["nics_per_node"]),
    }
    for name in (
        "state_bytes_per_param",
        "mfu",
        "nccl_lazy_init_s_per_1k_ranks",
        "nccl_connect_s",
        "nccl_abort_s",
        "gloo_hop_s",
        "build_fixed_s",
        "cold_build_s",
        "scheduler_restart_s",
        "process_start_s",
        "nccl_eager_init_s_at_4096",
        "storage_read_gbps_total",
        "checkpoint_write_stall_s",
        "replication_overlap",
        "node_level_fraction",
        "hardware_fraction",
        "failures_per_16384_gpus_54_days",
        "torchft_heal_s",
        "activation_headroom_fraction",
        "pinnable_host_fraction",
    ):
        inp[name] = cited(name, c)
    if step_s is not None:
        inp["step_s"] = Input(step_s, "s", "cited", "given on the command line (--step-s)")
    return inp


def step_time_s(inp: Inputs, gpus: int) -> float:
    """Seconds per step: 6 * params * tokens / (gpus * peak * MFU) unless given."""
    if "step_s" in inp:
        return inp["step_s"].value
    flops = 6.0 * inp["params"].value * inp["tokens_per_step"].value
    return flops / (gpus * inp["peak_tflops"].value * 1e12 * inp["mfu"].value)


def state_bytes_per_gpu(inp: Inputs, gpus: int, shard_degree: int | None = None) -> float:
    """Training state one GPU holds (and must get back): params * bytes/param / shard degree."""
    degree = min(shard_degree or gpus, gpus)
    return inp["params"].value * inp["state_bytes_per_param"].value / degree


@dataclass(frozen=True)
class Job:
    """The job around the model: size, replication factor, placement and checkpointing."""

    gpus: int = 2048
    gpus_per_node: int = 8
    replicas: int = 1
    shard_degree: int | None = None
    checkpoint_every_min: float = 30.0
    storage: str = "parallel-fs"  # or "s3"
    replica_memory: str = "gpu"  # or "host" (pinned)
    placement: str = "ring"  # copies on the next nodes, or "same-node" (over NVLink)
    lazy_gloo: bool | None = None
    """Gloo groups connect pairs on first use: ``p2p-run --lazy-gloo`` (``True``),
    ``--eager-gloo`` (``False``), or neither (``None``: from ``LAZY_FROM_RANKS`` ranks)."""

    @property
    def nodes(self) -> int:
        """Nodes of the job."""
        return max(1, self.gpus // self.gpus_per_node)


def _bw(inp: Inputs, job: Job) -> float:
    """Bytes/s one restoring GPU gets from the GPU that holds its copy: NVLink within a node
    (``same-node``), else the IB link; the slower of that and PCIe when the copy sits in pinned
    host memory."""
    link = inp["nvlink_gbps" if job.placement == "same-node" else "ib_gbps"].value
    if job.replica_memory == "host":
        link = min(link, inp["pcie_gbps"].value)
    return link * GB


def streams_per_link(inp: Inputs, job: Job, lost: int) -> int:
    """Restores that share one link of the node serving them: a lost node's ranks pull their
    copies from one neighbour node (ring placement), whose ``nics_per_node`` links carry them;
    a single lost GPU has its link to itself."""
    if job.placement == "same-node":
        return 1
    return max(1, math.ceil(lost / max(1, inp["nics_per_node"].value)))


def recovery_phases(inp: Inputs, job: Job, *, node_fault: bool = False) -> dict[str, float]:
    """Seconds of each phase of one recovery (fault -> training back at the step it had)."""
    n = job.gpus
    s = state_bytes_per_gpu(inp, n, job.shard_degree)
    lost = job.gpus_per_node if node_fault else 1
    streams = streams_per_link(inp, job, lost)
    bw = _bw(inp, job)
    gen = inp["generation_s"].value
    return {
        "detect": inp["hang_detect_s" if node_fault else "exit_detect_s"].value,
        "interrupt": gen + inp["nccl_abort_s"].value,
        "communicators": inp["nccl_connect_s"].value
        + inp["nccl_lazy_init_s_per_1k_ranks"].value * n / 1024
        + gloo_rendezvous_s(inp, n, lazy=pairs_on_first_use(n, job.lazy_gloo)),
        "plan": gen + inp.get("plan_fixed_s", _zero).value,
        "build": inp["build_fixed_s"].value + s / (inp["hbm_gbps"].value * GB),
        "transfer": s * streams / bw,
        "restore": 2 * s / (inp["hbm_gbps"].value * GB),
        "data": inp.get("data_s", _zero).value,
        "replicate": job.replicas * s / bw + gen,
        "redone step": step_time_s(inp, n),
    }


_zero = Input(0.0, "s", "cited", "not modelled: zero")


def leaving_ranks(old: int, new: int, nodes: list[int]) -> list[int]:
    """The ranks a shrink from ``old`` to ``new`` gives back, by the launcher's rule
    (``launcher.policy``): nodes with the fewest ranks first, among equals the higher ranks,
    so that whole nodes go and the low ranks keep their numbers."""
    by_node: dict[int, list[int]] = {}
    for rank in sorted(range(old), reverse=True):
        by_node.setdefault(nodes[rank], []).append(rank)
    order = [r for rs in sorted(by_node.values(), key=lambda rs: (len(rs), -rs[0])) for r in rs]
    return sorted(order[: max(0, old - new)])


def reshard_shares(
    old: int,
    new: int,
    gpus_per_node: int,
    k: int,
    *,
    nodes: list[int] | None = None,
    leaving: list[int] | None = None,
) -> tuple[list[float], list[float]]:
    """Who moves what in an in-place resize from ``old`` to ``new`` ranks: for every rank of
    the new world, the share of the whole training state it receives from another rank and the
    share it sends. The mechanism of ``recovery.restore`` and ``recovery.planner``:

    - every parameter and its optimizer state is sharded on dim 0 (FSDP2), so new rank ``d``
      needs the run ``[d/new, (d+1)/new)`` of the whole, and old rank ``o`` held
      ``[o/old, (o+1)/old)``; the pieces are the overlaps;
    - ranks that stay keep their order and are numbered from 0, joiners follow
      (``launcher.membership``); a shrink gives back :func:`leaving_ranks`;
    - a piece costs nothing when its receiver holds a copy of its owner's shard (its own old
      shard, or a replica from ``p2p_state.placement.place``, ``k`` copies on a ring of
      interleaved nodes); else its holders serve it, the least loaded first (the planner gives
      each tensor's piece to the holder with the least load so far: over a model's many tensors
      that fills the holders' loads level, as :func:`_fill` does).

    ``nodes``: the node of every old rank, when they are not numbered node by node.
    """
    from p2p_state.placement import place

    node_of = list(nodes) if nodes is not None else [r // gpus_per_node for r in range(old)]
    if leaving is None:
        leaving = leaving_ranks(old, new, node_of)
    survivors = [r for r in range(old) if r not in set(leaving)]
    new_rank = {o: i for i, o in enumerate(survivors[:new])}
    placement = place(old, gpus_per_node, k, nodes)
    holders = [
        sorted({new_rank[h] for h in (o, *placement.holders[o]) if h in new_rank})
        for o in range(old)
    ]
    recv, send = [0] * new, [0.0] * new
    # Integer positions in units of 1 / (old * new): new rank d holds [d * old, (d + 1) * old),
    # old rank o held [o * new, (o + 1) * new).
    for d in range(new):
        a, b = d * old, (d + 1) * old
        for o in range(a // new, min(old, -(-b // new))):
            piece = min(b, (o + 1) * new) - max(a, o * new)
            if piece <= 0 or d in holders[o]:
                continue
            if not holders[o]:
                raise ValueError(f"no copy of old rank {o} survives the resize {old} -> {new}")
            _fill(send, holders[o], piece)
            recv[d] += piece
    unit = old * new
    return [r / unit for r in recv], [s / unit for s in send]


def _fill(load: list[float], among: list[int], amount: float) -> None:
    """Add ``amount`` to the loads of ``among``, lowest first, levelling them (water-filling)."""
    left = amount
    ranks = sorted(among, key=lambda r: load[r])
    for i in range(len(ranks)):
        level = load[ranks[i + 1]] if i + 1 < len(ranks) else math.inf
        group = ranks[: i + 1]
        room = sum(level - load[g] for g in group)
        if room >= left:
            top = (sum(load[g] for g in group) + left) / len(group)
            for g in group:
                load[g] = top
            return
        for g in group:
            load[g] = level
        left -= room


def resize_transfer_s(
    inp: Inputs,
    job: Job,
    to_gpus: int,
    *,
    nodes: list[int] | None = None,
    leaving: list[int] | None = None,
) -> float:
    """Seconds of a resize's transfer: the slowest rank's link carries the larger of what it
    receives and what it serves (:func:`reshard_shares`; links are full duplex), and a node's
    ranks share its ``nics_per_node`` links for what they receive (``job.gpus_per_node`` is
    where the new ranks run)."""
    recv, send = reshard_shares(
        job.gpus, to_gpus, job.gpus_per_node, job.replicas, nodes=nodes, leaving=leaving
    )
    total = inp["params"].value * inp["state_bytes_per_param"].value
    bw = _bw(inp, job)
    per_rank = max(max(r, s) for r, s in zip(recv, send, strict=True)) * total / bw
    if job.placement == "same-node":
        return per_rank
    by_node: dict[int, float] = {}
    for d, r in enumerate(recv):
        by_node[d // job.gpus_per_node] = by_node.get(d // job.gpus_per_node, 0.0) + r
    nics = max(1.0, inp["nics_per_node"].value)
    return max(per_rank, max(by_node.values()) * total / (nics * bw))


def resize_phases(
    inp: Inputs,
    job: Job,
    to_gpus: int,
    *,
    nodes: list[int] | None = None,
    leaving: list[int] | None = None,
) -> dict[str, float]:
    """Seconds of each phase of a graceful in-place resize from ``job.gpus`` to ``to_gpus``:
    no detection and no interrupt (ranks finish their step and switch at the next commit);
    every rank, not only a joining one, creates the new communicators, rebuilds its model on
    the new world, gets the part of its new shard it does not hold (:func:`resize_transfer_s`),
    restores it and replicates it."""
    s_new = state_bytes_per_gpu(inp, to_gpus, job.shard_degree)
    bw = _bw(inp, job)
    gen = inp["generation_s"].value
    return {
        "communicators": inp["nccl_connect_s"].value
        + inp["nccl_lazy_init_s_per_1k_ranks"].value * to_gpus / 1024
        + gloo_rendezvous_s(inp, to_gpus, lazy=pairs_on_first_use(to_gpus, job.lazy_gloo)),
        "plan": gen + inp.get("plan_fixed_s", _zero).value,
        "build": inp["build_fixed_s"].value + s_new / (inp["hbm_gbps"].value * GB),
        "transfer": resize_transfer_s(inp, job, to_gpus, nodes=nodes, leaving=leaving),
        "restore": 2 * s_new / (inp["hbm_gbps"].value * GB),
        "data": inp.get("data_s", _zero).value,
        "replicate": job.replicas * s_new / bw + gen,
    }


def checkpoint_load_s(inp: Inputs, job: Job) -> float:
    """Seconds to read the whole state back: total bytes over the storage's aggregate read
    bandwidth, never faster than every node's NIC share (S3: per-node bandwidth)."""
    total = inp["params"].value * inp["state_bytes_per_param"].value
    if job.storage == "s3":
        agg = job.nodes * inp.get("s3_gbps_per_node", cited("s3_gbps_per_node")).value * GB
    else:
        agg = inp["storage_read_gbps_total"].value * GB
    agg = min(agg, job.gpus * inp["ib_gbps"].value * GB)
    return total / agg


def eager_init_s(inp: Inputs, n: int) -> float:
    """NCCL's default (eager) init at ``n`` ranks: linear in ranks through the cited point."""
    return inp["nccl_eager_init_s_at_4096"].value * n / 4096


def restart_phases(inp: Inputs, job: Job) -> dict[str, float]:
    """Seconds of each phase of checkpoint-restart after one fault, with half an interval of
    lost work (the expected distance to the last checkpoint)."""
    n = job.gpus
    s = state_bytes_per_gpu(inp, n, job.shard_degree)
    return {
        "detect": inp["exit_detect_s"].value,
        "scheduler restart": inp["scheduler_restart_s"].value,
        "process start": inp["process_start_s"].value,
        "init communicators": eager_init_s(inp, n),
        "build": inp["cold_build_s"].value + s / (inp["hbm_gbps"].value * GB),
        "load checkpoint": checkpoint_load_s(inp, job),
        "data": inp.get("data_s", _zero).value,
        "lost work": job.checkpoint_every_min * 60.0 / 2 + step_time_s(inp, n),
    }


def torchft_heal_s(inp: Inputs) -> float:
    """A torchft-style replica-group heal: the group drops out at once; the cited time is what
    it takes to restart and re-join with a live weight transfer (training goes on meanwhile at
    reduced throughput, so the cost is that time times the group's share)."""
    return inp["torchft_heal_s"].value


def with_value(inp: Inputs, name: str, value: float) -> Inputs:
    """A copy of ``inp`` with one input's value changed (for the sensitivity analysis)."""
    out = dict(inp)
    out[name] = replace(inp[name], value=value)
    return out


def sensitivity(
    inp: Inputs, fn: Callable[[Inputs], float], names: list[str] | None = None
) -> list[dict[str, Any]]:
    """Each input with a range moved to its low and high bound, the others nominal: the result
    of ``fn(inputs)`` at both ends, sorted by the size of the swing (the tornado)."""
    base = fn(inp)
    rows: list[dict[str, Any]] = []
    for name in names or sorted(inp):
        i = inp[name]
        if i.low is None and i.high is None:
            continue
        lo, hi = (
            fn(with_value(inp, name, i.low if i.low is not None else i.value)),
            fn(with_value(inp, name, i.high if i.high is not None else i.value)),
        )
        if lo == base and hi == base:
            continue
        rows.append({"input": name, "low": lo, "high": hi, "swing": abs(hi - lo)})
    rows.sort(key=lambda r: -r["swing"])
    return rows


def uncertainty(base: float, rows: list[dict[str, Any]]) -> tuple[float, float]:
    """The range of a result: root-sum-square of each input's move below and above ``base``
    (independent errors)."""
    down = math.sqrt(sum(max(0.0, base - min(r["low"], r["high"])) ** 2 for r in rows))
    up = math.sqrt(sum(max(0.0, max(r["low"], r["high"]) - base) ** 2 for r in rows))
    return base - down, base + up


def memory(inp: Inputs, job: Job) -> dict[str, Any]:
    """Bytes per GPU and per node for the snapshot and ``k`` replicas, against capacity."""
    s = state_bytes_per_gpu(inp, job.gpus, job.shard_degree)
    gib = 2**30
    snap_and_replicas = s * (1 + job.replicas)
    gpu_free = inp["gpu_mem_gib"].value * gib * inp["activation_headroom_fraction"].value
    node_pinnable = inp["host_mem_gib"].value * gib * inp["pinnable_host_fraction"].value
    node_need = snap_and_replicas * job.gpus_per_node
    fits_gpu = snap_and_replicas <= gpu_free
    fits_host = node_need <= node_pinnable
    fix = None
    if not fits_gpu and fits_host:
        fix = "keep the snapshot and replicas in pinned host memory (--replica-memory host)"
    elif not fits_gpu:
        need = math.ceil(inp["params"].value * inp["state_bytes_per_param"].value * 2 / gpu_free)
        fix = f"shard over more GPUs (at least {need}) or use k=1"
    return {
        "replicas": job.replicas,
        "state_gib_per_gpu": s / gib,
        "snapshot_and_replicas_gib_per_gpu": snap_and_replicas / gib,
        "gpu_free_gib": gpu_free / gib,
        "fits_gpu": fits_gpu,
        "node_pinned_need_gib": node_need / gib,
        "node_pinnable_gib": node_pinnable / gib,
        "fits_host": fits_host,
        "fix": fix,
    }
