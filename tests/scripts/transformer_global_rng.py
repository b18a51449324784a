"""A small Transformer trained the way many FSDP2 scripts train one, protected by p2p_state.

Built on the meta device, sharded block by block, then ``to_empty()`` and
``reset_parameters()``; bf16 mixed precision with fp32 gradient reduction; explicit forward and
backward prefetching; Adam with gradient-norm clipping. There is no loader: every step draws
its tokens from the global torch generator, its dropout masks too, and a sequence length from
Python's ``random`` and a label-noise rate from NumPy's global generator.
"""

from __future__ import annotations

import argparse
import itertools
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import p2p_state

VOCAB, DIM, HEADS, MAX_SEQ = 64, 32, 4, 16


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(DIM)
        self.attn = torch.nn.MultiheadAttention(DIM, HEADS, dropout=0.1, batch_first=True)
        self.norm2 = torch.nn.LayerNorm(DIM)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(DIM, 4 * DIM),
            torch.nn.GELU(),
            torch.nn.Linear(4 * DIM, DIM),
            torch.nn.Dropout(0.1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Transformer(torch.nn.Module):
    def __init__(self, num_blocks: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.pos = torch.nn.Embedding(MAX_SEQ, DIM)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(num_blocks))
        self.norm = torch.nn.LayerNorm(DIM)
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1])
        x = self.embed(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def reset_parameters(self) -> None:
        for module in self.modules():
            if module is not self and hasattr(module, "reset_parameters"):
                module.reset_parameters()
        # MultiheadAttention keeps its input projection in its own parameters.
        for block in self.blocks:
            block.attn._reset_parameters()


_builds = itertools.count(1)


def build(args: argparse.Namespace):
    # With --factory-draws, each call of the factory in this process draws more from the global
    # generator than the last (a spare builds more often than a survivor).
    torch.rand(args.factory_draws * next(_builds))
    with torch.device("meta"):
        model = Transformer(args.blocks)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    reshard = not args.no_reshard
    for block in model.blocks:
        fully_shard(block, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mp_policy=policy, reshard_after_forward=reshard)
    blocks = list(model.blocks)
    for current, following in itertools.pairwise(blocks):
        current.set_modules_to_forward_prefetch([following])
        following.set_modules_to_backward_prefetch([current])
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.reset_parameters()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.95))
    return model, optimizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--factory-draws", type=int, default=0, help="draws per factory call")
    p.add_argument("--no-reshard", action="store_true", help="reshard_after_forward=False")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    p2p_state.init_process_group(warmup=lambda: build(args))
    # Every rank draws its own batches.
    torch.manual_seed(1000 + dist.get_rank())
    with p2p_state.protect(lambda: build(args), max_steps=args.steps) as job:
        for _step, _ in job:
            with job.step():
                seq = random.randint(MAX_SEQ // 2, MAX_SEQ)
                tokens = torch.randint(0, VOCAB, (args.batch, seq + 1))
                noisy = torch.rand(tokens.shape) < np.random.uniform(0.0, 0.1)
                tokens = torch.where(noisy, torch.randint_like(tokens, VOCAB), tokens)
                logits = job.model(tokens[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))
                loss.backward()
                torch.nn.utils.clip_grad_norm_(job.model.parameters(), max_norm=1.0)
                job.optimizer.step()
                job.optimizer.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
