"""The resumable loaders: this rank's batch of every step, in the sampler's order.

What the recovery engine calls (``protect(..., loader=...)``):

- ``loader.next_batch()``: this rank's batch of the next step;
- ``loader.state_dict()`` -> ``{"seed", "epoch", "offset"}``: a few integers, carried in the
  replicated state with every snapshot;
- ``loader.load_state_dict(d)``: put the stream back where a snapshot was taken (O(1));
- ``loader.set_world(world_size, rank)``: after a resize; the global batch stays the same.

:class:`ResumableLoader` reads fixed-size samples from the node's memory-mapped cache and
prefetches the next batch on a background thread. :class:`DatasetLoader` takes any map-style
dataset (``len(dataset)`` and ``dataset[i]``, as torch's ``DataLoader`` does) and collates the
samples as that does; it reads on the training thread, so a dataset that draws from the global
random generators (augmentation) draws in step order, and the engine's RNG rule holds for it.
Both follow the same exactly-once sampler and position.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from dataload.cache import SampleCache
from dataload.sampler import SamplerState, advance, plan_batch, rank_ids, state_at_step

_Key = tuple[SamplerState, int, int]
"""What a prefetched batch was read for: the sampler state, the world size, the rank."""


class _StepSampled:
    """The position and this rank's sample ids of each step, over ``num_samples`` samples;
    the loaders below add where the samples come from."""

    def __init__(
        self,
        num_samples: int,
        *,
        global_batch: int,
        world_size: int,
        rank: int,
        seed: int,
        drop_last: bool,
    ) -> None:
        plan_batch(global_batch, world_size, global_batch)  # validates the sizes
        if num_samples < 1:
            raise ValueError("the loader has no samples: give it a dataset with at least one")
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.world_size, self.rank = world_size, rank
        self.drop_last = drop_last
        self.state = SamplerState(seed)
        self.last_ids: np.ndarray = np.empty(0, dtype=np.int64)
        """Sample ids of the batch :meth:`next_batch` returned last."""

    # -- the interface recovery uses -----------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        """The position: ``{"seed", "epoch", "offset"}``."""
        return self.state.to_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a position from :meth:`state_dict`."""
        self.state = SamplerState.from_dict(state)

    def set_world(self, world_size: int, rank: int) -> None:
        """A new world size after a resize: the same global batch, split anew."""
        plan_batch(self.global_batch, world_size, self.global_batch)
        self.world_size, self.rank = world_size, rank

    def loss_weight(self) -> float:
        """Scale of this rank's mean loss so that averaging gradients over the ranks gives the
        mean over the global batch, whatever the world size (1.0 when it divides evenly)."""
        return plan_batch(self.global_batch, self.world_size, self.global_batch).loss_weight(
            self.rank
        )

    def seek(self, step: int) -> None:
        """Position before global step ``step`` (0-based) of the run, in O(1)."""
        self.state = state_at_step(
            self.state.seed, step, self.num_samples, self.global_batch, self.drop_last
        )

    # -- iteration -----------------------------------------------------------------------------

    def ids(self) -> np.ndarray:
        """The sample ids of this rank's next batch (without advancing)."""
        return rank_ids(
            self.state,
            self.num_samples,
            self.global_batch,
            self.world_size,
            self.rank,
            self.drop_last,
        )

    def _advance(self) -> None:
        self.state = advance(self.state, self.num_samples, self.global_batch, self.drop_last)

    def next_batch(self) -> Any:
        """This rank's batch of the next step; advances the state."""
        raise NotImplementedError

    def __iter__(self) -> Iterator[Any]:
        while True:
            yield self.next_batch()

    def close(self) -> None:
        """Release what the loader holds (nothing here)."""


class ResumableLoader(_StepSampled):
    """Per-step batches for one rank from the node's sample cache, the next one prefetched;
    the whole position is :meth:`state_dict`.

    Args:
        cache: The node's sample cache.
        global_batch: Samples per optimizer step over all ranks (constant across resizes).
        world_size, rank: This rank's place.
        seed: Seed of the epoch permutations.
        drop_last: Skip an epoch's last, short step.
    """

    def __init__(
        self,
        cache: SampleCache,
        *,
        global_batch: int,
        world_size: int,
        rank: int,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__(
            len(cache),
            global_batch=global_batch,
            world_size=world_size,
            rank=rank,
            seed=seed,
            drop_last=drop_last,
        )
        self.cache = cache
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="p2p-prefetch")
        self._next: tuple[_Key, concurrent.futures.Future[torch.Tensor]] | None = None

    def _read(self, ids: np.ndarray) -> torch.Tensor:
        order = np.argsort(ids)  # read the map in file order, then put the batch back in order
        out = np.empty((len(ids), *self.cache.header.shape), dtype=self.cache.header.dtype)
        out[order] = self.cache.samples[ids[order]]
        batch: torch.Tensor = torch.from_numpy(out)
        return batch

    def next_batch(self) -> torch.Tensor:
        """This rank's batch of the next step; advances the state."""
        key = (self.state, self.world_size, self.rank)
        self.last_ids = self.ids()
        if self._next is not None and self._next[0] == key:
            batch = self._next[1].result()
        else:
            batch = self._read(self.last_ids)
        self._advance()
        ahead = (self.state, self.world_size, self.rank)
        self._next = (ahead, self._pool.submit(self._read, self.ids()))
        return batch

    def close(self) -> None:
        """Stop the prefetch thread."""
        self._pool.shutdown(wait=True, cancel_futures=True)


class DatasetLoader(_StepSampled):
    """Per-step batches for one rank from a map-style dataset, collated as torch's
    ``DataLoader`` does; the same sampler and position as :class:`ResumableLoader`'s.

    Args:
        dataset: Anything with ``len()`` and ``[i]`` (a ``torch.utils.data.Dataset``, a list).
        global_batch: Samples per optimizer step over all ranks (constant across resizes).
        world_size, rank: This rank's place.
        seed: Seed of the epoch permutations.
        drop_last: Skip an epoch's last, short step.
        collate_fn: Makes a batch of a list of samples (default: torch's ``default_collate``,
            what ``DataLoader`` uses).
    """

    def __init__(
        self,
        dataset: Any,
        *,
        global_batch: int,
        world_size: int,
        rank: int,
        seed: int = 0,
        drop_last: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        lacks = [what for what in ("__len__", "__getitem__") if not hasattr(dataset, what)]
        if lacks:
            raise TypeError(
                f"DatasetLoader takes a map-style dataset (len() and dataset[i]); a "
                f"{type(dataset).__name__} has no {' or '.join(lacks)} (an iterable dataset "
                "cannot be rewound to a step)"
            )
        super().__init__(
            len(dataset),
            global_batch=global_batch,
            world_size=world_size,
            rank=rank,
            seed=seed,
            drop_last=drop_last,
        )
        self.dataset = dataset
        if collate_fn is None:
            from torch.utils.data import default_collate

            collate_fn = default_collate
        self.collate_fn = collate_fn

    def next_batch(self) -> Any:
        """This rank's batch of the next step (read now, on this thread); advances the state."""
        self.last_ids = self.ids()
        batch = self.collate_fn([self.dataset[int(i)] for i in self.last_ids])
        self._advance()
        return batch
