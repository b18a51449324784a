"""The objects a training loop keeps beside the model: ``protect(..., stateful={...})``.

A script's state is not all in the model, the optimizer and the scheduler. A
``torch.amp.GradScaler`` keeps the loss scale and its growth tracker, which decide whether a
step is skipped; a curriculum or a metrics tracker keeps counters. Any object with
``state_dict()`` and ``load_state_dict()`` (torch's ``Stateful``) given by name to ``protect()``
is carried with every snapshot and cold checkpoint, and put back with them on every rank
(survivors and spares alike), so the job goes on as if nothing had happened. Its state must be
small: numbers, strings, lists, dicts and 0-dim tensors, as ``job.user_state``'s; tensors of
state belong in the model or the optimizer's state, which are sharded and replicated as tensors.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful

from p2p_state.state import pack_small
from recovery.errors import ConfigurationError

logger = logging.getLogger(__name__)


def checked(objects: Mapping[str, Any] | None) -> dict[str, Stateful]:
    """``protect()``'s ``stateful`` argument, checked.

    Raises:
        TypeError: it is not a mapping of names to objects with ``state_dict`` and
            ``load_state_dict``.
    """
    if objects is None:
        return {}
    if not isinstance(objects, Mapping):
        raise TypeError(
            "protect(stateful=...) takes a dict of names to objects with state_dict() and "
            f"load_state_dict(), e.g. stateful={{'scaler': scaler}}; got a {type(objects).__name__}"
        )
    for name, obj in objects.items():
        if not isinstance(name, str):
            raise TypeError(f"protect(stateful=...): the name {name!r} is not a string")
        if not isinstance(obj, Stateful):
            raise TypeError(
                f"protect(stateful={{{name!r}: ...}}): a {type(obj).__name__} has no "
                "state_dict() and load_state_dict(); give an object that has both"
            )
    return dict(objects)


def capture(objects: Mapping[str, Stateful]) -> dict[str, Any]:
    """Every object's ``state_dict()``, by name."""
    return {name: obj.state_dict() for name, obj in objects.items()}


def check_small(objects: Mapping[str, Stateful]) -> None:
    """Refuse, before the first step, a state that a snapshot cannot carry.

    Raises:
        ConfigurationError: an object's ``state_dict()`` holds a tensor or an object.
    """
    for name, state in capture(objects).items():
        try:
            pack_small(state)
        except TypeError as e:
            raise ConfigurationError(
                f"protect(stateful={{{name!r}: ...}}): its state_dict() cannot be carried with "
                f"the snapshots ({e}); keep tensors in the model or the optimizer's state"
            ) from None


def restore(objects: Mapping[str, Stateful], saved: Mapping[str, Any]) -> None:
    """Load each object's state from ``saved`` (a snapshot's or a checkpoint's)."""
    for name, obj in objects.items():
        if name not in saved:
            logger.warning(
                "the restored state holds nothing for stateful %r (it was saved by a job "
                "without it): it keeps the state it has",
                name,
            )
            continue
        obj.load_state_dict(saved[name])
        if isinstance(obj, torch.amp.GradScaler) and obj.is_enabled():
            # What the scaler noted of the interrupted step (optimizer unscaled, inf found) is
            # about an optimizer the recovery replaced: update() would count it again.
            obj._per_optimizer_states.clear()
