"""Replication of every rank's snapshot to its buddies, off the training thread.

After the optimizer step of step ``s`` the training loop calls :meth:`Replicator.replicate`. That
copies the live state into the free snapshot slot (a few large copies; on a GPU on a side stream),
posts the transfers of the round (the snapshot to the ranks that hold this rank's replica, the
replicas this rank holds from their owners, in chunks, with batched ``isend``/``irecv`` on a
process group of its own) and hands the step to a worker thread. The worker waits for the
transfers, checksums the snapshot and exchanges the headers that carry the checksum. The next
forward and backward run meanwhile.

Where the round's transfers are posted matters on a GPU. NCCL requires operations on two
communicators (FSDP's and replication's) to be launched in the same order on every rank, or
kernels that cannot run side by side (one hardware queue with ``CUDA_DEVICE_MAX_CONNECTIONS=1``,
CUDA graphs, SMs taken by compute) wait on each other across ranks for ever. Posted by the
training thread inside ``replicate()``, the round's NCCL operations sit between the same two of
FSDP's collectives on every rank; the worker thread launches no NCCL operation at all: the
headers and the commit go over a gloo group (host tensors, no kernel). Gloo transfers of pinned
snapshots are posted by the worker once the copy landed (gloo reads host memory, unordered
with CUDA streams, and launches no kernel to order).

A round ends with a commit barrier (an all-reduce on the headers' gloo group): when it returns,
every rank has its snapshot of ``s`` and every replica of ``s`` is complete, so ``s`` is the
*committed step*, the state recovery rolls back to.

Why a new snapshot waits for the previous round: the slot it overwrites holds step ``s - 1``. That
is safe only once ``s`` is committed everywhere, otherwise a rank that died during round ``s``
would leave the survivors with nothing common to roll back to. So ``replicate(s + 1)`` waits (up
to ``timeout_s``) for round ``s``; when replication is slower than a training step, training is
throttled to it rather than running ahead of what could be recovered.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from p2p_state.checksum import Checksum
from p2p_state.config import ReplicationConfig
from p2p_state.layout import LayoutMismatchError, StateLayout, check_same_structure
from p2p_state.memory import (
    BufferPool,
    MemoryKind,
    check_fits,
    pinned_footprint,
    recheck_after_step,
    resolve_kind,
)
from p2p_state.placement import Placement, place
from p2p_state.snapshot import (
    HEADER_WORDS,
    Copy,
    DoubleBuffer,
    HostStaging,
    Slot,
    SnapshotHeader,
)
from p2p_state.state import TrainingState
from p2p_state.transfer import RecvBuffer, SendBuffer, Transfer, exchange, gather_bytes

logger = logging.getLogger(__name__)


class ReplicationError(RuntimeError):
    """Replication failed (a peer died, a deadline passed); the committed step stops advancing."""


class ReplicaCorruptError(RuntimeError):
    """A replica or snapshot failed its checksum and must not be restored from."""


@dataclass(frozen=True, slots=True)
class ReplicaInfo:
    """A complete copy of ``owner``'s state at ``step`` held by this rank."""

    owner: int
    step: int
    generation: int
    layout_hash: str
    nbytes: int
    checksum: int


@dataclass(frozen=True, slots=True)
class RoundStats:
    """Where the time of one replication round went (seconds) and how many bytes it moved."""

    step: int
    copy_s: float
    """Snapshot copy on the training thread (on a GPU: enqueueing it on the side stream)."""
    checksum_s: float
    transfer_s: float
    """All chunk rounds of the send/recv of the snapshot bytes to and from the buddies, from
    their posting to the last byte."""
    header_s: float
    """The header exchange after the data, mostly waiting for the buddies' checksums."""
    commit_s: float
    """The commit barrier: waiting for every other rank to finish the round."""
    bytes_sent: int
    bytes_received: int
    post_s: float = 0.0
    """Posting the round's transfers on the training thread (0 where the worker posts them)."""


@dataclass(slots=True)
class _Round:
    step: int
    slot: Slot
    replicas: dict[int, Slot]  # the slot each owner's replica of this step is received into
    copied: Any  # torch.cuda.Event on a GPU, None on the host
    copy_s: float
    transfer: Transfer | None  # posted by replicate(); None: the worker posts it
    posted_at: float
    post_s: float


class CudaStreams:
    """The stream and event calls the replicator makes on ``device`` (tests pass stand-ins that
    record the order of what is enqueued where)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def new_stream(self) -> Any:
        """A side stream for snapshot copies."""
        return torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]

    def current(self) -> Any:
        """The calling thread's current stream (the training stream)."""
        return torch.cuda.current_stream(self.device)

    def use(self, stream: Any) -> contextlib.AbstractContextManager[object]:
        """Make ``stream`` current inside the ``with``."""
        return torch.cuda.stream(stream)

    def new_event(self) -> Any:
        """An event to record after a copy."""
        return torch.cuda.Event()  # type: ignore[no-untyped-call]


def state_device(state: TrainingState) -> torch.device:
    """The device the training state lives on (of its first parameter; CPU if it has none)."""
    first = next(iter(state.model.parameters()), None)
    return first.device if first is not None else torch.device("cpu")


def _buffer_of(slot: Slot) -> torch.Tensor:
    """The buffer of a slot :meth:`DoubleBuffer.writable` handed out (it allocates one)."""
    assert slot.buffer is not None
    return slot.buffer


def _resolve_backend(config: ReplicationConfig, kind: MemoryKind) -> str:
    backend = config.backend
    if backend == "auto":
        backend = "nccl" if kind is MemoryKind.GPU else "gloo"
    if backend == "nccl" and kind is not MemoryKind.GPU:
        raise ValueError(
            f"ReplicationConfig.backend='nccl' moves GPU buffers only, but memory is "
            f"{kind.value!r}; use memory='gpu', or backend='gloo' for host or pinned replicas"
        )
    if backend == "gloo" and kind is MemoryKind.GPU:
        raise ValueError(
            "ReplicationConfig.memory='gpu' needs backend='nccl' (gloo sends host tensors); "
            "use memory='pinned' to keep replicas in host memory with gloo"
        )
    return backend


class Replicator:
    """Keeps this rank's snapshots and its buddies' replicas, and replicates every N steps.

    Construction is collective: every rank of the default process group must create its
    replicator at the same point (it creates the replication process group and exchanges
    layouts). Ranks whose states differ in structure get a :class:`LayoutMismatchError`.

    Args:
        state: The live training state to snapshot.
        config: Replication settings.
        generation: Membership generation stamped on every snapshot header.
        on_replicated: Called from the worker thread with each newly committed step.
        progress_hook: Called from the worker thread as ``hook(step, round, num_rounds)`` after
            each chunk round of a transfer (fault injection and progress reporting).
        group: The replication process group (every rank of the default group, backend
            :meth:`backend_for`); by default one is created, and destroyed by :meth:`close`.
            A group passed in belongs to the caller.
        control_group: The gloo group the headers and commits go over (host tensors): by
            default ``group`` when that is gloo; beside an NCCL ``group`` one is created, and
            destroyed by :meth:`close`. A group passed in belongs to the caller.
        placement: Who holds whose replica; by default :func:`place` over the default group's
            world with ``ranks_per_node``.
        prefault: Zero the snapshot and replica buffers now, so the first rounds do not pay
            the page faults (at a job's start; not with ``recycle``).
        recycle: A recovery's pool of the previous generation's buffers (see
            :meth:`give_back`): each slot takes its buffer from there when it is first
            written (the own slots by the snapshots of the restored and the next step, the
            replicas when a round posts its receives), and a new one, not prefaulted, only if
            none fits.
            Nothing is allocated on the recovery's critical path.
    """

    def __init__(
        self,
        state: TrainingState,
        config: ReplicationConfig | None = None,
        *,
        generation: int = 0,
        on_replicated: Callable[[int], None] | None = None,
        progress_hook: Callable[[int, int, int], None] | None = None,
        group: dist.ProcessGroup | None = None,
        control_group: dist.ProcessGroup | None = None,
        placement: Placement | None = None,
        prefault: bool = True,
        recycle: BufferPool | None = None,
    ) -> None:
        self.state = state
        self.layout = state.layout
        """This rank's layout (kept when :meth:`abandon` lets go of the state)."""
        self.config = config or ReplicationConfig()
        self.generation = generation
        self._on_replicated = on_replicated
        self._progress_hook = progress_hook
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.device = state_device(state)
        self.kind, self.backend = self.backend_for(self.config, self.device)
        if placement is None:
            rpn = self.config.ranks_per_node or int(
                os.environ.get("LOCAL_WORLD_SIZE", self.world_size)
            )
            placement = place(self.world_size, rpn, self.config.k)
        assert placement.world_size == self.world_size
        self.placement: Placement = placement
        for warning in self.placement.warnings():
            logger.warning("replica placement: %s", warning)

        timeout = timedelta(seconds=self.config.timeout_s)
        self._owns_group = group is None
        self.group = group or dist.new_group(backend=self.backend, timeout=timeout)
        self._owns_control = control_group is None and self.backend != "gloo"
        if control_group is None:
            control_group = (
                self.group
                if self.backend == "gloo"
                else dist.new_group(backend="gloo", timeout=timeout)
            )
        self.control_group = control_group
        # NCCL transfers and host snapshots are posted by replicate() on the training thread;
        # gloo transfers of a snapshot copied on a side stream wait for the copy, in the worker.
        self._post_in_step = self.backend == "nccl" or self.device.type != "cuda"
        # The layouts go over the replication group itself: on its device for NCCL.
        wire = self.device if self.backend == "nccl" else torch.device("cpu")
        raw = gather_bytes(state.layout.to_bytes(), self.group, wire, self.config.timeout_s)
        self.layouts = [StateLayout.from_bytes(b) for b in raw]
        check_same_structure(self.layouts)
        assert self.layouts[self.rank].layout_hash == state.layout.layout_hash

        self.holders = self.placement.holders[self.rank]
        self.owners = self.placement.held_by[self.rank]
        # Pinned buffers take what the caching host allocator rounds them up to.
        size = pinned_footprint if self.kind is MemoryKind.PINNED else int
        own_bytes = 2 * size(state.layout.total_bytes)
        replica_bytes = 2 * sum(size(self.layouts[o].total_bytes) for o in self.owners)
        needed = {self.kind: own_bytes + replica_bytes}
        if self.kind is MemoryKind.GPU:
            needed[MemoryKind.PINNED] = pinned_footprint(state.staging_bytes())
        check_fits(
            needed,
            self.device,
            self.config.max_memory_fraction,
            f"rank {self.rank}'s snapshots (2 x {state.layout.total_bytes / 2**20:.1f} MiB) and "
            f"replicas for ranks {list(self.owners)}",
            self.config.step_peak_bytes,
        )
        logger.info(
            "rank %d holds %.1f MiB of own snapshots and %.1f MiB of replicas (ranks %s) in %s "
            "memory; its shard is held by ranks %s; %s over %s",
            self.rank,
            own_bytes / 2**20,
            replica_bytes / 2**20,
            list(self.owners),
            self.kind.value,
            list(self.holders),
            state.layout.describe(),
            self.backend,
        )
        self.own = DoubleBuffer(
            state.layout.total_bytes, self.kind, self.device, prefault, pool=recycle
        )
        self.replicas = {
            o: DoubleBuffer(
                self.layouts[o].total_bytes, self.kind, self.device, prefault, pool=recycle
            )
            for o in self.owners
        }
        self.memory_bytes = {self.kind.value: own_bytes + replica_bytes}
        self._snapshots = 0

        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._in_flight = 0
        self._committed = -1
        self.signal = 0
        """A number every rank contributes to each round's commit; the round agrees on the
        largest (e.g. a generation to switch to at a step boundary)."""
        self._agreed: dict[int, int] = {}
        self._failure: BaseException | None = None
        self._queue: queue.Queue[_Round | None] = queue.Queue()
        self.stats: collections.deque[RoundStats] = collections.deque(maxlen=1024)
        """Timings of the most recent rounds, oldest first."""
        self._left_behind = False
        """The worker outlived a stop's deadline once (blocked where the abort did not reach);
        later stops do not wait for it again."""
        self._use_streams(CudaStreams(self.device) if self.device.type == "cuda" else None)
        self._worker = threading.Thread(
            target=self._work, name=f"p2p-replicator-{self.rank}", daemon=True
        )
        self._worker.start()

    def _use_streams(self, cuda: CudaStreams | None) -> None:
        """Snapshot on a side stream of ``cuda`` (``None``: on the host, synchronously)."""
        self._cuda = cuda
        self._stream = cuda.new_stream() if cuda is not None else None
        self._last_copy: Any = None
        self._fence_handle = self._forward_fence_handle = None
        self._staging: HostStaging | None = None
        if cuda is None:
            return
        if self.kind is MemoryKind.GPU:
            # Pinned now, at start-up: the host-resident pieces of every snapshot pass here.
            self._staging = HostStaging(
                self.device, self.state.staging_bytes(), new_event=cuda.new_event
            )
        if self.state.optimizer is not None:
            # The next optimizer step must not overwrite parameters the side stream still copies.
            self._fence_handle = self.state.optimizer.register_step_pre_hook(self._fence)
        # Nor the next forward overwrite buffers it mutates (BatchNorm statistics, FP8
        # amax/scale), which are snapshotted too: its kernels wait for the copy as well. First
        # among the model's pre-hooks, so FSDP's unshard streams are ordered after the wait.
        self._forward_fence_handle = self.state.model.register_forward_pre_hook(
            self._fence, prepend=True
        )

    @staticmethod
    def backend_for(config: ReplicationConfig, device: torch.device) -> tuple[MemoryKind, str]:
        """The memory kind and transport a replicator of training state on ``device`` uses."""
        kind = resolve_kind(config.memory, device)
        return kind, _resolve_backend(config, kind)

    # -- training thread -----------------------------------------------------------------------

    def replicate(self, step: int, extras: Mapping[str, Any] | None = None) -> bool:
        """Snapshot the state of ``step`` and replicate it in the background.

        Call after ``optimizer.step()`` (and ``scheduler.step()``). Returns at once unless the
        previous round is still running, in which case it first waits for that round.

        Args:
            step: The global step the state stands for (after its optimizer step).
            extras: Small msgpack-able values to carry with the snapshot (e.g. a sampler
                position); the recovery engine returns them with the restored state.

        Returns:
            Whether a snapshot was taken (``False`` when ``step`` is not a multiple of
            ``interval_steps``).

        Raises:
            ReplicationError: an earlier round failed, or the previous round outlived the
                deadline.
        """
        if not self.due(step):
            return False
        self._wait_idle()
        slot = self.own.writable()
        with self._lock:
            replicas = {o: self.replicas[o].writable() for o in self.owners}
        t0 = time.perf_counter()
        transfer = None
        if self._cuda is not None:
            # Enqueued only: the side stream starts once the optimizer step is done, and no
            # copy here waits for it (the host-resident pieces go through the pinned staging).
            assert self._stream is not None  # made with self._cuda
            self._stream.wait_stream(self._cuda.current())
            with self._cuda.use(self._stream):
                self.state.capture(_buffer_of(slot), step, extras, self._staging)
                copied = self._cuda.new_event()
                copied.record(self._stream)
                t1 = time.perf_counter()
                if self._post_in_step:  # NCCL's stream waits for the side stream: the copy
                    transfer = self._post(slot, replicas)
            self._last_copy = copied
        else:
            self.state.capture(_buffer_of(slot), step, extras)
            copied = None
            t1 = time.perf_counter()
            transfer = self._post(slot, replicas)
        t2 = time.perf_counter()
        with self._lock:
            self._in_flight += 1
        self._queue.put(_Round(step, slot, replicas, copied, t1 - t0, transfer, t1, t2 - t1))
        self._snapshots += 1
        if self._snapshots == 2 and self.kind is MemoryKind.GPU:
            self._recheck_memory()
        return True

    def _post(self, slot: Slot, replicas: dict[int, Slot]) -> Transfer:
        """Post every chunk of a round's transfers: this rank's snapshot in ``slot`` to its
        holders, each owner's replica into its slot in ``replicas``."""
        transfer = Transfer(
            [SendBuffer(h, _buffer_of(slot)[: self.layout.total_bytes]) for h in self.holders],
            [
                RecvBuffer(o, _buffer_of(replicas[o])[: self.layouts[o].total_bytes])
                for o in self.owners
            ],
            self.group,
            chunk_bytes=self.config.chunk_bytes,
        )
        try:
            transfer.post_all()
        except Exception as e:
            with self._lock:
                self._failure = e
            raise ReplicationError(f"replication failed: {e}") from e
        return transfer

    def _recheck_memory(self) -> None:
        """After the first training step the allocator knows its peak: check the GPU budget
        again with it, and say so with the numbers and the fix if it is exceeded (the step ran,
        but a later, larger one may not)."""
        held = self.memory_bytes.get(MemoryKind.GPU.value, 0)
        verdict = recheck_after_step(
            held,
            self.device,
            self.config.max_memory_fraction,
            f"rank {self.rank}'s snapshots and replicas",
            self.config.step_peak_bytes,
        )
        if verdict is not None:
            logger.warning("after the first training step: %s", verdict)

    @property
    def slot_sizes(self) -> list[int]:
        """The sizes of this replicator's buffers: two slots of its own snapshot, two of each
        replica it holds (what a spare allocates ahead to take this rank's place)."""
        replicas = [b.nbytes for b in self.replicas.values()]
        return [self.own.nbytes] * 2 + replicas * 2

    @property
    def slots_allocated(self) -> bool:
        """Whether every slot has its buffer (slots taken from a pool get it when first written)."""
        return self.own.allocated and all(b.allocated for b in self.replicas.values())

    def due(self, step: int) -> bool:
        """Whether :meth:`replicate` snapshots ``step`` (one step in ``interval_steps``)."""
        return step % self.config.interval_steps == 0

    def flush(self, timeout_s: float | None = None) -> int:
        """Wait until every queued round is committed; returns the committed step."""
        self._wait_idle(timeout_s)
        return self._committed

    def agreed_signal(self, step: int) -> int | None:
        """The largest :attr:`signal` any rank gave the round of ``step`` (None if that round
        has not committed here). Every rank reads the same value for the same round."""
        with self._lock:
            return self._agreed.get(step)

    @property
    def committed_step(self) -> int:
        """The latest step every rank has snapshotted and replicated (-1 before the first)."""
        return self._committed

    def _wait_idle(self, timeout_s: float | None = None) -> None:
        timeout_s = self.config.timeout_s if timeout_s is None else timeout_s
        with self._idle:
            done = self._idle.wait_for(
                lambda: self._in_flight == 0 or self._failure is not None, timeout=timeout_s
            )
            if self._failure is not None:
                raise ReplicationError(f"replication failed: {self._failure}") from self._failure
            if not done:
                raise ReplicationError(
                    f"rank {self.rank}: the previous replication round did not finish within "
                    f"{timeout_s:.0f}s (ReplicationConfig.timeout_s)"
                )

    def _fence(self, *_: Any) -> None:
        if self._last_copy is not None:
            assert self._cuda is not None  # copies are recorded on its streams only
            self._cuda.current().wait_event(self._last_copy)

    # -- worker thread -------------------------------------------------------------------------

    def _work(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the current device is per thread
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                if self._failure is None:
                    self._run_round(job)
            except BaseException as e:
                logger.error("rank %d: replication of step %d failed: %s", self.rank, job.step, e)
                with self._lock:
                    self._failure = e
            finally:
                with self._idle:
                    self._in_flight -= 1
                    self._idle.notify_all()

    def _run_round(self, job: _Round) -> None:
        ctx = self._cuda.use(self._stream) if self._cuda is not None else contextlib.nullcontext()
        with ctx:
            layout = self.layout
            own = _buffer_of(job.slot)[: layout.total_bytes]
            transfer, posted_at = job.transfer, job.posted_at
            if transfer is None:  # gloo from host memory a side stream copies into
                if job.copied is not None:
                    job.copied.synchronize()
                posted_at = time.perf_counter()
                transfer = self._post(job.slot, job.replicas)
            # Data first, so every rank starts sending as soon as its copy is done; then the
            # checksum, then the headers that carry it. (Checksumming while the chunks are in
            # flight was measured slower on loopback, where both compete for the same cores.)
            while transfer.rounds_in_flight:
                done = transfer.wait_oldest(self.config.timeout_s)
                if self._cuda is not None:
                    # NCCL's waits only order the side stream: the host waits for the bytes.
                    moved = self._cuda.new_event()
                    moved.record(self._stream)
                    moved.synchronize()
                if self._progress_hook is not None:
                    self._progress_hook(job.step, done, transfer.num_rounds)
            t1 = time.perf_counter()
            digest = Checksum(own.is_cuda)
            digest.update(own, 0)
            t2 = time.perf_counter()
            header = SnapshotHeader(
                step=job.step,
                generation=self.generation,
                layout_hash=layout.layout_hash,
                nbytes=layout.total_bytes,
                checksum=digest.value(),
                algo=digest.algo,
            )
            with self._lock:
                self.own.publish(job.slot, header)
            # A replica is published only once its header checked out and every chunk arrived.
            out_header = header.to_tensor()
            in_headers = {o: torch.empty(HEADER_WORDS, dtype=torch.int64) for o in self.owners}
            exchange(
                [SendBuffer(h, out_header.view(torch.uint8)) for h in self.holders],
                [RecvBuffer(o, in_headers[o].view(torch.uint8)) for o in self.owners],
                self.control_group,
                chunk_bytes=self.config.chunk_bytes,
                timeout_s=self.config.timeout_s,
            )
            t3 = time.perf_counter()
            incoming = {o: self._check_header(o, t, header) for o, t in in_headers.items()}
            for o in self.owners:
                with self._lock:
                    self.replicas[o].publish(job.replicas[o], incoming[o])
                if self.config.verify_on_receive and not job.replicas[o].verify():
                    logger.error("replica of rank %d at step %d is unusable", o, job.step)
            t4 = time.perf_counter()
            self._commit(job.step)
            self.stats.append(
                RoundStats(
                    step=job.step,
                    copy_s=job.copy_s,
                    checksum_s=t2 - t1,
                    transfer_s=t1 - posted_at,
                    header_s=t3 - t2,
                    commit_s=time.perf_counter() - t4,
                    bytes_sent=layout.total_bytes * len(self.holders),
                    bytes_received=sum(incoming[o].nbytes for o in self.owners),
                    post_s=job.post_s,
                )
            )

    def _check_header(self, owner: int, t: torch.Tensor, mine: SnapshotHeader) -> SnapshotHeader:
        header = SnapshotHeader.from_tensor(t)
        expected = self.layouts[owner]
        if header.layout_hash != expected.layout_hash:
            raise LayoutMismatchError(
                f"rank {owner} sent a snapshot of layout {header.layout_hash} but announced "
                f"{expected.describe()}; refusing to store it as its replica"
            )
        if header.step != mine.step or header.nbytes != expected.total_bytes:
            raise ReplicationError(
                f"rank {owner} sent step {header.step} ({header.nbytes} bytes) while this rank "
                f"replicates step {mine.step} ({expected.total_bytes} bytes expected)"
            )
        return header

    def _commit(self, step: int) -> None:
        # One all-reduce commits the step (MIN) and agrees on the signal (MAX, as MIN of the
        # negation): every rank gets the same answer for this round.
        t = torch.tensor([step, -self.signal], dtype=torch.int64)
        work = dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control_group, async_op=True)
        if not work.wait(timeout=timedelta(seconds=self.config.timeout_s)):
            raise ReplicationError(f"commit barrier of step {step} timed out")
        committed, agreed = (int(x) for x in t.tolist())
        with self._lock:
            self._committed = committed
            self._agreed[step] = -agreed
            for old in [s for s in self._agreed if s < step - 8]:
                del self._agreed[old]
        if self._on_replicated is not None:
            self._on_replicated(self._committed)

    # -- queries (the recovery planner's view) -------------------------------------------------

    def holdings(self) -> dict[int, list[ReplicaInfo]]:
        """Complete replicas this rank holds: ``{owner: [ReplicaInfo, ...]}``, oldest first."""
        with self._lock:
            out = {}
            for owner, buf in self.replicas.items():
                infos = []
                for step in buf.complete_steps():
                    slot = buf.find(step)
                    assert slot is not None and slot.header is not None  # a complete step's
                    h = slot.header
                    infos.append(
                        ReplicaInfo(
                            owner, h.step, h.generation, h.layout_hash, h.nbytes, h.checksum
                        )
                    )
                out[owner] = infos
            return out

    def own_steps(self) -> list[int]:
        """Steps of this rank's own complete snapshots, ascending."""
        with self._lock:
            return self.own.complete_steps()

    def replica_slot(self, owner: int, step: int) -> Slot:
        """The verified replica of ``owner`` at ``step``.

        Raises:
            KeyError: no complete replica of that owner and step is held here.
            ReplicaCorruptError: it failed its checksum (it is marked and never used).
        """
        with self._lock:
            buf = self.replicas.get(owner)
            slot = buf.find(step) if buf is not None else None
        if slot is None:
            raise KeyError(f"rank {self.rank} holds no complete replica of rank {owner} at {step}")
        if not slot.verify():
            raise ReplicaCorruptError(
                f"rank {self.rank}'s replica of rank {owner} at step {step} failed its checksum"
            )
        return slot

    def read(self, owner: int, step: int, start: int, end: int) -> torch.Tensor:
        """Bytes ``[start, end)`` of ``owner``'s state at ``step`` (a view; do not modify).

        ``owner`` may be this rank (its own snapshot) or any rank whose replica it holds.
        """
        slot = self.slot(owner, step)
        assert slot.header is not None and slot.buffer is not None  # verified: written
        assert 0 <= start <= end <= slot.header.nbytes
        return slot.buffer[start:end]

    def copies(self) -> list[Copy]:
        """Every complete copy held here (own snapshots and replicas)."""
        out = [Copy(self.world_size, self.rank, s, True) for s in self.own_steps()]
        for owner, infos in self.holdings().items():
            out += [Copy(self.world_size, owner, i.step, False) for i in infos]
        return out

    def slot(self, owner: int, step: int) -> Slot:
        """The verified copy of ``owner``'s state at ``step``: the own snapshot or a replica."""
        return self.own_slot(step) if owner == self.rank else self.replica_slot(owner, step)

    def own_slot(self, step: int) -> Slot:
        """This rank's verified own snapshot of ``step`` (same errors as :meth:`replica_slot`)."""
        with self._lock:
            slot = self.own.find(step)
        if slot is None:
            raise KeyError(f"rank {self.rank} holds no snapshot of its own state at step {step}")
        if not slot.verify():
            raise ReplicaCorruptError(f"rank {self.rank}'s own snapshot of {step} is corrupt")
        return slot

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the worker thread (after the round in progress) and release the process group."""
        if not self._stop_worker(timeout_s):
            return
        if self._failure is None:
            if self._owns_control:
                dist.destroy_process_group(self.control_group)
            if self._owns_group:
                dist.destroy_process_group(self.group)

    def abandon(self, timeout_s: float = 10.0) -> bool:
        """Stop replicating after a fault, keeping every complete copy readable.

        The caller has aborted the replication group, so a round in flight fails promptly;
        nothing incomplete is ever published. The group is left to its owner.

        The live state is let go of: the copies are read without it, and the model and
        optimizer it points at (the old generation's) must not stay allocated while the next
        generation's are built.

        Returns:
            Whether the worker stopped within ``timeout_s`` (if not, it is left as a daemon;
            it only ever writes slots that are not published). With ``timeout_s=0`` it is only
            told to stop: :meth:`left_behind` says later whether it did.
        """
        with self._lock:
            if self._failure is None:
                self._failure = ReplicationError("replication was abandoned after a fault")
        stopped = self._stop_worker(timeout_s)
        if hasattr(self, "state"):
            del self.state  # replicate() refuses from now on (the failure above)
        return stopped

    def give_back(self, pool: BufferPool, keep: Collection[int] = ()) -> int:
        """Move the buffers of every copy but those of the steps in ``keep`` into ``pool``, for
        the next generation's replicator; the copies of the kept steps stay readable here.

        Only after :meth:`abandon`, and only once the worker has stopped: a worker left behind
        may still write into its slots, so then nothing is given back.

        Returns:
            The bytes given back.
        """
        if self._failure is None:
            raise RuntimeError("give_back() is for an abandoned replicator")
        if self._worker.is_alive():
            return 0
        if self._last_copy is not None:
            # A snapshot copy on the side stream may still be writing an own slot.
            self._last_copy.synchronize()
        with self._lock:
            buffers = [self.own, *self.replicas.values()]
            return sum(b.give_back(pool, keep) for b in buffers)

    def _stop_worker(self, timeout_s: float) -> bool:
        if self._fence_handle is not None:
            self._fence_handle.remove()
            self._fence_handle = None
        if self._forward_fence_handle is not None:
            self._forward_fence_handle.remove()
            self._forward_fence_handle = None
        if not self._worker.is_alive():
            return True
        if self._left_behind:
            # Found in a transfer once already: an old generation's store is abandoned again at
            # every later fault, and waiting each time would add the deadline to each recovery.
            return False
        self._queue.put(None)
        if timeout_s > 0:
            self._worker.join(timeout=timeout_s)
            if self.left_behind(f"after {timeout_s * 1e3:.0f} ms"):
                return False
        return not self._worker.is_alive()

    def left_behind(self, when: str = "when the next replicator is made") -> bool:
        """Whether the worker is still in a round after :meth:`abandon` (blocked where the abort
        did not reach); the first time, the log says where it is. It is then a daemon that only
        ever writes slots that are not published, and :meth:`give_back` gives nothing back."""
        if not self._worker.is_alive():
            return False
        if not self._left_behind:
            self._left_behind = True
            ident = self._worker.ident  # set: the worker was started
            frame = sys._current_frames().get(ident) if ident is not None else None
            where = "".join(traceback.format_stack(frame, limit=4)) if frame else "?\n"
            logger.error(
                "rank %d: replication worker still busy %s; leaving it (daemon). It is at:\n%s",
                self.rank,
                when,
                where.rstrip(),
            )
        return True

    def __enter__(self) -> Replicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
