"""A protected script with gradient accumulation, activation checkpointing and an evaluation.

Written as larger FSDP2 jobs are: each block sharded and wrapped in activation checkpointing
(``torch.utils.checkpoint`` without re-entrance, dropout inside, so the recomputation replays
the forward's random masks), a step of ``--micro-batches`` micro-batches whose gradients are
reduced once, in the last backward (``set_requires_gradient_sync``), AdamW with weight decay
on the matrices only (two parameter groups), a warm-up-then-cosine schedule
written as a ``LambdaLR`` closure, clipping, and an evaluation on held-out data every
``--eval-every`` steps (``eval()``, ``no_grad()``, the metric averaged over the ranks, back to
``train()``) inside the step's guard. Batches are drawn from a ``torch.Generator`` and a
NumPy ``default_rng`` of the script's own, given to ``protect(stateful=...)``; dropout from
the global generator.

With ``--step-every N`` a step is one micro-batch and the optimizer steps every N steps, the
gradients accumulated across steps (``gradient_accumulation_steps`` as many loops have it): a
state kept between two updates lacks the gradients, so it needs ``--replicate-every N``.

With ``--average DECAY`` the model also keeps an exponential moving average of its weights, as
image and diffusion models are trained: a copy of the network in the same module (so the
engine carries it with the model's state), sharded as its own unit, never given to the
optimizer, updated after each optimizer step, and evaluated beside it.
"""

from __future__ import annotations

import argparse
import copy
import math

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import checkpoint

import p2p_state

DIM, CLASSES = 32, 5


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(DIM)
        self.up = torch.nn.Linear(DIM, 2 * DIM)
        self.down = torch.nn.Linear(2 * DIM, DIM)
        self.drop = torch.nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(F.gelu(self.up(self.norm(x)))))


class Net(torch.nn.Module):
    def __init__(self, num_blocks: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(num_blocks))
        self.head = torch.nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.training else block(x)
        return self.head(x)


class Averaged(torch.nn.Module):
    """The network trained and a moving average of its weights, kept in one module."""

    def __init__(self, net: Net) -> None:
        super().__init__()
        self.net = net
        self.average = copy.deepcopy(net).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    @torch.no_grad()
    def update_average(self, decay: float) -> None:
        averages, weights = list(self.average.parameters()), list(self.net.parameters())
        torch._foreach_lerp_(averages, weights, 1.0 - decay)


def build(args: argparse.Namespace):
    torch.manual_seed(0)
    net = Net(args.blocks)
    model: torch.nn.Module = Averaged(net) if args.average else net
    for block in net.blocks:
        fully_shard(block)
    if args.average:
        for block in model.average.blocks:
            fully_shard(block)
        fully_shard(model.average)
    fully_shard(model)
    decay = [p for p in net.parameters() if p.dim() >= 2]
    no_decay = [p for p in net.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
    )
    warmup = 3

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, args.steps - warmup)))

    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def evaluate(model: torch.nn.Module, held_out: tuple[torch.Tensor, torch.Tensor]) -> float:
    model.eval()
    with torch.no_grad():
        x, y = held_out
        accuracy = (model(x).argmax(-1) == y).float().mean()
        dist.all_reduce(accuracy)
    model.train()
    return accuracy.item() / dist.get_world_size()


class Batches:
    """Micro-batches near the class centres, drawn from generators of the script's own."""

    def __init__(self, rank: int, size: int) -> None:
        g = torch.Generator().manual_seed(99)
        self.centres = torch.randn(CLASSES, DIM, generator=g)
        held_out_y = torch.randint(0, CLASSES, (16,), generator=g)
        self.held_out = (self.centres[held_out_y] + torch.randn(16, DIM, generator=g), held_out_y)
        self.size = size
        self.order = torch.Generator().manual_seed(500 + rank)
        self.spread = np.random.default_rng(700 + rank)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.randint(0, CLASSES, (self.size,), generator=self.order)
        x = self.centres[y] + torch.randn(self.size, DIM, generator=self.order)
        return x * float(self.spread.uniform(0.5, 1.5)), y


def across_steps(job, step: int, args: argparse.Namespace, batches: Batches) -> None:
    """One micro-batch per step, an update every ``--step-every`` steps (the gradients are
    accumulated across steps, as loops with a ``gradient_accumulation_steps`` setting do)."""
    x, y = batches.next()
    update = step % args.step_every == 0
    job.model.set_requires_gradient_sync(update)
    loss = F.cross_entropy(job.model(x), y) / args.step_every
    loss.backward()
    if update:
        torch.nn.utils.clip_grad_norm_(job.model.parameters(), max_norm=1.0)
        job.optimizer.step()
        job.scheduler.step()
        job.optimizer.zero_grad(set_to_none=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--micro-batches", type=int, default=3)
    p.add_argument("--micro-batch", type=int, default=6)
    p.add_argument("--eval-every", type=int, default=3)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--average", type=float, default=0.0, help="decay of a weight average")
    p.add_argument("--step-every", type=int, default=0, help="accumulate across N steps")
    args = p.parse_args()
    torch.set_num_threads(1)
    p2p_state.init_process_group()
    rank = dist.get_rank()
    batches = Batches(rank, args.micro_batch)
    held_out = batches.held_out
    torch.manual_seed(300 + rank)  # dropout
    # The script's own generators are invisible to the engine: given as stateful, they are
    # carried with every snapshot and drawn from again after a recovery as in a run without it.
    generators = {"order": batches.order, "spread": batches.spread}
    with p2p_state.protect(lambda: build(args), max_steps=args.steps, stateful=generators) as job:
        for step, _ in job:
            if args.step_every:
                with job.step():
                    across_steps(job, step, args, batches)
                continue
            with job.step():
                for i in range(args.micro_batches):
                    x, y = batches.next()
                    job.model.set_requires_gradient_sync(i == args.micro_batches - 1)
                    loss = F.cross_entropy(job.model(x), y) / args.micro_batches
                    loss.backward()
                torch.nn.utils.clip_grad_norm_(job.model.parameters(), max_norm=1.0)
                job.optimizer.step()
                job.scheduler.step()
                job.optimizer.zero_grad(set_to_none=True)
                if args.average:
                    job.model.update_average(args.average)
                if args.eval_every and step % args.eval_every == 0:
                    line = f"step {step}: held-out accuracy {evaluate(job.model, held_out):.3f}"
                    if args.average:
                        line += f", of the average {evaluate(job.model.average, held_out):.3f}"
                    if rank == 0:
                        print(line, flush=True)


if __name__ == "__main__":
    main()
