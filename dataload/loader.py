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
samples as that does, on the training thread or in worker processes. Both follow the same
exactly-once sampler and position.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import os
import signal
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

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

    With ``num_workers=0`` the samples are read on the training thread, so a dataset that draws
    from the global random generators (augmentation) draws in step order and the engine's RNG
    rule holds for it. With workers, a torch ``DataLoader`` reads ahead in worker processes, and
    each batch's reading starts from generators (torch, ``random``, NumPy) seeded from the seed
    and its place in the run (epoch, offset, world size, rank), so a batch read again after a
    restore is the batch read the first time, whichever worker reads it; the training process's
    own generators are not touched. A restore or a resize ends the workers and starts new ones
    at the new position.

    Args:
        dataset: Anything with ``len()`` and ``[i]`` (a ``torch.utils.data.Dataset``, a list).
        global_batch: Samples per optimizer step over all ranks (constant across resizes).
        world_size, rank: This rank's place.
        seed: Seed of the epoch permutations (and of the workers' generators).
        drop_last: Skip an epoch's last, short step.
        collate_fn: Makes a batch of a list of samples (default: torch's ``default_collate``,
            what ``DataLoader`` uses).
        num_workers: Worker processes reading ahead (0: read on the training thread).
        prefetch_factor: Batches each worker reads ahead.
        pin_memory: Put batches in pinned host memory (for copies to a GPU).
        timeout_s: Longest wait for a worker's batch before the loader raises.
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
        num_workers: int = 0,
        prefetch_factor: int = 2,
        pin_memory: bool = False,
        timeout_s: float = 300.0,
    ) -> None:
        lacks = [what for what in ("__len__", "__getitem__") if not hasattr(dataset, what)]
        if lacks:
            raise TypeError(
                f"DatasetLoader takes a map-style dataset (len() and dataset[i]); a "
                f"{type(dataset).__name__} has no {' or '.join(lacks)} (an iterable dataset "
                "cannot be rewound to a step)"
            )
        if num_workers < 0 or prefetch_factor < 1 or timeout_s <= 0:
            raise ValueError(
                f"DatasetLoader: num_workers={num_workers} must be >= 0, prefetch_factor="
                f"{prefetch_factor} >= 1 and timeout_s={timeout_s} > 0"
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
        self.num_workers, self.prefetch_factor = num_workers, prefetch_factor
        self.pin_memory, self.timeout_s = pin_memory, timeout_s
        self._workers: Iterator[Any] | None = None
        self._workers_at: _Key | None = None
        """Where the next batch of :attr:`_workers` is from."""

    def next_batch(self) -> Any:
        """This rank's batch of the next step; advances the state."""
        self.last_ids = self.ids()
        if self.num_workers == 0:
            batch = self.collate_fn([self.dataset[int(i)] for i in self.last_ids])
        else:
            key = (self.state, self.world_size, self.rank)
            if self._workers is None or self._workers_at != key:
                self._start_workers()
            assert self._workers is not None
            batch = next(self._workers)
        self._advance()
        self._workers_at = (self.state, self.world_size, self.rank)
        return batch

    def _start_workers(self) -> None:
        """Workers reading this rank's batches from the current position on."""
        from torch.utils.data import DataLoader

        self.close()
        self._workers = iter(
            DataLoader(
                _SeededBatches(self.dataset, self.collate_fn),
                batch_size=None,  # each item is a whole batch: _SeededBatches collates
                sampler=_StepKeys(self),
                collate_fn=_as_is,
                num_workers=self.num_workers,
                prefetch_factor=self.prefetch_factor,
                pin_memory=self.pin_memory,
                timeout=self.timeout_s,
                # The base seed is drawn from here, not from the training process's generator.
                generator=torch.Generator().manual_seed(self.state.seed),
                worker_init_fn=functools.partial(_end_with_rank, os.getpid()),
            )
        )

    def close(self) -> None:
        """End the worker processes (the next batch starts new ones)."""
        workers, self._workers = self._workers, None
        shutdown = getattr(workers, "_shutdown_workers", None)
        if shutdown is not None:  # what dropping the iterator runs, without waiting for gc
            shutdown()


_BatchKey = tuple[tuple[int, ...], int]
"""A batch to read: its sample ids and the seed of the generators it is read with."""


class _StepKeys:
    """The keys of this rank's batches from the loader's current position on, without end."""

    def __init__(self, loader: DatasetLoader) -> None:
        self.state, self.world_size, self.rank = loader.state, loader.world_size, loader.rank
        self.num_samples, self.global_batch = loader.num_samples, loader.global_batch
        self.drop_last = loader.drop_last

    def __iter__(self) -> Iterator[_BatchKey]:
        state = self.state
        while True:
            ids = rank_ids(
                state, self.num_samples, self.global_batch, self.world_size, self.rank,
                self.drop_last,
            )  # fmt: skip
            place = [state.seed, state.epoch, state.offset, self.world_size, self.rank]
            seed = int(np.random.SeedSequence(place).generate_state(1, np.uint64)[0])
            yield tuple(int(i) for i in ids), seed
            state = advance(state, self.num_samples, self.global_batch, self.drop_last)


class _SeededBatches(Dataset[Any]):
    """Read by the workers: the batch of a key, with the generators seeded from the key."""

    def __init__(self, dataset: Any, collate_fn: Callable[[list[Any]], Any]) -> None:
        self.dataset, self.collate_fn = dataset, collate_fn

    def __getitem__(self, key: _BatchKey) -> Any:
        import random

        ids, seed = key
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % 2**32)
        return self.collate_fn([self.dataset[i] for i in ids])


def _end_with_rank(rank_pid: int, worker_id: int) -> None:
    """In a worker: end the moment the rank that started it does, however it ends. torch's
    workers see their parent gone only at their next 5 s check; a worker of a SIGKILLed rank
    would meanwhile hold the node's CPU and memory while a spare takes the rank over."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != rank_pid:  # the rank died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)


#: ``prctl``'s request to be signalled when the parent thread ends (linux/prctl.h).
_PR_SET_PDEATHSIG = 1


def _as_is(batch: Any) -> Any:
    """``DataLoader``'s collate of a batch ``_SeededBatches`` collated already."""
    return batch
