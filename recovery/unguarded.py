"""Collectives a training loop runs between its steps' guards, and why they are a hazard.

Only a fault inside ``with job.step():`` can become a recovery: an exception raised between two
guards (a logging ``all_reduce`` of the loss after the guard, an evaluation every N steps, a
``barrier``) leaves the ``for`` loop, and Python cannot resume a loop from there. When a peer is
lost during such a collective, every survivor in it fails outside its guard and leaves, taking
with it the copies of its peers' state it holds: one lost rank becomes the loss of every rank,
and the job restarts from the last cold checkpoint (or the initial state) instead of from its
peers' memory.

:class:`UnguardedCollectives` notices such collectives before any fault, from the default
group's sequence number (every collective issued on a group advances it): marked whenever the
job hands control to the loop's own code outside a guard (after a guard; after the loader made
the next batch, which runs under the engine's own guard), compared when the job has it back (the
next step asked for, a guard entered). It warns once, on rank 0. What the loop must do is run
every collective of an iteration inside the step's guard.
"""

from __future__ import annotations

import logging

import torch.distributed as dist

logger = logging.getLogger(__name__)

#: What to do about collectives between the guards (the warning's and the fault's advice).
FIX = (
    "run every collective of the loop (a logging all_reduce, an evaluation, a barrier) inside "
    "the step's `with job.step():`"
)


def _issued(group: dist.ProcessGroup) -> int | None:
    """Collectives issued on ``group`` so far (``None``: its backend does not count them)."""
    try:
        return int(group._get_sequence_number_for_group())  # type: ignore[attr-defined]
    except RuntimeError:
        return None


class UnguardedCollectives:
    """Notices collectives on the default group outside the steps' guards (see the module
    docstring)."""

    def __init__(self) -> None:
        self._mark: tuple[dist.ProcessGroup, int] | None = None
        self.seen_after: int | None = None
        """The step after which collectives ran outside a guard (``None``: none seen)."""

    def unguarded(self) -> None:
        """The loop's code runs next, outside a guard."""
        if self.seen_after is None and dist.is_initialized():
            group = dist.distributed_c10d._get_default_group()
            issued = _issued(group)
            self._mark = None if issued is None else (group, issued)

    def guarded(self, step_done: int) -> None:
        """The job has control back, ``step_done`` the last step done: warn if collectives ran
        since :meth:`unguarded` (once; a recovery in between replaces the group, and says
        nothing)."""
        mark, self._mark = self._mark, None
        if mark is None or not dist.is_initialized():
            return
        group, issued = mark
        if group is not dist.distributed_c10d._get_default_group() or _issued(group) == issued:
            return
        self.seen_after = step_done
        if dist.get_rank() == 0:
            logger.warning(
                "collectives ran after step %d outside `with job.step():`: a peer lost during "
                "one of them cannot be recovered (every rank in it leaves, with the copies of "
                "its peers' state it holds, and the job falls back to its last checkpoint or "
                "starts over); %s",
                step_done,
                FIX,
            )
