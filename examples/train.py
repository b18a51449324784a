"""The example training job protected by the engine: a small transformer, FSDP2, p2p-run.

Run it under p2p-run (2 emulated nodes of 2 ranks and a hot spare)::

    p2p-run --nnodes 2 --nproc-per-node 2 --node-rank 0 --coordinator 127.0.0.1:29400 \\
        --spares 1 examples/train.py --steps 20 &
    p2p-run --nnodes 2 --nproc-per-node 2 --node-rank 1 --coordinator 127.0.0.1:29400 \\
        examples/train.py --steps 20

It is ``train_plain.py`` (plain FSDP2 with DCP checkpoints) with the engine's lines: see
``diff -u examples/train_plain.py examples/train.py``. With ``--out DIR`` every rank writes
``DIR/rank<r>.json`` (its final state's digest, the loss and batch of every step), which the
demo and the tests compare with a fault-free run. ``p2p-bench`` injects its faults through the
engine's ``P2P_JOB_HOOKS`` (see ``bench.probe``): nothing here knows of them.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import p2p_state
from bench.models import lm_loss

import example_job as common  # a sibling of this script


def main(argv: list[str] | None = None) -> None:
    args = common.parse_args(argv, __doc__.splitlines()[0])
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    build = common.make_build(args, restoring=p2p_state.restoring)
    # A spare waits here until it is given a rank, warmed up by a build and a step meanwhile.
    p2p_state.init_process_group(warmup=build, warmup_step=common.make_warmup_step(args))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed * 1000 + rank)  # each rank's dropout stream
    loader = common.make_loader(args, world, rank)
    results = common.Results(args.out)

    with p2p_state.protect(build, loader=loader, max_steps=args.steps) as job:
        for step, batch in job:
            with job.step():
                loss = lm_loss(job.model, batch.long().to(common.device()))
                # The same update at any world size (1.0 when the global batch divides).
                (loss * loader.loss_weight()).backward()
                job.optimizer.step()
                job.scheduler.step()
                job.optimizer.zero_grad(set_to_none=True)
                results.record(step, loss, batch, loader.last_ids)
        digest = job.state.digest()
        recoveries = [
            {"generation": r.generation, "source": r.source, "step": r.step, "phases": r.phases}
            for r in job.recoveries
        ]
    results.write(dist.get_rank(), dist.get_world_size(), digest=digest, recoveries=recoveries)


if __name__ == "__main__":
    main()
