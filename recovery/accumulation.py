"""Gradients a loop carries from one step to the next, which no snapshot holds.

A snapshot holds what a step leaves to the next one: parameters, optimizer state, the schedule,
the random generators, the loader's position. It holds no gradients, because after an
optimizer step there are none to keep (or they are zeroed before the next backward). A loop
that steps its optimizer only every N iterations of ``for step, batch in job`` (gradient
accumulation across steps, as loops with a ``gradient_accumulation_steps`` setting write it)
leaves gradients at the end of the steps in between. A recovery to one of those steps restores
everything but them, and the next update is computed from fewer micro-batches than in the run
without faults: the results differ, silently.

:class:`CarriedGradients` notices the pattern before any fault: a step whose state is kept
(replicated or checkpointed) that ended without an optimizer step while a parameter has a
gradient. It warns once, on rank 0, with the two fixes: accumulate the micro-batches inside one
step, or keep only the states that follow an update (``--replicate-every N`` with the optimizer
stepping on multiples of N). A step that a ``torch.amp.GradScaler`` skipped after an overflow
also ends without an update; its scale then drops, which tells it apart when the scaler is
given to ``protect(stateful=...)``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

logger = logging.getLogger(__name__)

#: What to do about gradients carried between steps (the warning's advice).
FIX = (
    "accumulate the micro-batches inside one step (a loop over them in `with job.step():`), or "
    "keep only the states that follow an update: p2p-run --replicate-every N "
    "(ReplicationConfig.interval_steps) with the optimizer stepping on multiples of N, and "
    "--checkpoint-every a multiple of N"
)


def _holds_gradients(model: torch.nn.Module) -> bool:
    """Whether a parameter of ``model`` has a gradient, or FSDP2 holds one it has not reduced.

    Between two backward passes with ``set_requires_gradient_sync(False)`` FSDP2 keeps the
    gradients on its unsharded parameters (in the reduce dtype once converted), not on the
    sharded parameters the module shows; those are read from its per-module state.
    """
    if any(p.grad is not None for p in model.parameters()):
        return True
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in getattr(module._get_fsdp_state(), "_fsdp_param_groups", ()):
            for param in group.fsdp_params:
                unsharded = getattr(param, "_unsharded_param", None)
                if getattr(param, "unsharded_accumulated_grad", None) is not None or (
                    unsharded is not None and unsharded.grad is not None
                ):
                    return True
    return False


def _scales(stateful: Mapping[str, Any]) -> dict[str, float]:
    """The loss scale of every GradScaler among the captured ``stateful`` states, by name."""
    out = {}
    for name, state in stateful.items():
        # A GradScaler's state_dict(); an empty dict when it is disabled.
        if isinstance(state, Mapping) and "scale" in state and "_growth_tracker" in state:
            out[name] = float(state["scale"])
    return out


class CarriedGradients:
    """Notices gradients left for the next step at a step whose state is kept (see the module
    docstring)."""

    def __init__(self) -> None:
        self._updated = False
        self.seen_at: int | None = None
        """The step that ended with gradients and no update (``None``: none seen)."""

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        """Count the updates of ``optimizer`` (each one the factory builds)."""
        optimizer.register_step_post_hook(self._on_update)

    def _on_update(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._updated = True

    def step_began(self) -> None:
        """A step's guard was entered (an update of an interrupted step does not count)."""
        self._updated = False

    def step_ended(
        self,
        step: int,
        model: torch.nn.Module,
        kept: bool,
        stateful_before: Mapping[str, Any],
        stateful_after: Mapping[str, Any],
    ) -> None:
        """``step`` is done; warn (once) if it leaves gradients behind in a state that is kept.

        Args:
            step: The step just done.
            model: The model trained.
            kept: Whether the state of ``step`` is replicated or checkpointed.
            stateful_before: The states of ``protect(stateful=...)``'s objects before ``step``
                (captured after the step before, or restored, or at the start).
            stateful_after: Their states captured for ``step``.
        """
        updated, self._updated = self._updated, False
        if updated or not kept or self.seen_at is not None:
            return
        before, after = _scales(stateful_before), _scales(stateful_after)
        if any(after[name] < before.get(name, after[name]) for name in after):
            return  # a GradScaler skipped the update after an overflow
        if not _holds_gradients(model):
            return
        self.seen_at = step
        if not dist.is_initialized() or dist.get_rank() == 0:
            logger.warning(
                "step %d ended with gradients but without an optimizer step, and its state is "
                "kept for recovery without them: if the loop accumulates gradients over "
                "several steps (an optimizer step every N iterations), a recovery to such a "
                "step loses them and the update after it differs from the run without faults; "
                "%s",
                step,
                FIX,
            )
