"""What the example training scripts share: flags, data, the model factory and result files.

``train_plain.py`` (plain FSDP2 with DCP checkpoints, run by torchrun) and ``train.py`` (the
same job protected by the engine, run by p2p-run) differ only in the engine's lines; everything
here is the part a real script would have anyway.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
from torch.distributed.fsdp import fully_shard

from bench.models import PRESETS, TinyLM, lm_loss
from bench.probe import write_results
from dataload.cache import CacheConfig, open_or_build
from dataload.loader import ResumableLoader
from launcher.protocol import ENV_TIMELINE


def parse_args(argv: list[str] | None = None, description: str = "") -> argparse.Namespace:
    """The example job's flags."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--samples", type=int, default=4096, help="sequences in the corpus")
    p.add_argument("--cache-dir", default="/dev/shm/p2p-cache")
    p.add_argument("--out", default=None, help="directory for the per-rank results")
    p.add_argument("--checkpoint-dir", default=None, help="DCP checkpoints (train_plain.py)")
    p.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints")
    return p.parse_args(argv)


class SyntheticCorpus:
    """Token sequences drawn from a seed: a data source for ``dataload`` with no files."""

    def __init__(self, vocab_size: int, seq_len: int, num_samples: int, seed: int) -> None:
        self.vocab_size, self.seq_len = vocab_size, seq_len
        self.num_samples, self.seed = num_samples, seed

    @property
    def fingerprint(self) -> str:
        """Identifies the corpus (the cache is rebuilt when it changes)."""
        return f"synthetic-v1-{self.vocab_size}-{self.seq_len}-{self.num_samples}-{self.seed}"

    def build(self):
        """``(dtype, sample shape, count, fill)`` for the cache builder."""

        def fill(out: np.ndarray) -> None:
            rng = np.random.Generator(np.random.PCG64(self.seed))
            out[:] = rng.integers(0, self.vocab_size, out.shape, dtype=np.int32)

        return "int32", (self.seq_len,), self.num_samples, fill


def make_loader(args: argparse.Namespace, world_size: int, rank: int) -> ResumableLoader:
    """This rank's loader over the node's cache of the corpus (built once per node)."""
    cfg = PRESETS[args.model]
    corpus = SyntheticCorpus(cfg.vocab_size, cfg.seq_len + 1, args.samples, args.seed)
    cache = open_or_build(
        CacheConfig(directory=args.cache_dir, name=corpus.fingerprint),
        corpus.fingerprint,
        corpus.build,
    )
    return ResumableLoader(
        cache, global_batch=args.global_batch, world_size=world_size, rank=rank, seed=args.seed
    )


def device() -> torch.device:
    """Where this rank trains: its GPU (``LOCAL_RANK``'s, as torchrun and p2p-run assign them),
    else the CPU. FSDP2 moves a model built on the CPU to this device; batches are moved here."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_plain_process_group() -> None:
    """``init_process_group`` as a plain FSDP2 script calls it: NCCL on this rank's GPU where
    there is one (gloo beside it for CPU tensors), gloo alone on CPUs."""
    import torch.distributed as dist

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device())
    else:
        dist.init_process_group("gloo")


def make_build(args: argparse.Namespace, restoring=lambda: False):
    """The factory of the sharded model, its optimizer and its LR schedule.

    ``restoring()`` (``p2p_state.restoring`` in the protected script) says the weights will be
    overwritten from peers: the model is then built on the meta device and its local shards
    allocated without drawing initial values.
    """
    cfg = PRESETS[args.model]

    def build():
        skip_init = restoring()
        if skip_init:
            with torch.device("meta"):
                model = TinyLM(cfg)
        else:
            with torch.random.fork_rng():
                torch.manual_seed(args.seed)  # the same initial weights on every rank
                model = TinyLM(cfg)
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=False)
        fully_shard(model, reshard_after_forward=False)
        if skip_init:
            model.to_empty(device=device())
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
        return model, optimizer, scheduler

    return build


def make_warmup_step(args: argparse.Namespace):
    """One training step on made-up tokens shaped like a rank's batch (a spare's warm-up)."""
    cfg = PRESETS[args.model]
    rows = max(1, args.global_batch // int(os.environ.get("WORLD_SIZE", "1")))

    def warmup_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        tokens = torch.zeros(rows, cfg.seq_len + 1, dtype=torch.long, device=device())
        lm_loss(model, tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return warmup_step


class Results:
    """The loss and a digest of the batch of every step, written per rank with ``--out``."""

    def __init__(self, out: str | None) -> None:
        self.out = Path(out) if out else None
        self.steps: dict[int, dict] = {}

    def record(self, step: int, loss: torch.Tensor, batch: torch.Tensor, ids=None) -> None:
        """What step ``step`` saw and computed (a redone step overwrites its first attempt)."""
        digest = hashlib.sha256(batch.numpy().tobytes()).hexdigest()[:16]
        self.steps[step] = {"loss": loss.item(), "batch": digest}
        if ids is not None:
            self.steps[step]["ids"] = [int(i) for i in ids]

    def write(self, rank: int, world_size: int, **fields) -> None:
        """``<out>/rank<r>.json``, atomically."""
        if self.out is not None:
            write_results(self.out, rank, world_size, self.steps, **fields)


class Timeline:
    """Monotonic timestamps of a plain script's milestones (JSON lines, shared by the ranks).

    Written only when ``P2P_TIMELINE`` names a file (the checkpoint-restart baseline of
    ``p2p-bench``); the engine keeps its own event log.
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        path = os.environ.get(ENV_TIMELINE)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if path else None

    def mark(self, event: str, t: float | None = None, **fields) -> None:
        """One line: ``{"t", "event", "rank", ...}`` (``t`` defaults to now)."""
        if self._fd is not None:
            when = time.monotonic() if t is None else t
            line = {"t": when, "event": event, "rank": self.rank, **fields}
            os.write(self._fd, (json.dumps(line) + "\n").encode())
