"""Collectives a training loop runs between its steps' guards, and why they are a hazard.

Only a fault inside ``with job.step():`` can become a recovery: an exception raised between two
guards (a logging ``all_reduce`` of the loss after the guard, an evaluation every N steps, a
``barrier``) leaves the ``for`` loop, and Python cannot resume a loop from there. When a peer is
lost during such a collective, every survivor in it fails outside its guard and leaves, taking
with it the copies of its peers' state it holds: one lost rank becomes the loss of every rank,
and the job restarts from the last cold checkpoint (or the initial state) instead of from its
peers' memory.

:class:`UnguardedCollectives` notices such collectives before any fault, from the sequence
numbers of the default group and of every group the loop's own code made (a 2-D mesh's
sub-groups, a group for logging; not the engine's replication and checkpoint groups, busy on
their own thread): every collective issued on a group advances its number, marked whenever the
job hands control to the loop's own code outside a guard (after a guard; after the loader made
the next batch, which runs under the engine's own guard), compared when the job has it back (the
next step asked for, a guard entered). It warns once, on rank 0. What the loop must do is run
every collective of an iteration inside the step's guard.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

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
    """Notices collectives on the loop's groups outside the steps' guards (see the module
    docstring).

    Args:
        engine_groups: The groups of the engine's own now (left out: its replication thread
            uses them between the guards by design).
    """

    def __init__(self, engine_groups: Callable[[], Iterable[dist.ProcessGroup]] = tuple) -> None:
        self._engine_groups = engine_groups
        self._marks: dict[dist.ProcessGroup, int] = {}
        self.seen_after: int | None = None
        """The step after which collectives ran outside a guard (``None``: none seen)."""

    def _watched(self) -> list[dist.ProcessGroup]:
        engine = set(self._engine_groups())
        return [pg for pg in dist.distributed_c10d._world.pg_map if pg not in engine]

    def unguarded(self) -> None:
        """The loop's code runs next, outside a guard."""
        self._marks = {}
        if self.seen_after is None and dist.is_initialized():
            for group in self._watched():
                issued = _issued(group)
                if issued is not None:
                    self._marks[group] = issued

    def guarded(self, step_done: int) -> None:
        """The job has control back, ``step_done`` the last step done: warn if collectives ran
        since :meth:`unguarded` (once; a recovery in between replaces the groups, and says
        nothing)."""
        marks, self._marks = self._marks, {}
        if not marks or not dist.is_initialized():
            return
        live = dist.distributed_c10d._world.pg_map
        if all(group not in live or _issued(group) == n for group, n in marks.items()):
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
