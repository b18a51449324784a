"""The copies a rank keeps across generations: its replicators, newest first, and their memory.

The current generation's replicator makes new copies; the replicators of older generations are
abandoned but kept, because their copies still serve a restore (a copy of rank ``r``'s state at
step ``s`` in a world of ``W`` ranks is the same bytes whichever generation made it). When a new
replicator is made after a recovery, the old ones give their memory back to a pool it takes its
slots from, all but the copies a fault before the new generation's first commit would need: those
of the restored step and those of the last committed step. They follow once the new generation's
copy of the restored step has committed everywhere.

Why the committed step too: a restore takes the newest step of which every shard has a copy, and
that may be a round the fault cut short, whose replicas reached only some holders (one, say, of a
shard's ``k``). Were the older, committed copies given back, a second fault that takes that one
holder before the new generation commits would leave the shard with no copy at all; the committed
step still has every holder's. When the restored step is the committed one (the usual case) this
keeps nothing more.
"""

from __future__ import annotations

from p2p_state.memory import BufferPool
from p2p_state.replicator import Replicator


class GenerationStores:
    """Every replicator whose copies this rank still holds, and the pool their memory goes to."""

    def __init__(self) -> None:
        self._stores: list[Replicator] = []
        self._pool: BufferPool | None = None
        self._restored_step = -1

    @property
    def all(self) -> list[Replicator]:
        """Newest first: the current replicator (if any), then older generations'."""
        return list(self._stores)

    @property
    def has_old(self) -> bool:
        """Whether older generations' stores are still kept."""
        return len(self._stores) > 1

    def abandon(self, wait_s: float = 10.0) -> int:
        """Stop every replicator (after a fault, or before a resize), keeping their copies.

        Args:
            wait_s: How long to wait for each worker to leave its round; 0: only tell them
                (after a fault: see :meth:`left_behind`).

        Returns:
            How many workers are still busy.
        """
        return sum(not store.abandon(wait_s) for store in self._stores)

    def left_behind(self) -> int:
        """How many stopped replicators' workers are still in a round (their buffers are not
        recycled).

        After a fault a rank does not wait for its replication worker: the aborted groups fail
        its transfers within milliseconds, and it has left long before the next replicator is
        made, where this is asked. Except a worker blocked on a receive whose payload was partly
        read when its pair failed: gloo signals the failure to pending and posted operations,
        not to the one being read, so that one leaves only at its deadline. Its pair is closed,
        so nothing writes into its buffers any more; it is left as a daemon.
        """
        return sum(store.left_behind() for store in self._stores)

    def adopt(self, pool: BufferPool) -> None:
        """Take the next replicator's slots from ``pool`` (a spare's buffers allocated ahead)
        as well as from what older stores give back."""
        assert self._pool is None and not self._stores, "a spare adopts before its first store"
        self._pool = pool

    def drop_pool(self) -> int:
        """Let go of what is left in the pool once no slot will take from it (no older store
        gives back into it any more); returns those bytes."""
        if self._pool is None or self.has_old:
            return 0
        left, self._pool = self._pool.free_bytes, None
        return left

    def recycle_for(self, step: int) -> BufferPool:
        """The pool the next replicator takes its slots from: every old buffer but those of the
        copies of ``step`` and of the last committed step (the fallback until the new copies
        exist; see the module docstring)."""
        if self._pool is None:
            self._pool = BufferPool()
        keep = {step, self.committed_step}
        for old in self._stores:
            old.give_back(self._pool, keep)
        return self._pool

    @property
    def committed_step(self) -> int:
        """The newest step a commit of replication reached here, in any generation (-1: none).

        A commit is an all-reduce of every rank's published step, so a step committed on one
        rank has every holder's replica on every rank."""
        return max((store.committed_step for store in self._stores), default=-1)

    def add(self, replicator: Replicator, restored_step: int) -> None:
        """Make ``replicator`` (of the state restored at ``restored_step``) the current one."""
        self._stores.insert(0, replicator)
        self._restored_step = restored_step

    def release_old(self) -> tuple[int, int, int] | None:
        """Once the current replicator's copy of the restored step has committed everywhere,
        give the old stores' memory to the pool and forget them.

        Returns:
            ``(given_bytes, reused_bytes, lent_bytes)`` (``lent_bytes``: lent to the restore as
            its receive buffer), or ``None`` while the old copies are still needed.
        """
        if not self.has_old or self._stores[0].committed_step < self._restored_step:
            return None
        pool = self._pool if self._pool is not None else BufferPool()
        given = sum(old.give_back(pool) for old in self._stores[1:])
        self._stores = self._stores[:1]
        self._pool = None
        return given, pool.reused_bytes, pool.lent_bytes

    def clear(self) -> None:
        """Stop every replicator and forget them (the job is over)."""
        self.abandon()
        self._stores = []
