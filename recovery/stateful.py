"""The objects a training loop keeps beside the model: ``protect(..., stateful={...})``.

A script's state is not all in the model, the optimizer and the scheduler. A
``torch.amp.GradScaler`` keeps the loss scale and its growth tracker, which decide whether a
step is skipped; a curriculum or a metrics tracker keeps counters. Any object with
``state_dict()`` and ``load_state_dict()`` (torch's ``Stateful``) given by name to ``protect()``
is carried with every snapshot and cold checkpoint, and put back with them on every rank
(survivors and spares alike), so the job goes on as if nothing had happened. Its state must be
small: numbers, strings, lists, dicts and 0-dim tensors, as ``job.user_state``'s; tensors of
state belong in the model or the optimizer's state, which are sharded and replicated as tensors.

Random generators of the loop's own are given the same way, as they are: a ``torch.Generator``
(a data order drawn with ``randperm(..., generator=g)``), a NumPy ``Generator`` (from
``default_rng``) or ``RandomState``, a ``random.Random``. The engine restores the global
generators by itself; a generator object of the script's is invisible to it, and one not
carried keeps drawing from where the fault left it, so the steps redone after a recovery draw
other numbers than the run without faults did.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.stateful import Stateful

from p2p_state.state import pack_small
from recovery.errors import ConfigurationError

logger = logging.getLogger(__name__)


class _TorchGenerator:
    """A ``torch.Generator`` as a ``Stateful``: its state as bytes."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def state_dict(self) -> dict[str, Any]:
        return {"torch_generator": self.generator.get_state().numpy().tobytes()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        data = bytearray(state["torch_generator"])
        self.generator.set_state(torch.frombuffer(data, dtype=torch.uint8))


class _NumpyGenerator:
    """A NumPy ``Generator`` or ``RandomState`` as a ``Stateful``: its bit generator's state as
    JSON (a PCG64 state holds 128-bit integers, which msgpack cannot carry)."""

    def __init__(self, generator: np.random.Generator | np.random.RandomState) -> None:
        self.generator = generator

    def state_dict(self) -> dict[str, Any]:
        g = self.generator
        state: Any = (
            g.get_state(legacy=False)
            if isinstance(g, np.random.RandomState)
            else g.bit_generator.state
        )
        return {"numpy_generator": json.dumps(state, default=lambda a: a.tolist())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        loaded = json.loads(state["numpy_generator"])
        if isinstance(self.generator, np.random.RandomState):
            self.generator.set_state(loaded)
        else:
            self.generator.bit_generator.state = loaded


class _PythonRandom:
    """A ``random.Random`` as a ``Stateful``."""

    def __init__(self, generator: random.Random) -> None:
        self.generator = generator

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss_next = self.generator.getstate()
        return {"python_random": [version, list(internal), gauss_next]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version, internal, gauss_next = state["python_random"]
        self.generator.setstate((version, tuple(internal), gauss_next))


def _adapted(name: str, obj: Any) -> Any:
    """``obj``, or for a random generator an adapter giving it ``state_dict()``."""
    if isinstance(obj, torch.Generator):
        return _TorchGenerator(obj)
    if isinstance(obj, (np.random.Generator, np.random.RandomState)):
        return _NumpyGenerator(obj)
    if isinstance(obj, random.SystemRandom):
        raise TypeError(
            f"protect(stateful={{{name!r}: ...}}): a random.SystemRandom draws from the "
            "operating system and has no state to restore; use a seeded random.Random"
        )
    if isinstance(obj, random.Random):
        return _PythonRandom(obj)
    return obj


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
    out = {}
    for name, given in objects.items():
        if not isinstance(name, str):
            raise TypeError(f"protect(stateful=...): the name {name!r} is not a string")
        obj = _adapted(name, given)
        if not isinstance(obj, Stateful):
            raise TypeError(
                f"protect(stateful={{{name!r}: ...}}): a {type(obj).__name__} has no "
                "state_dict() and load_state_dict(); give an object that has both, or a "
                "random generator (torch.Generator, numpy Generator or RandomState, "
                "random.Random)"
            )
        out[name] = obj
    return out


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
