"""A protected training script that knows nothing of p2p-bench (``p2p-bench inject --script``).

A small MLP sharded with FSDP2 over gloo, AdamW, and a loader of its own that makes each batch
from its position, the rank and the world size: the smallest loader ``protect()`` can rewind.
``--log-every N`` prints the loss averaged over the ranks (an ``all_reduce``) every N steps,
inside the step's guard, or after it with ``--log-outside`` (the mistake the engine warns of).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import p2p_state


class PositionLoader:
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
        return torch.randn(8, 32, generator=g)

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


def build(lr: float):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32), torch.nn.Dropout(0.1)
    )
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--log-every", type=int, default=0)
    p.add_argument("--log-outside", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    p2p_state.init_process_group()
    loader = PositionLoader(dist.get_world_size(), dist.get_rank())
    with p2p_state.protect(lambda: build(args.lr), loader=loader, max_steps=args.steps) as job:
        for step, batch in job:
            logging = args.log_every and step % args.log_every == 0
            with job.step():
                loss = (job.model(batch) - batch).pow(2).mean()
                loss.backward()
                job.optimizer.step()
                job.optimizer.zero_grad()
                if logging and not args.log_outside:
                    log(step, loss)
            if logging and args.log_outside:
                log(step, loss)


def log(step: int, loss: torch.Tensor) -> None:
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    if dist.get_rank() == 0:
        print(f"step {step}: loss {mean.item() / dist.get_world_size():.4f}", flush=True)


if __name__ == "__main__":
    main()
