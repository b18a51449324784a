"""The demo behind ``make demo``: every shard lives on a buddy, and a lost state comes back bitwise.

Four ranks on two emulated nodes train the example model with FSDP2 (gloo on CPU), replicating
after every step. Half-way through, rank 1's whole training state (parameters, AdamW moments,
step counters, RNG, LR schedule) is wiped; it is rebuilt from the replica its buddy on the other
node holds, and training goes on. At the end the run is compared with the same run without the
wipe: every rank's final state must match bit for bit.

    python -m examples.demo [--steps 8] [--wipe-at 4] [--model small]
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time


def _digest(state) -> str:
    import torch

    h = hashlib.sha256()
    for t in state.live_tensors():
        h.update(t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    h.update(torch.get_rng_state().numpy().tobytes())
    h.update(repr(state.scheduler.state_dict()).encode())
    return h.hexdigest()


def _rank(preset: str, steps: int, wipe_at: int) -> dict:
    import torch
    import torch.distributed as dist

    from bench.models import build_model, lm_loss, shard, synthetic_batch
    from p2p_state.config import ReplicationConfig
    from p2p_state.replicator import Replicator
    from p2p_state.state import TrainingState

    rank = dist.get_rank()
    torch.manual_seed(100 + rank)
    model = shard(build_model(preset))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    state = TrainingState(model, opt, sched)
    rep = Replicator(state, ReplicationConfig())
    say = print if rank == 0 else (lambda *a, **k: None)
    if wipe_at:
        say(
            f"[demo] {dist.get_world_size()} ranks on 2 nodes; shard of rank r is held by "
            f"{dict(enumerate(h[0] for h in rep.placement.holders))}; "
            f"{state.layout.total_bytes / 2**20:.1f} MiB of state per rank"
        )
    losses = []
    for step in range(1, steps + 1):
        tokens = synthetic_batch(model.cfg, step=step, rank=rank, batch_size=4)
        loss = lm_loss(model, tokens)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        rep.replicate(step, extras={"samples_seen": step * 4 * dist.get_world_size()})
        losses.append(loss.item())
        if wipe_at:
            say(f"[demo] step {step}: loss {losses[-1]:.4f}, committed step {rep.flush()}")
        if step == wipe_at:
            rep.flush()
            if rank == 1:
                with torch.no_grad():
                    for t in state.live_tensors():
                        t.zero_()
                torch.manual_seed(0)
                print("[demo] rank 1: training state wiped (params, optimizer, RNG, schedule)")
            t0 = time.perf_counter()
            served = rep.restore_from_buddies([1], step)
            if served is not None:
                print(
                    f"[demo] rank 1: rebuilt step {served['step']} from rank {served['holder']}'s "
                    f"replica ({served['nbytes'] / 2**20:.1f} MiB, checksum verified) in "
                    f"{(time.perf_counter() - t0) * 1e3:.0f} ms; extras {served['extras']}"
                )
    rep.close()
    return {"rank": rank, "digest": _digest(state), "losses": losses}


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns 0 when the recovered run matches the fault-free run bit for bit."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--wipe-at", type=int, default=4)
    p.add_argument("--model", default="small")
    args = p.parse_args(argv)
    if not 1 <= args.wipe_at < args.steps:
        p.error(f"--wipe-at must be between 1 and --steps - 1 ({args.steps - 1})")

    from launcher.local import WorkerGroupConfig, run_local

    cfg = WorkerGroupConfig(world_size=4, ranks_per_node=2, timeout_s=600)
    print("[demo] run with a wiped rank, recovered from its buddy:")
    recovered = run_local(_rank, cfg, (args.model, args.steps, args.wipe_at))
    print("[demo] reference run without any fault ...")
    reference = run_local(_rank, cfg, (args.model, args.steps, 0))
    same = all(a["digest"] == b["digest"] for a, b in zip(recovered, reference))
    same_losses = all(a["losses"] == b["losses"] for a, b in zip(recovered, reference))
    for a, b in zip(recovered, reference):
        mark = "==" if a["digest"] == b["digest"] else "!="
        print(f"[demo] rank {a['rank']}: final state {a['digest'][:16]} {mark} {b['digest'][:16]}")
    print(
        f"[demo] final state bitwise equal to the fault-free run: {same}; "
        f"every loss equal: {same_losses}"
    )
    return 0 if same and same_losses else 1


if __name__ == "__main__":
    sys.exit(main())
