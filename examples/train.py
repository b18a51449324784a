"""The example training job: a small transformer, FSDP2, protected by the engine.

Run it under p2p-run (2 emulated nodes of 2 ranks and a hot spare)::

    p2p-run --nnodes 2 --nproc-per-node 2 --node-rank 0 --coordinator 127.0.0.1:29400 \\
        --spares 1 examples/train.py --steps 20 &
    p2p-run --nnodes 2 --nproc-per-node 2 --node-rank 1 --coordinator 127.0.0.1:29400 \\
        examples/train.py --steps 20

Compared with the same script without the engine (``examples/train_plain.py``) it changes in a
handful of lines: ``p2p_state.init_process_group()`` instead of ``dist.init_process_group()``,
the model and optimizer built by a factory, and the loop inside ``p2p_state.protect()``.

Data: a synthetic corpus of token sequences, generated from a seed, cached once per node in a
memory-mapped file (``dataload``) and read in the exactly-once order of the resumable loader.
With ``--out DIR`` every rank writes ``DIR/rank<r>.json``: its final state's digest and the loss
and a digest of the batch of every step, which the demo and the tests compare with a fault-free
run. Faults to inject come from ``P2P_INJECT`` (see ``bench.faults``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import p2p_state
from bench.models import PRESETS, TinyLM, lm_loss
from dataload.cache import CacheConfig, open_or_build
from dataload.loader import ResumableLoader


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--samples", type=int, default=4096, help="sequences in the corpus")
    p.add_argument("--cache-dir", default="/dev/shm/p2p-cache")
    p.add_argument("--out", default=None, help="directory for the per-rank results")
    return p.parse_args(argv)


class SyntheticCorpus:
    """Token sequences drawn from a seed: a data source for ``dataload`` with no files."""

    def __init__(self, vocab_size: int, seq_len: int, num_samples: int, seed: int) -> None:
        self.vocab_size, self.seq_len = vocab_size, seq_len
        self.num_samples, self.seed = num_samples, seed

    @property
    def fingerprint(self) -> str:
        return f"synthetic-v1-{self.vocab_size}-{self.seq_len}-{self.num_samples}-{self.seed}"

    def build(self):
        def fill(out: np.ndarray) -> None:
            rng = np.random.Generator(np.random.PCG64(self.seed))
            out[:] = rng.integers(0, self.vocab_size, out.shape, dtype=np.int32)

        return "int32", (self.seq_len,), self.num_samples, fill


def make_build(args: argparse.Namespace):
    """The factory protect() calls at the start and after every recovery."""
    cfg = PRESETS[args.model]

    def build():
        with torch.random.fork_rng():
            torch.manual_seed(args.seed)  # the same initial weights on every rank
            model = TinyLM(cfg)
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=False)
        fully_shard(model, reshard_after_forward=False)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
        return model, optimizer, scheduler

    return build


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    build = make_build(args)
    p2p_state.init_process_group(warmup=build)  # a spare waits here until it is given a rank
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed * 1000 + rank)  # each rank's dropout stream

    cfg = PRESETS[args.model]
    corpus = SyntheticCorpus(cfg.vocab_size, cfg.seq_len + 1, args.samples, args.seed)
    cache = open_or_build(
        CacheConfig(directory=args.cache_dir, name=corpus.fingerprint),
        corpus.fingerprint,
        corpus.build,
    )
    loader = ResumableLoader(
        cache, global_batch=args.global_batch, world_size=world, rank=rank, seed=args.seed
    )

    records: dict[int, dict] = {}
    with p2p_state.protect(build, loader=loader, max_steps=args.steps) as job:
        _arm_faults(job)
        for step, batch in job:
            with job.step():
                loss = lm_loss(job.model, batch.long())
                loss.backward()
                job.optimizer.step()
                job.scheduler.step()
                job.optimizer.zero_grad(set_to_none=True)
                records[step] = {
                    "loss": loss.item(),
                    "batch": hashlib.sha256(batch.numpy().tobytes()).hexdigest()[:16],
                }
        digest = job.state.digest()
        recoveries = [
            {"generation": r.generation, "source": r.source, "step": r.step, "phases": r.phases}
            for r in job.recoveries
        ]

    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        result = {
            "rank": dist.get_rank(),
            "world_size": dist.get_world_size(),
            "digest": digest,
            "steps": {str(k): v for k, v in sorted(records.items())},
            "recoveries": recoveries,
        }
        tmp = out / f".rank{dist.get_rank()}.json.tmp"
        tmp.write_text(json.dumps(result))
        tmp.replace(out / f"rank{dist.get_rank()}.json")


def _arm_faults(job) -> None:
    from bench.faults import Injector, from_env

    faults = from_env()
    if faults:
        session = p2p_state.api.current_session()
        Injector(faults, os.environ.get("P2P_RUN_DIR", "."), session.event).arm(job)


if __name__ == "__main__":
    main()
