"""An FSDP2 MLP with a loader, an LR schedule and the small state scripts keep, protected.

The loader makes each batch from its position (and augments it with Python's ``random`` and
NumPy's global generator); the model has dropout on the global torch generator and a persistent
buffer it updates while training (a count of batches); the optimizer is AdamW or SGD
with momentum (``--optimizer``) under a warm-up-then-decay LR schedule; a count of samples seen,
which sets the clipping threshold, is kept in ``job.user_state`` (carried with every snapshot).
With ``--amp fp16`` the forward runs under fp16 autocast with a ``torch.amp.GradScaler``
given to ``protect()`` as ``stateful``: its scale starts high and grows every 3 steps, so steps
overflow and are skipped, and the scale moves all through the run. The gradients are zeroed at
the start of each step, as many scripts do, so a step the scaler skipped ends with gradients
and no update (not an accumulation across steps: the engine must tell the two apart).
"""

from __future__ import annotations

import argparse
import random

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import p2p_state

WIDTH = 32


class Loader:
    """Batches made from a position: ``next_batch``, ``state_dict``/``load_state_dict``,
    ``set_world`` (what ``protect()`` asks of a loader)."""

    def __init__(self, world_size: int, rank: int) -> None:
        self.position = 0
        self.set_world(world_size, rank)

    def set_world(self, world_size: int, rank: int) -> None:
        self.world_size, self.rank = world_size, rank

    def next_batch(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.position * self.world_size + self.rank)
        self.position += 1
        batch = torch.randn(8, WIDTH, generator=g)
        # Augmentation from the process-wide generators, as many data pipelines do it.
        batch = batch * random.uniform(0.5, 1.5) + float(np.random.normal(0.0, 0.1))
        return batch

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(WIDTH, 64),
            torch.nn.GELU(),
            torch.nn.Dropout(0.2),
            torch.nn.Linear(64, WIDTH),
        )
        # Like BatchNorm's num_batches_tracked: the same on every rank.
        self.register_buffer("batches_seen", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.batches_seen += 1
        # Inputs are damped as training goes on.
        return self.net(x / (1.0 + 0.05 * self.batches_seen))


def build(args: argparse.Namespace):
    torch.manual_seed(0)
    model = MLP()
    fully_shard(model)
    if args.optimizer == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=3)
    decay = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, decay], milestones=[3])
    return model, optimizer, scheduler


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--amp", choices=("none", "fp16"), default="none")
    args = p.parse_args()
    torch.set_num_threads(1)
    p2p_state.init_process_group()
    rank = dist.get_rank()
    torch.manual_seed(rank)
    random.seed(rank)
    np.random.seed(rank)
    loader = Loader(dist.get_world_size(), rank)
    fp16 = args.amp == "fp16"
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=3, enabled=fp16)
    protected = p2p_state.protect(
        lambda: build(args), loader=loader, max_steps=args.steps, stateful={"scaler": scaler}
    )
    with protected as job:
        for _step, batch in job:
            with job.step():
                seen = job.user_state.get("samples_seen", 0)
                job.optimizer.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
                    loss = (job.model(batch) - batch).pow(2).mean()
                scaler.scale(loss).backward()
                scaler.unscale_(job.optimizer)
                # A clipping curriculum: tight for the first samples, looser afterwards.
                max_norm = 0.1 if seen < 40 else 1.0
                torch.nn.utils.clip_grad_norm_(job.model.parameters(), max_norm=max_norm)
                scaler.step(job.optimizer)
                scaler.update()
                job.scheduler.step()
                job.user_state["samples_seen"] = seen + batch.shape[0]


if __name__ == "__main__":
    main()
