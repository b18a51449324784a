"""The example training job as people run it today: plain FSDP2, DCP checkpoints, torchrun.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node 4 --max-restarts 3 \\
        examples/train_plain.py --steps 20 --checkpoint-dir /tmp/ckpt --checkpoint-every 5

A fault kills the whole job; torchrun restarts every process, which re-initialise their process
group, load the last checkpoint and recompute the steps since it. That is the baseline of
``p2p-bench baseline`` (the ``P2P_TIMELINE`` file records its milestones). Compare with
``train.py``, the same job protected by the engine.
"""

from __future__ import annotations

import time

STARTED = time.monotonic()  # before the imports: importing torch is part of a restart

import os  # noqa: E402

import fsspec  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402

from bench.models import lm_loss  # noqa: E402

import example_job as common  # noqa: E402  (a sibling of this script)


def latest_checkpoint(root: str | None) -> int:
    """Step of the latest complete checkpoint under ``root``, a directory or an fsspec URL
    (0 if there is none). DCP writes ``.metadata`` last, so a save cut short never counts."""
    if not root:
        return 0
    fs, path = fsspec.core.url_to_fs(root)
    if not fs.exists(path):
        return 0
    steps = []
    for entry in fs.ls(path, detail=False):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if name.startswith("step-") and fs.exists(f"{entry.rstrip('/')}/.metadata"):
            steps.append(int(name.removeprefix("step-")))
    return max(steps, default=0)


def main(argv: list[str] | None = None) -> None:
    args = common.parse_args(argv, __doc__.splitlines()[0])
    rank = int(os.environ["RANK"])
    timeline = common.Timeline(rank)
    timeline.mark("started", t=STARTED, pid=os.getpid())
    timeline.mark("imported")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    common.init_plain_process_group()
    timeline.mark("communicators")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed * 1000 + rank)  # each rank's dropout stream
    loader = common.make_loader(args, world, rank)
    results = common.Results(args.out)

    model, optimizer, scheduler = common.make_build(args)()
    timeline.mark("model_built")
    start = latest_checkpoint(args.checkpoint_dir)
    if start:
        model_sd, optim_sd = get_state_dict(model, [optimizer])
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=f"{args.checkpoint_dir}/step-{start}")
        set_state_dict(
            model, [optimizer], model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        for _ in range(start):
            scheduler.step()
        loader.seek(start)
    timeline.mark("checkpoint_loaded", step=start)

    for step in range(start + 1, args.steps + 1):
        batch = loader.next_batch()
        if step == start + 1:
            timeline.mark("data_ready", step=step)
        loss = lm_loss(model, batch.long().to(common.device()))
        # The same update at any world size (1.0 when the global batch divides).
        (loss * loader.loss_weight()).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        results.record(step, loss, batch, loader.last_ids)
        if args.checkpoint_dir and step % args.checkpoint_every == 0:
            timeline.mark("checkpoint_saving", step=step)
            model_sd, optim_sd = get_state_dict(model, [optimizer])
            dcp.save(
                {"model": model_sd, "optim": optim_sd},
                checkpoint_id=f"{args.checkpoint_dir}/step-{step}",
            )
            timeline.mark("checkpoint_saved", step=step)
        if rank == 0:
            timeline.mark("step_done", step=step)
    results.write(rank, world, started_at=start)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
