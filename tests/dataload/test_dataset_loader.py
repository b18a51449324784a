"""``DatasetLoader``: a map-style dataset of the user's, with the cache loader's exactly-once order.

Under faults, bitwise, with a dataset that augments from the global generators, read by workers:
``tests/test_bench_cli.py``'s runs of ``tests/scripts/user_train.py``.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from dataload.cache import CacheConfig, open_source
from dataload.loader import DatasetLoader, ResumableLoader
from dataload.sources import TokenFileSource
from launcher.lifetime import alive
from tests.jobs import wait_for


class Labelled(Dataset):
    """Sample ``i``: a feature row that encodes ``i`` and its label, as a user's dataset would."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((3,), float(i)), i % 5


def _ids(batch: tuple[torch.Tensor, torch.Tensor]) -> list[int]:
    features, labels = batch
    assert torch.equal(labels, features[:, 0].long() % 5)  # collated as DataLoader does
    return features[:, 0].long().tolist()


def test_batches_are_collated_as_a_dataloader_does_in_the_cache_loaders_order(tmp_path):
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.arange(8 * 30, dtype=np.int32))
    cache = open_source(
        CacheConfig(directory=str(tmp_path / "c"), name="t"), TokenFileSource(str(tokens), 8)
    )
    from_cache = ResumableLoader(cache, global_batch=6, world_size=2, rank=1, seed=3)
    ours = DatasetLoader(Labelled(30), global_batch=6, world_size=2, rank=1, seed=3)
    for _ in range(7):  # across an epoch's end (30 samples, 6 a step)
        expected = from_cache.next_batch()[:, 0] // 8
        assert _ids(ours.next_batch()) == expected.tolist()
        assert ours.last_ids.tolist() == expected.tolist()
    from_cache.close()

    features, labels = DatasetLoader(Labelled(4), global_batch=2, world_size=1, rank=0).next_batch()
    reference_features, reference_labels = next(iter(DataLoader(Labelled(4), batch_size=2)))
    assert features.dtype == reference_features.dtype and features.shape == (2, 3)
    assert labels.dtype == reference_labels.dtype


def test_a_replacement_and_a_shrink_continue_where_the_position_was():
    loaders = [DatasetLoader(Labelled(40), global_batch=6, world_size=3, rank=r) for r in range(3)]
    seen = [i for _ in range(3) for ld in loaders for i in _ids(ld.next_batch())]
    saved = loaders[0].state_dict()
    after = [i for ld in loaders for i in _ids(ld.next_batch())]

    fresh = DatasetLoader(Labelled(40), global_batch=6, world_size=3, rank=0)
    fresh.load_state_dict(saved)
    assert _ids(fresh.next_batch()) == after[:2]

    two = [DatasetLoader(Labelled(40), global_batch=6, world_size=3, rank=r) for r in range(2)]
    for rank, ld in enumerate(two):
        ld.load_state_dict(saved)
        ld.set_world(2, rank)
    assert [i for ld in two for i in _ids(ld.next_batch())] == after
    # Every sample once in the epoch so far, through the shrink.
    rest = [i for _ in range(2) for ld in two for i in _ids(ld.next_batch())]
    epoch = seen + after + rest
    assert len(epoch) == len(set(epoch)) == 36


def test_a_collate_fn_of_the_users_makes_the_batch():
    loader = DatasetLoader(
        Labelled(10), global_batch=4, world_size=2, rank=0, collate_fn=lambda samples: samples
    )
    batch = loader.next_batch()
    assert isinstance(batch, list) and len(batch) == 2 and batch[0][0].shape == (3,)


def test_what_cannot_be_rewound_is_refused_with_the_reason():
    class Stream(IterableDataset):
        def __iter__(self):
            yield from range(3)

    with pytest.raises(
        TypeError, match=r"a Stream has no __len__ \(an iterable dataset cannot be rewound"
    ):
        DatasetLoader(Stream(), global_batch=2, world_size=1, rank=0)
    with pytest.raises(ValueError, match="no samples"):
        DatasetLoader([], global_batch=2, world_size=1, rank=0)


class Augmented(Labelled):
    """Sample ``i`` with noise from all three global generators, as augmentations draw it."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        import random

        noise = torch.rand(3) + random.random() + float(np.random.rand())
        return torch.full((3,), float(i)) + noise, i % 5


def test_workers_read_the_same_samples_and_a_batch_read_again_is_the_same():
    import multiprocessing
    import random

    children = set(multiprocessing.active_children())
    plain = DatasetLoader(Labelled(30), global_batch=6, world_size=2, rank=1, seed=3)
    ahead = DatasetLoader(Labelled(30), global_batch=6, world_size=2, rank=1, seed=3, num_workers=2)
    for _ in range(7):  # across an epoch's end
        assert _ids(ahead.next_batch()) == _ids(plain.next_batch())
        assert ahead.last_ids.tolist() == plain.last_ids.tolist()
    ahead.set_world(3, 2)  # a resize: new workers at the new place
    plain.set_world(3, 2)
    assert _ids(ahead.next_batch()) == _ids(plain.next_batch())
    ahead.close()
    assert set(multiprocessing.active_children()) <= children  # the workers are gone

    generators = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].tolist())
    loader = DatasetLoader(Augmented(30), global_batch=4, world_size=2, rank=0, num_workers=2)
    first = [loader.next_batch()[0] for _ in range(6)]
    assert not torch.equal(first[0], first[0].round())  # the noise is there
    loader.load_state_dict({"seed": 0, "epoch": 0, "offset": 8})  # a restore to step 2
    assert torch.equal(loader.next_batch()[0], first[2])
    # Another worker count reads it alike: the generators are seeded per batch, not per worker.
    other = DatasetLoader(Augmented(30), global_batch=4, world_size=2, rank=0, num_workers=1)
    other.load_state_dict({"seed": 0, "epoch": 0, "offset": 12})
    assert torch.equal(other.next_batch()[0], first[3])
    for ld in (loader, other):
        ld.close()
    # The training process's generators were not drawn from (the engine restores those).
    after = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].tolist())
    assert torch.equal(after[0], generators[0]) and after[1:] == generators[1:]


def test_bad_worker_settings_are_refused_naming_them():
    with pytest.raises(ValueError, match="num_workers=-1 must be >= 0"):
        DatasetLoader(Labelled(4), global_batch=2, world_size=1, rank=0, num_workers=-1)


def test_the_workers_of_a_rank_that_is_sigkilled_end_with_it(tmp_path):
    # A rank reading with workers, SIGKILLed: its workers must not read on for the seconds
    # torch's own check of their parent takes (up to 5 s).
    code = textwrap.dedent(
        """
        import sys, time
        from tests.dataload.test_dataset_loader import Augmented
        from dataload.loader import DatasetLoader
        loader = DatasetLoader(Augmented(30), global_batch=4, world_size=1, rank=0, num_workers=2)
        loader.next_batch()
        print(*[w.pid for w in loader._workers._workers], flush=True)
        time.sleep(120)
        """
    )
    rank = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, cwd=Path(__file__).parents[2]
    )
    try:
        workers = [int(pid) for pid in rank.stdout.readline().split()]
        assert len(workers) == 2 and all(alive(pid) for pid in workers)
        rank.kill()
        rank.wait(30)
        # Well under the 5 s torch's check would take: the kernel ends them with the rank.
        wait_for(lambda: not any(alive(pid) for pid in workers), "the workers to end", 2.5)
    finally:
        rank.kill()
        rank.stdout.close()
