"""A protected training script that knows nothing of p2p-bench (``p2p-bench inject --script``).

A small FSDP2 classifier over gloo fed from a ``torch.utils.data.Dataset`` of its own, as people
write them: ``__getitem__`` returns a ``(features, label)`` pair and augments it with noise from
torch's global generator and a flip from Python's ``random``; ``dataload.loader.DatasetLoader``
collates the pairs as a ``DataLoader`` does, on the training thread or with ``--workers N`` in
worker processes. 150 samples in global batches of 32, so an epoch ends within a few steps and
the next is drawn in another order. Cross-entropy with label
smoothing, dropout, AdamW, gradient clipping. ``--log-every N`` prints the loss averaged over
the ranks (an ``all_reduce``) every N steps, inside the step's guard, or after it with
``--log-outside`` (the mistake the engine warns of), over a group ``build`` makes with
``--log-group``. ``--bug-at N`` raises a ``ValueError`` on
every rank in step N: a bug of the script's, the same however often it is run; ``--cast-at N``
casts the model to float64 in step N, after its optimizer step (a change the engine cannot
carry: the model is changed in the factory).
"""

from __future__ import annotations

import argparse
import random

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.utils.data import Dataset

import p2p_state
from dataload.loader import DatasetLoader

FEATURES, CLASSES = 24, 6


class Points(Dataset):
    """Sample ``i``: a point near its class's centre, jittered each time it is read."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.centres = torch.randn(CLASSES, FEATURES, generator=g) * 2
        self.labels = torch.randint(0, CLASSES, (n,), generator=g)
        self.points = self.centres[self.labels] + torch.randn(n, FEATURES, generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x = self.points[i] + 0.1 * torch.randn(FEATURES)  # augmentation: the global generator
        if random.random() < 0.5:
            x = x.flip(0)
        return x, int(self.labels[i])


#: The group the loss is averaged over for the log: the default one, or with ``--log-group`` one
#: ``build`` makes (as a job that logs over its data-parallel sub-group does).
LOG_GROUP: dist.ProcessGroup | None = None


def build(lr: float, log_group: bool = False):
    global LOG_GROUP
    if log_group:
        LOG_GROUP = dist.new_group(backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 64),
        torch.nn.GELU(),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(64, CLASSES),
    )
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--log-every", type=int, default=0)
    p.add_argument("--log-outside", action="store_true")
    p.add_argument("--log-group", action="store_true")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--bug-at", type=int, default=-1)
    p.add_argument("--cast-at", type=int, default=-1)
    args = p.parse_args()
    torch.set_num_threads(1)
    p2p_state.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(100 + rank)
    random.seed(100 + rank)
    loader = DatasetLoader(
        Points(150), global_batch=32, world_size=world, rank=rank, seed=7, num_workers=args.workers
    )
    with p2p_state.protect(
        lambda: build(args.lr, args.log_group), loader=loader, max_steps=args.steps
    ) as job:
        for step, (x, y) in job:
            logging = args.log_every and step % args.log_every == 0
            with job.step():
                loss = F.cross_entropy(job.model(x), y, label_smoothing=0.1)
                loss.backward()
                if step == args.bug_at:
                    raise ValueError(f"the loss scale is not set (step {step})")
                torch.nn.utils.clip_grad_norm_(job.model.parameters(), max_norm=1.0)
                job.optimizer.step()
                job.optimizer.zero_grad()
                if step == args.cast_at:
                    job.model.double()
                if logging and not args.log_outside:
                    log(step, loss)
            if logging and args.log_outside:
                log(step, loss)


def log(step: int, loss: torch.Tensor) -> None:
    mean = loss.detach().clone()
    dist.all_reduce(mean, group=LOG_GROUP)
    if dist.get_rank() == 0:
        print(f"step {step}: loss {mean.item() / dist.get_world_size():.4f}", flush=True)


if __name__ == "__main__":
    main()
