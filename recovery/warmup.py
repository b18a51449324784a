"""The factory's side of a recovery: a hot spare's warm-up, whether a build is for a restore, and
saving and restoring a process's RNG states around a warm-up."""

from __future__ import annotations

import contextlib
import contextvars
import gc
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from p2p_state.state import TrainingState
from recovery.tracebacks import rank_prefix

Build = Callable[[], tuple[Any, ...]]
"""The job's factory: ``(model, optimizer)`` or ``(model, optimizer, scheduler)`` (checked when
it returns, so the items are not typed here)."""
WarmupStep = Callable[[torch.nn.Module, torch.optim.Optimizer], None]
"""One training step on made-up data, run on the model a warm-up built."""


def capture_rng() -> dict[str, Any]:
    out = {"torch": torch.get_rng_state(), "random": random.getstate(), "np": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def restore_rng(saved: dict[str, Any]) -> None:
    torch.set_rng_state(saved["torch"])
    random.setstate(saved["random"])
    np.random.set_state(saved["np"])
    if "cuda" in saved:
        torch.cuda.set_rng_state(saved["cuda"])


_RESTORING: contextvars.ContextVar[bool] = contextvars.ContextVar("p2p_restoring", default=False)


def restoring() -> bool:
    """Whether the factory is being run for a restore (see :func:`p2p_state.restoring`)."""
    return _RESTORING.get()


@contextlib.contextmanager
def building_for_restore() -> Iterator[None]:
    """:func:`restoring` is true inside."""
    token = _RESTORING.set(True)
    try:
        yield
    finally:
        _RESTORING.reset(token)


def warm_up(build: Build, backend: str, step: WarmupStep | None = None) -> float:
    """Run the factory once on a private one-rank group, then throw the result away.

    A hot spare does this while it waits for a rank: a process's first ``fully_shard``, its
    first forward and backward and its first optimizer step cost one-time set-up (allocator
    growth, kernel and autograd caches) which would otherwise land on the recovery's critical
    path, where every rank waits for the slowest. The process's RNG states are left as they
    were.

    Args:
        build: The job's factory.
        backend: Backend of the private group.
        step: Optional ``step(model, optimizer)`` running one training step on made-up data
            (shaped like a real batch); without it only the build and a capture are warmed.

    Returns:
        Seconds it took.
    """
    t0 = time.perf_counter()
    rng = capture_rng()
    with rank_prefix(None):  # a spare is no rank yet: its traceback says nothing of rank 0
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    try:
        _build_and_restore(build, step)
    finally:
        dist.destroy_process_group()
        restore_rng(rng)
        # What was built sits in reference cycles (FSDP2 modules and hooks): its memory is
        # freed now, while the spare waits, not when its first real build needs it.
        gc.collect()
    return time.perf_counter() - t0


def _build_and_restore(build: Build, step: WarmupStep | None) -> None:
    with building_for_restore():  # a spare only ever builds to restore a lost rank
        built = build()
    if step is not None:
        step(built[0], built[1])
    state = TrainingState(*built[:3])
    buffer = torch.empty(state.layout.total_bytes, dtype=torch.uint8)
    state.capture(buffer, 0, {})
    state.restore(buffer)
