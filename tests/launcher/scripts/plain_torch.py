"""A plain torch script with no engine code, as it would run under torchrun."""

import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
with open(os.path.join(os.environ["P2P_RUN_DIR"], f"out{dist.get_rank()}"), "w") as f:
    f.write(f"{dist.get_rank()} {dist.get_world_size()} {os.environ['LOCAL_RANK']} {t.item()}")
dist.destroy_process_group()
