"""The example model: a small decoder-only transformer, sharded with FSDP2, and synthetic data.

Sizes are presets so tests, benchmarks and the demo agree on what "the example model" is. Data is
generated from (seed, step, rank), so every run sees the same batches without any download.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    """Shape of the example transformer."""

    vocab_size: int = 8192
    dim: int = 384
    num_layers: int = 4
    num_heads: int = 6
    seq_len: int = 128
    dropout: float = 0.1
    """Dropout makes every step consume RNG, so a restore must bring the RNG state back too."""

    def __post_init__(self) -> None:
        if self.dim % self.num_heads:
            raise ValueError(
                f"ModelConfig.dim={self.dim} must be a multiple of num_heads={self.num_heads}"
            )

    @property
    def num_params(self) -> int:
        """Number of parameters of the model this config builds."""
        per_layer = 12 * self.dim * self.dim + 13 * self.dim
        return 2 * self.vocab_size * self.dim + self.num_layers * per_layer + 2 * self.dim


#: Named sizes: ``tiny`` for multi-process tests, ``example`` for benchmarks and the demo.
PRESETS: dict[str, ModelConfig] = {
    # vocab 250 on 4 ranks shards 63/63/63/61 rows: every rank gets a different layout.
    "tiny": ModelConfig(vocab_size=250, dim=64, num_layers=2, num_heads=2, seq_len=32),
    "small": ModelConfig(vocab_size=2048, dim=128, num_layers=2, num_heads=4, seq_len=64),
    "example": ModelConfig(),
}


class Block(nn.Module):
    """Pre-norm attention and MLP."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.up = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.down = nn.Linear(4 * cfg.dim, cfg.dim)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.num_heads, -1).unbind(2)
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.dropout(self.proj(att.transpose(1, 2).reshape(b, t, d)))
        out: torch.Tensor = x + self.dropout(self.down(F.gelu(self.up(self.norm2(x)))))
        return out


class TinyLM(nn.Module):
    """Token embedding, positional embedding, blocks, and an untied output head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos = nn.Parameter(torch.zeros(cfg.seq_len, cfg.dim))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        nn.init.normal_(self.pos, std=1.0 / math.sqrt(cfg.dim))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy over a batch of token sequences."""
        return lm_loss(self, tokens)


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, calling ``model`` itself (so DDP/FSDP wrappers see the forward)."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def build_model(preset: str | ModelConfig = "tiny", *, seed: int = 0) -> TinyLM:
    """A freshly initialised example model (same weights on every rank for the same seed)."""
    cfg = PRESETS[preset] if isinstance(preset, str) else preset
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return TinyLM(cfg)


def shard(model: TinyLM, *, reshard_after_forward: bool = False) -> TinyLM:
    """Apply FSDP2 ``fully_shard`` per block and at the root, on the default process group.

    ``reshard_after_forward=False`` keeps the unsharded parameters between forward and backward,
    which on a CPU with gloo saves one all-gather per block per step.
    """
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    return model


def synthetic_batch(
    cfg: ModelConfig, *, step: int, rank: int, batch_size: int, seed: int = 0
) -> torch.Tensor:
    """The token batch of ``rank`` at ``step``: a pure function of its arguments."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 9_973 + rank)
    return torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len), generator=g)
