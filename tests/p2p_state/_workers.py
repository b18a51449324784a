"""Per-rank functions for the multi-process data-plane tests (run by ``launcher.local``)."""

from __future__ import annotations

import hashlib
import os
import signal

import msgpack
import torch
import torch.distributed as dist

from bench.models import PRESETS, build_model, lm_loss, shard, synthetic_batch
from p2p_state.config import ReplicationConfig
from p2p_state.layout import LayoutMismatchError
from p2p_state.replicator import ReplicaCorruptError, ReplicationError, Replicator
from p2p_state.state import TrainingState


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(
        t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
    ).hexdigest()


def live_digest(state: TrainingState, step: int) -> dict[str, str]:
    """An independent digest of every part of the live state (not using the engine's buffers)."""
    out = {name: sha(t) for name, t in zip(_names(state), state.live_tensors())}
    out["rng/cpu"] = sha(torch.get_rng_state())
    out["scheduler"] = hashlib.sha256(msgpack.packb(state.scheduler.state_dict())).hexdigest()
    out["lr"] = repr([g["lr"] for g in state.optimizer.param_groups])
    out["step"] = str(step)
    return out


def restore_from_replicas(rep: Replicator, state: TrainingState) -> tuple[int, dict]:
    """Every rank gets its state back from the replicas its buddies hold, through the recovery
    engine's restore (collective): the own snapshots are left out of the census, so each rank
    receives its newest complete step from a buddy.

    Returns:
        ``(step, extras)`` as replicated.
    """
    from p2p_state.memory import MemoryKind
    from recovery.restore import gather_copies, restore_from_peers

    rep.flush()
    cuda = torch.device("cuda", torch.cuda.current_device()) if rep.backend == "nccl" else None
    wire = cuda or torch.device("cpu")
    held = gather_copies([rep], rep.group, wire, rep.config.timeout_s)
    replicas = [{c for c in h if not c.is_own} for h in held]
    outcome = restore_from_peers(
        state,
        [rep],
        replicas,
        rep.group,
        dist.get_rank(),
        dist.get_world_size(),
        memory=rep.device if rep.kind is MemoryKind.GPU else torch.device("cpu"),
        chunk_bytes=rep.config.chunk_bytes,
        timeout_s=rep.config.timeout_s,
        wire_device=wire,
    )
    assert outcome.bytes_received > 0, "not restored from a buddy"
    return outcome.step, outcome.extras


def _names(state: TrainingState) -> list[str]:
    return [e.name for e in state.layout.entries if not e.name.startswith("rng/")]


def _setup(preset: str, lr: float = 1e-3):
    model = shard(build_model(preset, seed=0))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def _train_step(model, opt, sched, step: int) -> float:
    tokens = synthetic_batch(model.cfg, step=step, rank=dist.get_rank(), batch_size=2)
    loss = model.loss(tokens)
    loss.backward()
    loss = loss.detach()
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def replicate_and_restore(num_steps: int, chunk_bytes: int) -> dict:
    """Train with replication; check replicas after every step; restore from the buddy."""
    torch.manual_seed(1234 + dist.get_rank())
    model, opt, sched = _setup("tiny")
    state = TrainingState(model, opt, sched)
    cfg = ReplicationConfig(chunk_bytes=chunk_bytes, timeout_s=60)
    rep = Replicator(state, cfg)
    rank = dist.get_rank()
    per_step = []
    for step in range(1, num_steps + 1):
        _train_step(model, opt, sched, step)
        rep.replicate(step, extras={"sampler_offset": step * 8})
        committed = rep.flush()
        own = sha(rep.own_slot(step).buffer)
        replicas = {o: sha(rep.replica_slot(o, step).buffer) for o in rep.owners}
        per_step.append({"step": step, "committed": committed, "own": own, "replicas": replicas})

    from recovery.planner import shard_layout

    predicted = [shard_layout(rep.layouts[0], dist.get_world_size(), r) for r in range(4)]
    final = live_digest(state, num_steps)
    params_before = [(id(p), p.to_local().data_ptr()) for p in model.parameters()]

    # Destroy the live state, then get it back from the buddy's replica alone.
    with torch.no_grad():
        for t in state.live_tensors():
            t.normal_()
    torch.manual_seed(999)
    for _ in range(3):
        sched.step()

    # Every rank in turn loses its state; one collective rebuilds them all from their buddies.
    restored_step, extras = restore_from_replicas(rep, state)
    after = live_digest(state, restored_step)
    params_after = [(id(p), p.to_local().data_ptr()) for p in model.parameters()]
    # Training continues from the restored state exactly like an untouched run would.
    loss_after = _train_step(model, opt, sched, num_steps + 1)
    rep.close()
    return {
        "rank": rank,
        "holders": list(rep.holders),
        "owners": list(rep.owners),
        "per_step": per_step,
        "final": final,
        "after": after,
        "extras": extras,
        "same_objects": params_before == params_after,
        "planner_predicts_fsdp_layouts": predicted == rep.layouts,
        "loss_after": loss_after,
    }


def continue_without_fault(num_steps: int) -> dict:
    """The reference: the same run, no destruction, one more step."""
    torch.manual_seed(1234 + dist.get_rank())
    model, opt, sched = _setup("tiny")
    state = TrainingState(model, opt, sched)
    for step in range(1, num_steps + 1):
        _train_step(model, opt, sched, step)
    final = live_digest(state, num_steps)
    return {"loss_after": _train_step(model, opt, sched, num_steps + 1), "final": final}


def corrupt_replica(chunk_bytes: int) -> dict:
    """DDP this time. Flip one byte of a replica: the checksum catches it, it is never served."""
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(build_model("tiny"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = TrainingState(model, opt)
    rep = Replicator(state, ReplicationConfig(chunk_bytes=chunk_bytes))
    for step in (1, 2):
        tokens = synthetic_batch(PRESETS["tiny"], step=step, rank=dist.get_rank(), batch_size=2)
        lm_loss(model, tokens).backward()
        opt.step()
        opt.zero_grad()
        rep.replicate(step)
    rep.flush()
    owner = rep.owners[0]
    slot = rep.replicas[owner].find(2)
    ok_before = slot.verify()
    slot.buffer[slot.header.nbytes // 2] ^= 0x01
    try:
        rep.replica_slot(owner, 2)
        caught = ""
    except ReplicaCorruptError as e:
        caught = str(e)
    held = [i.step for i in rep.holdings()[owner]]
    older_ok = rep.replica_slot(owner, 1).verify()
    rep.close()
    return {"ok_before": ok_before, "caught": caught, "held_after": held, "older_ok": older_ok}


def sender_dies_mid_transfer(chunk_bytes: int, die_at_step: int) -> dict:
    """Rank 1 SIGKILLs itself after the first chunk of a round; rank 0 keeps its last good copy."""
    rank = dist.get_rank()
    model = build_model("tiny", seed=0)  # plain module: each rank's "shard" is the whole model
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = TrainingState(model, opt)

    def die(step: int, round_: int, num_rounds: int) -> None:
        if rank == 1 and step == die_at_step and round_ == 0:
            assert num_rounds > 2, "the test needs a transfer of several chunks"
            os.kill(os.getpid(), signal.SIGKILL)

    rep = Replicator(
        state, ReplicationConfig(chunk_bytes=chunk_bytes, timeout_s=30), progress_hook=die
    )
    error = ""
    for step in range(1, die_at_step + 1):
        tokens = synthetic_batch(PRESETS["tiny"], step=step, rank=rank, batch_size=2)
        model.loss(tokens).backward()
        opt.step()
        opt.zero_grad()
        try:
            rep.replicate(step)
            rep.flush()
        except ReplicationError as e:
            error = str(e)
            break
    held = {o: [i.step for i in infos] for o, infos in rep.holdings().items()}
    last_good_ok = rep.replica_slot(1, die_at_step - 1).verify()
    return {
        "error": error,
        "held": held,
        "last_good_ok": last_good_ok,
        "committed": rep.committed_step,
    }


def mismatched_layouts() -> dict:
    """Rank 1 builds a different model: replication must refuse, naming both layouts."""
    preset = "tiny" if dist.get_rank() != 1 else "small"
    model = build_model(preset)
    opt = torch.optim.AdamW(model.parameters())
    try:
        Replicator(TrainingState(model, opt))
        return {"error": ""}
    except LayoutMismatchError as e:
        return {"error": str(e)}


def refuses_what_does_not_fit() -> dict:
    """A memory budget the snapshots cannot fit in: refused before anything is allocated."""
    from p2p_state.memory import InsufficientMemoryError

    model = build_model("tiny")
    state = TrainingState(model, torch.optim.AdamW(model.parameters()))
    try:
        Replicator(state, ReplicationConfig(max_memory_fraction=1e-9))
        return {"error": ""}
    except InsufficientMemoryError as e:
        return {"error": str(e)}


def posting_threads(num_steps: int, chunk_bytes: int) -> dict:
    """Replicate over a data group and a separate control group (the arrangement beside NCCL)
    and record which thread posts what where."""
    import threading

    rank = dist.get_rank()
    model = build_model("tiny", seed=0)  # plain module: each rank's "shard" is the whole model
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = TrainingState(model, opt)
    data, control = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")
    posts: list[tuple[str, str, str]] = []
    names = {id(data): "data", id(control): "control"}
    batch, all_reduce = dist.batch_isend_irecv, dist.all_reduce

    def recorded_batch(ops):
        posts.append(("p2p", names.get(id(ops[0].group), "?"), threading.current_thread().name))
        return batch(ops)

    def recorded_all_reduce(tensor, *args, group=None, **kwargs):
        posts.append(("all_reduce", names.get(id(group), "?"), threading.current_thread().name))
        return all_reduce(tensor, *args, group=group, **kwargs)

    dist.batch_isend_irecv, dist.all_reduce = recorded_batch, recorded_all_reduce
    try:
        config = ReplicationConfig(chunk_bytes=chunk_bytes, timeout_s=60)
        rep = Replicator(state, config, group=data, control_group=control)
        same = []
        for step in range(1, num_steps + 1):
            tokens = synthetic_batch(PRESETS["tiny"], step=step, rank=rank, batch_size=2)
            model.loss(tokens).backward()
            opt.step()
            opt.zero_grad()
            rep.replicate(step)
            rep.flush()
            mine = rep.own_slot(step).buffer
            theirs = [torch.empty_like(mine) for _ in range(2)]
            dist.all_gather(theirs, mine)
            same.append(
                all(torch.equal(rep.replica_slot(o, step).buffer, theirs[o]) for o in rep.owners)
            )
        rep.close()
    finally:
        dist.batch_isend_irecv, dist.all_reduce = batch, all_reduce
    return {
        "rank": rank,
        "posts": posts,
        "committed": rep.committed_step,
        "replicas_equal": same,
    }
