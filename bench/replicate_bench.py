"""``p2p-bench replicate``: what replication costs on the example model, against references.

Everything is measured in one run of ``--nproc`` ranks on emulated nodes: FSDP2 over gloo on
CPUs, or with ``--device cuda`` over NCCL from GPU memory (rank ``r`` on GPU ``r mod #GPUs``;
with fewer GPUs than ranks each rank is a host of its own to NCCL, :mod:`bench.shared_gpu`,
and the bytes go over NCCL's socket transport):

- ``replication_gbps`` vs ``raw_sendrecv_gbps``: the replicator's transfer (headers, chunked
  batched isend/irecv, the same buddy pattern) against one plain batched isend/irecv pair of a
  tensor of the same size on the same process group; rounds of the two alternate so drift hits
  both alike.
- ``step_time_ms_on`` vs ``step_time_ms_off``: training steps with replication every step vs
  none, in alternating blocks; medians.
- ``snapshot_gbps`` vs ``memcpy_gbps``: the snapshot copy of the live state vs a plain
  ``torch`` copy of one buffer of the same size, on one rank while the others wait.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from bench.bench_reports import HostInfo, ReplicateReport, RoundTimes
from bench.errors import UsageError
from bench.flags import MODEL_PRESETS, count, positive
from bench.report_dir import add_out_dir, command_line, finish_with_table


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``p2p-bench replicate``."""
    p.add_argument(
        "--model", default="example", choices=MODEL_PRESETS, help="model preset (default example)"
    )
    p.add_argument("--nproc", type=count(2), default=4, help="ranks (default 4)")
    p.add_argument("--ranks-per-node", type=count(1), default=2, help="ranks per emulated node")
    p.add_argument("--blocks", type=count(1), default=3, help="alternating on/off blocks per mode")
    p.add_argument("--steps-per-block", type=count(1), default=4, help="training steps per block")
    p.add_argument("--warmup", type=count(0), default=3, help="warm-up steps before measuring")
    p.add_argument("--batch-size", type=count(1), default=4, help="sequences per rank per step")
    p.add_argument("--rounds", type=count(1), default=10, help="standalone transfer repetitions")
    p.add_argument("--chunk-mb", type=positive, default=32.0, help="replication chunk size, MiB")
    p.add_argument("--timeout", type=positive, default=1200.0, help="deadline for the run, seconds")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the ranks train")
    add_out_dir(p, "replicate")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _device_of(rank: int, kind: str) -> tuple[Any, Any]:
    """This rank's device and the function that waits for it (a no-op on CPUs)."""
    import torch

    if kind != "cuda":
        return torch.device("cpu"), lambda: None
    import torch.distributed as dist

    from bench.shared_gpu import become_a_host_of_its_own

    torch.cuda.set_device(rank % torch.cuda.device_count())
    if torch.cuda.device_count() < dist.get_world_size():
        become_a_host_of_its_own()  # before the first NCCL communicator (created lazily)
    return torch.device("cuda", torch.cuda.current_device()), torch.cuda.synchronize


def _bench_rank(params: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from bench.models import PRESETS, build_model, lm_loss, shard, synthetic_batch
    from p2p_state.config import ReplicationConfig
    from p2p_state.replicator import Replicator
    from p2p_state.state import TrainingState

    rank = dist.get_rank()
    device, sync = _device_of(rank, params["device"])
    cfg = PRESETS[params["model"]]
    model = shard(build_model(cfg).to(device))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    state = TrainingState(model, opt)
    rep = Replicator(state, ReplicationConfig(chunk_bytes=params["chunk_bytes"]))
    step_no = 0

    def train_step() -> None:
        nonlocal step_no
        step_no += 1
        tokens = synthetic_batch(cfg, step=step_no, rank=rank, batch_size=params["batch_size"])
        tokens = tokens.to(device)
        lm_loss(model, tokens).backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(params["warmup"]):
        train_step()
        rep.replicate(step_no)
    rep.flush()

    times: dict[str, list[float]] = {"off": [], "on": []}
    first_round = len(rep.stats)
    for _ in range(params["blocks"]):
        for mode in ("off", "on"):
            dist.barrier()
            for j in range(params["steps_per_block"]):
                t0 = time.perf_counter()
                train_step()
                if mode == "on":
                    rep.replicate(step_no)
                    if j == params["steps_per_block"] - 1:
                        rep.flush()  # the block's last round is part of its cost
                sync()
                times[mode].append(time.perf_counter() - t0)
    in_training = list(rep.stats)[first_round:]

    # Standalone transfers: the replicator's round vs one plain send/receive of the same bytes.
    holder, owner = rep.holders[0], rep.owners[0]
    wire = device if rep.backend == "nccl" else torch.device("cpu")
    send_buf = torch.randint(0, 255, (state.layout.total_bytes,), dtype=torch.uint8, device=wire)
    recv_buf = torch.empty(rep.layouts[owner].total_bytes, dtype=torch.uint8, device=wire)
    repl_gbps, raw_gbps, round_gbps = [], [], []
    for _ in range(params["rounds"]):
        dist.barrier()
        step_no += 1
        rep.replicate(step_no)
        rep.flush()
        s = rep.stats[-1]
        repl_gbps.append(s.bytes_sent / s.transfer_s / 1e9)
        round_gbps.append(
            s.bytes_sent / (s.transfer_s + s.checksum_s + s.header_s + s.commit_s) / 1e9
        )
        dist.barrier()
        t0 = time.perf_counter()
        # One batched pair, as the replicator posts its own: on NCCL an unbatched send would
        # make a communicator of its own for the pair, and a lone send and receive to two
        # different peers can deadlock.
        works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, send_buf, holder, rep.group),
                dist.P2POp(dist.irecv, recv_buf, owner, rep.group),
            ]
        )
        for w in works:
            w.wait()
        sync()
        raw_gbps.append(send_buf.numel() / (time.perf_counter() - t0) / 1e9)

    # Snapshot copy vs plain memcpy, on rank 0 alone so the others do not compete for cores.
    snap_gbps, memcpy_gbps = [], []
    dist.barrier()
    if rank == 0:
        slot = rep.own.writable()
        assert slot.buffer is not None  # the replicator allocates its own slots
        nbytes = state.layout.tensor_bytes
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=slot.buffer.device)
        dst = torch.empty_like(src)
        for _ in range(10):
            sync()
            t0 = time.perf_counter()
            state.copy_tensors_into(slot.buffer)
            sync()
            snap_gbps.append(nbytes / (time.perf_counter() - t0) / 1e9)
            t0 = time.perf_counter()
            dst.copy_(src)
            sync()
            memcpy_gbps.append(nbytes / (time.perf_counter() - t0) / 1e9)
    dist.barrier()
    rep.close()
    return {
        "rank": rank,
        "backend": rep.backend,
        "memory": rep.kind.value,
        "snapshot_bytes": state.layout.total_bytes,
        "num_params": sum(p.numel() for p in model.parameters()),
        "times_off": times["off"],
        "times_on": times["on"],
        "rounds": [
            [s.copy_s, s.checksum_s, s.transfer_s, s.header_s + s.commit_s, s.post_s]
            for s in in_training
        ],
        "replication_gbps": repl_gbps,
        "raw_sendrecv_gbps": raw_gbps,
        "round_gbps": round_gbps,
        "snapshot_gbps": snap_gbps,
        "memcpy_gbps": memcpy_gbps,
    }


def measure(args: argparse.Namespace) -> ReplicateReport:
    """Run the benchmark and return its report."""
    import os
    import platform

    import torch

    from launcher.local import WorkerGroupConfig, run_local

    params = {
        "model": args.model,
        "warmup": args.warmup,
        "blocks": args.blocks,
        "steps_per_block": args.steps_per_block,
        "batch_size": args.batch_size,
        "rounds": args.rounds,
        "chunk_bytes": int(args.chunk_mb * 2**20) // 256 * 256,
        "device": args.device,
    }
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: this machine has no CUDA device; give --device cpu")
    cfg = WorkerGroupConfig(
        world_size=args.nproc,
        ranks_per_node=args.ranks_per_node,
        timeout_s=args.timeout,
        backend="cpu:gloo,cuda:nccl" if args.device == "cuda" else "gloo",
    )
    results = run_local(_bench_rank, cfg, (params,))
    # A step is as slow as its slowest rank: take the per-step maximum over ranks.
    off = [max(r["times_off"][i] for r in results) for i in range(len(results[0]["times_off"]))]
    on = [max(r["times_on"][i] for r in results) for i in range(len(results[0]["times_on"]))]
    rounds = [row for r in results for row in r["rounds"]]
    return ReplicateReport(
        model=args.model,
        num_params=results[0]["num_params"],
        world_size=args.nproc,
        ranks_per_node=args.ranks_per_node,
        device=args.device,
        replication_backend=results[0]["backend"],
        replica_memory=results[0]["memory"],
        snapshot_mib_per_rank=results[0]["snapshot_bytes"] / 2**20,
        chunk_mib=params["chunk_bytes"] / 2**20,
        replication_gbps=_median([g for r in results for g in r["replication_gbps"]]),
        raw_sendrecv_gbps=_median([g for r in results for g in r["raw_sendrecv_gbps"]]),
        round_gbps=_median([g for r in results for g in r["round_gbps"]]),
        step_time_ms_off=_median(off) * 1e3,
        step_time_ms_on=_median(on) * 1e3,
        snapshot_gbps=_median(results[0]["snapshot_gbps"]),
        memcpy_gbps=_median(results[0]["memcpy_gbps"]),
        round_ms_in_training=RoundTimes(
            copy=_median([r[0] for r in rounds]) * 1e3,
            checksum=_median([r[1] for r in rounds]) * 1e3,
            transfer=_median([r[2] for r in rounds]) * 1e3,
            headers_and_commit=_median([r[3] for r in rounds]) * 1e3,
            post=_median([r[4] for r in rounds]) * 1e3,
        ),
        measured_steps_per_mode=len(off),
        machine=HostInfo(os.cpu_count(), platform.python_version(), torch.__version__),
        command=command_line(args),
    )


def _table(r: ReplicateReport) -> str:
    rows = [
        ("model", f"{r.model} ({r.num_params / 1e6:.1f}M params, {r.world_size} ranks)"),
        (
            "where",
            f"{r.device}, replicas in {r.replica_memory} memory over {r.replication_backend}",
        ),
        ("snapshot per rank", f"{r.snapshot_mib_per_rank:.1f} MiB"),
        ("replication transfer", f"{r.replication_gbps:.2f} GB/s"),
        ("raw send/recv", f"{r.raw_sendrecv_gbps:.2f} GB/s"),
        ("  replication / raw", f"{r.replication_vs_raw:.2f}"),
        ("whole round", f"{r.round_gbps:.2f} GB/s (+ checksum, headers, commit)"),
        ("step, replication off", f"{r.step_time_ms_off:.0f} ms"),
        ("step, replication on", f"{r.step_time_ms_on:.0f} ms"),
        ("  overhead", f"{r.overhead_pct:+.1f} %"),
        ("snapshot copy", f"{r.snapshot_gbps:.2f} GB/s"),
        ("plain memcpy", f"{r.memcpy_gbps:.2f} GB/s"),
        ("  snapshot / memcpy", f"{r.snapshot_vs_memcpy:.2f}"),
    ]
    t = r.round_ms_in_training
    rows.append(
        (
            "round while training",
            f"copy {t.copy:.0f} ms, post {t.post:.1f} ms, checksum {t.checksum:.0f} ms, "
            f"transfer {t.transfer:.0f} ms, headers+commit {t.headers_and_commit:.0f} ms",
        )
    )
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``p2p-bench replicate``."""
    report = measure(args)
    finish_with_table(args, report.to_json(), _table(report))
    return 0
