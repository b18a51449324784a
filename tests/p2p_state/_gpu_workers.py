"""Per-rank functions for the GPU data-plane tests (NCCL + GPU memory, gloo + pinned memory)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from bench.models import build_model, lm_loss, shard, synthetic_batch
from p2p_state.config import ReplicationConfig
from p2p_state.replicator import Replicator
from p2p_state.state import TrainingState
from tests.p2p_state._workers import restore_from_replicas


def replicate_on_gpu(memory: str, num_steps: int) -> dict:
    """Train on the GPU, replicate into ``memory``, restore every rank from its buddy."""
    # The emulated nodes share this machine's GPUs: by global rank, one GPU per rank.
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    model = shard(build_model("tiny").cuda())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = TrainingState(model, opt)
    rep = Replicator(state, ReplicationConfig(memory=memory, chunk_bytes=64 * 1024))
    for step in range(1, num_steps + 1):
        tokens = synthetic_batch(model.cfg, step=step, rank=dist.get_rank(), batch_size=2).cuda()
        lm_loss(model, tokens).backward()
        opt.step()
        opt.zero_grad()
        rep.replicate(step)
    rep.flush()
    expected = [t.clone() for t in state.live_tensors()]
    with torch.no_grad():
        for t in state.live_tensors():
            t.zero_()
    step, _ = restore_from_replicas(rep, state)
    equal = all(torch.equal(a, b) for a, b in zip(state.live_tensors(), expected))
    kind = rep.kind.value
    rep.close()
    return {"equal": equal, "step": step, "kind": kind, "backend": rep.backend}
