"""Training objects a recovery replaced, made to say so when a loop still trains with them.

A recovery (or a resize) builds the model, optimizer and scheduler again on the new process
groups: ``job.model``, ``job.optimizer`` and ``job.scheduler`` are the new ones. A loop that
took references before its first step (``model, optimizer = job.model, job.optimizer``) goes on
with the old ones, whose groups are gone: on every survivor the next forward fails deep in torch
("process group ... is not initialized"), or an old scheduler steps an optimizer nobody trains
with, and the job can never recover. :func:`retire` turns that first use into one clear error,
a :class:`recovery.errors.ConfigurationError`, which ends the whole job with its message.
"""

from __future__ import annotations

from typing import Any, NoReturn

import torch

from recovery.errors import ConfigurationError


def retire(model: Any, optimizer: Any, scheduler: Any, generation: int) -> None:
    """Make the first use of the replaced ``model`` (its forward), ``optimizer`` (its step) and
    ``scheduler`` (its step) raise a :class:`ConfigurationError` naming the fix.

    The hooks hold the message only, so objects nobody else holds are freed as before.
    """
    message = (
        f"the loop trained with a model, optimizer or scheduler that the recovery into "
        f"generation {generation} replaced: train through job.model, job.optimizer and "
        "job.scheduler as they are at each step (a recovery or a resize builds them again), "
        "not through references taken before the loop"
    )

    def refuse(*_: Any, **__: Any) -> NoReturn:
        raise ConfigurationError(message)

    if isinstance(model, torch.nn.Module):
        model.register_forward_pre_hook(refuse, prepend=True)  # before FSDP's all-gather
    if isinstance(optimizer, torch.optim.Optimizer):
        optimizer.register_step_pre_hook(refuse)
    if scheduler is not None and callable(getattr(scheduler, "step", None)):
        scheduler.step = refuse
