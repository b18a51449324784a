"""A loop that still trains with what a recovery replaced gets one clear error, not torch's.

The job ends with it (:class:`recovery.errors.ConfigurationError`: reported as fatal, see
``tests/recovery/test_job_unit.py``), where the survivors' old model would fail in FSDP's
all-gather on a group that is gone, and every recovery after it the same way.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from recovery.errors import ConfigurationError
from recovery.retired import retire


def _built() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)


def test_every_use_of_a_replaced_object_names_the_fix(world_of_one, tmp_path):
    old = _built()
    # FSDP's pre-forward (its all-gather) was registered when the model was built: the error
    # must come before it runs, on the group that is gone.
    ran_before: list[bool] = []
    old[0].register_forward_pre_hook(lambda *_: ran_before.append(True))
    retire(*old, generation=2)
    # The recovery's new groups: the old model's are gone, as after an abort.
    dist.destroy_process_group()
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "s2"), 1), rank=0, world_size=1
    )
    new = _built()
    fix = "recovery into generation 2 replaced: train through job.model"
    model, optimizer, scheduler = old
    with pytest.raises(ConfigurationError, match=fix):
        model(torch.ones(2, 4))
    assert not ran_before
    with pytest.raises(ConfigurationError, match=fix):
        optimizer.step()
    with pytest.raises(ConfigurationError, match=fix):
        scheduler.step()

    new_model, new_optimizer, new_scheduler = new
    new_model(torch.ones(2, 4)).sum().backward()
    new_optimizer.step()
    new_scheduler.step()


def test_a_retired_object_nobody_holds_is_freed(world_of_one):
    model, optimizer, scheduler = _built()
    gone = weakref.ref(model)
    retire(model, optimizer, scheduler, generation=3)
    del model, optimizer, scheduler
    gc.collect()
    assert gone() is None
