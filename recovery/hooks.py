"""Hooks of a protected job: who is told what at which point, and hooks named in the environment.

Fault injection (``p2p-bench inject``), probes and progress reporting attach here
(:meth:`recovery.job.ProtectedJob.add_hook`). A hook is called as ``hook(point, **info)`` at:

- ``built`` (``model``, ``optimizer``): the factory built them (at the start, after a recovery);
- ``step_begin`` (``step``, ``batch``): the iterator is about to yield a step;
- ``replication_chunk`` (``step``, ``round``, ``num_rounds``; on the replication worker thread);
- ``recovery_phase`` (``phase``, ``generation``): a recovery phase begins;
- ``finished`` (``step``, ``state``, ``extras``): the loop has ended cleanly; ``extras`` is what
  the snapshots carry beside ``state`` (``user_state``, the loader's and the stateful objects').

Tools that run a script they did not write (``p2p-bench inject --script``) attach their hooks
through ``P2P_JOB_HOOKS``: comma-separated ``module:function`` names, each called with the job
once it is ready to train, before its first step.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from launcher.protocol import ENV_JOB_HOOKS
from recovery.errors import ConfigurationError
from recovery.records import RecoveryRecord

Hook = Callable[..., None]
"""``hook(point, **info)``; the points are listed in this module's docstring."""


class JobHooks:
    """The hooks of one job, called in the order they were added."""

    def __init__(self) -> None:
        self._hooks: list[Hook] = []

    def add(self, hook: Hook) -> None:
        """Call ``hook`` at every point from now on."""
        self._hooks.append(hook)

    def call(self, point: str, **info: Any) -> None:
        """Tell every hook that ``point`` is reached."""
        for hook in self._hooks:
            hook(point, **info)

    @contextlib.contextmanager
    def phase(self, rec: RecoveryRecord, name: str) -> Iterator[None]:
        """Announce recovery phase ``name`` and add the time its body takes to ``rec``."""
        self.call("recovery_phase", phase=name, generation=rec.generation)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            rec.phases[name] = rec.phases.get(name, 0.0) + time.perf_counter() - t0


def hooks_from_env(environ: Mapping[str, str] = os.environ) -> list[Callable[[Any], None]]:
    """The ``attach(job)`` functions ``P2P_JOB_HOOKS`` names.

    Raises:
        ConfigurationError: a name cannot be loaded (the message names it and the fix).
    """
    attach = []
    for name in filter(None, environ.get(ENV_JOB_HOOKS, "").split(",")):
        module_name, _, function = name.strip().partition(":")
        try:
            attach.append(getattr(importlib.import_module(module_name), function))
        except (ImportError, AttributeError, ValueError) as e:
            raise ConfigurationError(
                f"{ENV_JOB_HOOKS} names {name!r}, which cannot be loaded ({e}): write "
                "module:function of an importable module"
            ) from None
    return attach
