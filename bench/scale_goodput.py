"""Goodput over a month by Monte Carlo over failure arrivals.

Faults arrive as a Poisson process at the cited Llama 3 rate scaled to the job's GPU count. Each
fault takes one GPU's process (a GPU, software or NIC fault) or, with the cited node-level share,
a whole node. Faults closer together than the recovery window form one incident (a
near-simultaneous double fault). An incident loses a shard's every copy when the GPU holding it
and all ``k`` GPUs holding its replicas failed in it; then the cold fallback (checkpoint-restart
from the last checkpoint) runs. See ``docs/scale-model.md``.
"""

from __future__ import annotations

import random
from typing import Any

from bench.scale_model import Inputs, Job

MONTH_S = 30 * 86400.0


def fault_rate_per_s(inp: Inputs, gpus: int) -> float:
    """Faults per second of the job: the Llama 3 interruptions per GPU-second times ``gpus``."""
    per_gpu_s = inp["failures_per_16384_gpus_54_days"].value / (16384 * 54 * 86400.0)
    return per_gpu_s * gpus


def holders(gpu: tuple[int, int], job: Job, placement: str) -> list[tuple[int, int]]:
    """The GPUs (node, local index) that hold the replicas of ``gpu``'s shard: the same local
    index on the next ``k`` nodes (``ring``), or the next ``k`` GPUs of the same node
    (``same-node``)."""
    node, local = gpu
    k = job.replicas
    if placement == "same-node":
        return [(node, (local + j) % job.gpus_per_node) for j in range(1, k + 1)]
    return [((node + j) % job.nodes, local) for j in range(1, k + 1)]


def copies_lost(failed: set[tuple[int, int]], job: Job, placement: str) -> bool:
    """Whether some shard lost its own GPU and every replica holder."""
    return any(all(h in failed for h in holders(g, job, placement)) for g in failed)


def simulate(
    inp: Inputs,
    job: Job,
    *,
    recovery_gpu_s: float,
    recovery_node_s: float,
    cold_s: float,
    window_s: float,
    placement: str = "ring",
    trials: int = 2000,
    seed: int = 0,
    days: float = 30.0,
) -> dict[str, Any]:
    """Months of faults for one job.

    Args:
        inp: The model's inputs (fault rate, node-level share).
        job: Job size, ``k`` and nodes.
        recovery_gpu_s: Downtime of a recovery from one GPU's fault.
        recovery_node_s: Downtime of a recovery from a node's fault.
        cold_s: Downtime of the cold fallback (checkpoint-restart) when copies are lost.
        window_s: How long after a fault the copies are not yet whole again.
        placement: ``ring`` (replicas on the next nodes) or ``same-node``.
        trials: Simulated periods.
        seed: Seed of the generator.
        days: Length of a period.

    Returns:
        Per period means: faults, incidents with more than one fault, incidents that lost
        every copy, cold fallbacks, downtime; and the share of faults that lost every copy.
    """
    rng = random.Random(seed)
    period = days * 86400.0
    rate = fault_rate_per_s(inp, job.gpus)
    node_share = inp["node_level_fraction"].value
    faults = doubles = lost = 0
    downtime = 0.0
    for _ in range(trials):
        t, events = 0.0, []
        while True:
            t += rng.expovariate(rate)
            if t >= period:
                break
            node = rng.randrange(job.nodes)
            if rng.random() < node_share:
                events.append((t, {(node, i) for i in range(job.gpus_per_node)}, True))
            else:
                events.append((t, {(node, rng.randrange(job.gpus_per_node))}, False))
        faults += len(events)
        i = 0
        while i < len(events):
            j = i + 1
            while j < len(events) and events[j][0] - events[j - 1][0] < window_s:
                j += 1
            incident = events[i:j]
            failed = set().union(*(e[1] for e in incident))
            if len(incident) > 1:
                doubles += 1
            if copies_lost(failed, job, placement):
                lost += 1
                downtime += cold_s
            else:
                for _, _, is_node in incident:
                    downtime += recovery_node_s if is_node else recovery_gpu_s
            i = j
    n = max(1, trials)
    return {
        "trials": trials,
        "days": days,
        "placement": placement,
        "window_s": window_s,
        "faults_per_period": faults / n,
        "double_fault_incidents_per_period": doubles / n,
        "copies_lost_per_period": lost / n,
        "cold_fallbacks_per_period": lost / n,
        "copies_lost_fraction": lost / faults if faults else 0.0,
        "downtime_per_period_s": downtime / n,
        "downtime_per_day_s": downtime / n / days,
    }


def copies_lost_fraction_analytic(inp: Inputs, job: Job, window_s: float, placement: str) -> float:
    """Expected share of faults that lose every copy, to leading order in the fault rate.

    ``same-node``: every node-level fault loses them. ``ring``, ``k=1``: the next fault comes
    within the window (probability ``rate * window``) and takes a holder of the first fault's
    shards or a shard the first fault's GPUs held (one of the two neighbour nodes: ``2/nodes``
    if either fault took a node, ``2/(nodes * gpus_per_node)`` for two single GPUs). ``k >= 2``
    needs ``k`` such faults in a row: the ``k``-th power of that, an upper bound.
    """
    s = inp["node_level_fraction"].value
    if placement == "same-node":
        return s
    x = fault_rate_per_s(inp, job.gpus) * window_s
    either_node = 1.0 - (1.0 - s) ** 2
    p_pair = either_node * 2.0 / job.nodes + (1.0 - either_node) * 2.0 / (
        job.nodes * job.gpus_per_node
    )
    return (x * p_pair) ** job.replicas


def goodput(downtime_per_month_s: float, overhead_fraction: float, days: float = 30.0) -> float:
    """Share of the period that trains: one minus downtime and steady overhead."""
    period = days * 86400.0
    return max(0.0, 1.0 - downtime_per_month_s / period - overhead_fraction)
