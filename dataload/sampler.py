"""The exactly-once, resize-aware sampler: pure functions of a few integers.

An epoch is one permutation of all sample ids, drawn from ``(seed, epoch)``. Training consumes it
in global order, ``global_batch`` ids per step, whatever the world size: at step ``k`` of an
epoch the step's ids are ``perm[k * global_batch : (k + 1) * global_batch]`` and each rank takes
a contiguous slice of them. The whole state is ``(seed, epoch, offset)``, where ``offset`` counts
the ids of this epoch already consumed, so after a replace, a shrink or a grow every remaining id
of the epoch is still consumed exactly once and the global batch does not change.

When the global batch does not divide by the world size, ranks get uneven slices that still sum to
the global batch (the first ``global_batch % world_size`` ranks take one sample more). A loss that
is averaged per rank must then be weighted by ``local_size / global_batch`` for the update to equal
the one at any other world size; :class:`BatchPlan` gives the weights. The last step of an epoch
takes the remainder (a smaller global batch) unless ``drop_last`` is set, so every id of the epoch
is seen exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np


@dataclass(frozen=True, slots=True)
class SamplerState:
    """Where the data stream stands: the whole resumable state of the sampler."""

    seed: int
    epoch: int = 0
    offset: int = 0
    """Sample ids of this epoch already consumed (globally, by all ranks together)."""

    def to_dict(self) -> dict[str, int]:
        """For the replicated extras / a checkpoint."""
        return {"seed": self.seed, "epoch": self.epoch, "offset": self.offset}

    @classmethod
    def from_dict(cls, d: dict[str, int]) -> SamplerState:
        """Inverse of :meth:`to_dict`."""
        return cls(int(d["seed"]), int(d["epoch"]), int(d["offset"]))


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """How one step's global batch is split over ranks and micro-batches."""

    global_batch: int
    world_size: int
    per_rank: tuple[int, ...]
    """Samples each rank takes this step (sums to ``global_batch``)."""
    max_micro_batch: int
    grad_accum_steps: int
    """Micro-batches per rank per step: ``ceil(max(per_rank) / max_micro_batch)``."""

    def rank_slice(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of ``rank``'s samples within the step's global batch."""
        start = sum(self.per_rank[:rank])
        return start, start + self.per_rank[rank]

    def loss_weight(self, rank: int) -> float:
        """Weight of ``rank``'s mean loss so the summed update equals a global mean."""
        return self.per_rank[rank] / self.global_batch * self.world_size

    def micro_batches(self, rank: int) -> list[int]:
        """Sizes of ``rank``'s micro-batches this step (as even as possible)."""
        n, k = self.per_rank[rank], self.grad_accum_steps
        return [n // k + (1 if i < n % k else 0) for i in range(k)]


def plan_batch(global_batch: int, world_size: int, max_micro_batch: int) -> BatchPlan:
    """Split a global batch over ``world_size`` ranks and micro-batches of at most the given size.

    Raises:
        ValueError: a size is not positive, or there are more ranks than samples per step.
    """
    if global_batch < 1 or world_size < 1 or max_micro_batch < 1:
        raise ValueError(
            f"global_batch={global_batch}, world_size={world_size} and "
            f"max_micro_batch={max_micro_batch} must all be >= 1"
        )
    if world_size > global_batch:
        raise ValueError(
            f"world_size={world_size} exceeds global_batch={global_batch}: some ranks would get "
            "no sample; raise the global batch or run on fewer ranks"
        )
    base, extra = divmod(global_batch, world_size)
    per_rank = tuple(base + (1 if r < extra else 0) for r in range(world_size))
    accum = -(-max(per_rank) // max_micro_batch)
    return BatchPlan(global_batch, world_size, per_rank, max_micro_batch, accum)


@lru_cache(maxsize=4)
def epoch_permutation(seed: int, epoch: int, num_samples: int) -> np.ndarray:
    """The order of all sample ids in ``epoch``: a pure function of its arguments."""
    rng = np.random.Generator(np.random.PCG64([seed, epoch]))
    perm = rng.permutation(num_samples).astype(np.int64)
    perm.flags.writeable = False
    return perm


def steps_per_epoch(num_samples: int, global_batch: int, drop_last: bool = False) -> int:
    """Optimizer steps in one epoch."""
    return num_samples // global_batch if drop_last else -(-num_samples // global_batch)


def step_ids(
    state: SamplerState, num_samples: int, global_batch: int, drop_last: bool = False
) -> np.ndarray:
    """All sample ids of the next step (every rank's together), in global order."""
    if state.offset >= num_samples or (drop_last and state.offset + global_batch > num_samples):
        raise ValueError(f"epoch {state.epoch} is exhausted at offset {state.offset}")
    perm = epoch_permutation(state.seed, state.epoch, num_samples)
    return perm[state.offset : state.offset + global_batch]


def rank_ids(
    state: SamplerState,
    num_samples: int,
    global_batch: int,
    world_size: int,
    rank: int,
    drop_last: bool = False,
) -> np.ndarray:
    """The sample ids ``rank`` takes at the next step (a contiguous slice of the step's ids)."""
    ids = step_ids(state, num_samples, global_batch, drop_last)
    plan = plan_batch(len(ids), min(world_size, len(ids)), len(ids))
    if rank >= plan.world_size:
        return ids[:0]  # a last, short step with fewer samples than ranks
    start, end = plan.rank_slice(rank)
    return ids[start:end]


def advance(
    state: SamplerState, num_samples: int, global_batch: int, drop_last: bool = False
) -> SamplerState:
    """The state after one step (moving to the next epoch when this one is used up)."""
    offset = state.offset + global_batch
    if offset >= num_samples or (drop_last and offset + global_batch > num_samples):
        return SamplerState(state.seed, state.epoch + 1, 0)
    return SamplerState(state.seed, state.epoch, offset)


def state_at_step(
    seed: int, step: int, num_samples: int, global_batch: int, drop_last: bool = False
) -> SamplerState:
    """The state before global step ``step`` (0-based), in O(1): no replay of an iterator."""
    spe = steps_per_epoch(num_samples, global_batch, drop_last)
    epoch, within = divmod(step, spe)
    return SamplerState(seed, epoch, within * global_batch)
