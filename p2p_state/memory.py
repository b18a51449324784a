"""Where snapshot and replica bytes live, and how much there is room for
(checksums: :mod:`p2p_state.checksum`).

Three kinds of memory: GPU memory (fastest to copy to and from the training state, uses HBM),
pinned host memory (page-locked, so GPU<->host copies are DMA at full PCIe speed), and plain
host memory (the only kind on a CPU-only build).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import threading
import time
from collections.abc import Iterator

import torch

from p2p_state.checksum import Checksum, checksum  # noqa: F401  (re-exported)

logger = logging.getLogger(__name__)


class MemoryKind(str, enum.Enum):
    """Kind of memory a buffer is allocated in."""

    GPU = "gpu"
    PINNED = "pinned"
    HOST = "host"


class InsufficientMemoryError(ValueError):
    """The configured snapshots and replicas would not fit in the memory they are meant for."""


def resolve_kind(requested: str, device: torch.device) -> MemoryKind:
    """Turn a configured kind (``auto`` or a :class:`MemoryKind` value) into a concrete kind.

    ``auto`` means GPU memory when training on a GPU, plain host memory otherwise.

    Raises:
        ValueError: ``gpu`` or ``pinned`` asked for where there is no CUDA device.
    """
    if requested == "auto":
        return MemoryKind.GPU if device.type == "cuda" else MemoryKind.HOST
    kind = MemoryKind(requested)
    if kind in (MemoryKind.GPU, MemoryKind.PINNED) and not torch.cuda.is_available():
        raise ValueError(
            f"ReplicationConfig.memory={requested!r} needs a CUDA device and none is available; "
            "use memory='host' (or 'auto')"
        )
    return kind


def allocate(
    nbytes: int, kind: MemoryKind, device: torch.device, prefault: bool = True
) -> torch.Tensor:
    """A 1-D ``uint8`` buffer of ``nbytes`` bytes of the given kind.

    With ``prefault`` the bytes are zeroed, which touches every page now instead of during the
    first snapshots. Without it the bytes hold whatever the memory held; those a snapshot never
    writes (alignment padding) are sent and checksummed as they are, so every copy of a
    snapshot still agrees with it byte for byte.
    """
    if kind is MemoryKind.GPU:
        if not prefault:
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        return torch.zeros(nbytes, dtype=torch.uint8, device=device)
    buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=kind is MemoryKind.PINNED)
    return buf.zero_() if prefault else buf


class BufferPool:
    """Buffers a previous generation's stores gave back, for the slots of the next one.

    A recovery's new replicator needs as many buffers as the old one had, of the same sizes when
    the world size is unchanged, while the old one's copies are still the fallback. Its slots
    take their buffers from here as they are first written, by which time the old stores have
    given back what they no longer need: no fresh memory is touched (host memory: no page
    faults; pinned memory: no pinning, which is slower still) on the way back to training.

    Thread-safe: slots are taken by the training thread and the replication worker.
    """

    def __init__(self) -> None:
        self._free: list[tuple[MemoryKind, torch.Tensor]] = []
        self._lock = threading.Lock()
        self.reused_bytes = 0
        """Bytes handed out from given-back buffers (fresh allocations not counted)."""
        self.fresh_bytes = 0
        """Bytes handed out or lent as fresh allocations, for want of a given-back buffer that
        fits."""
        self.lent_bytes = 0
        """Bytes of the pool's buffers lent by :meth:`borrowed` (and given back)."""

    def put(self, kind: MemoryKind, buffer: torch.Tensor) -> None:
        """Give ``buffer`` (1-D ``uint8`` of ``kind``) to the pool; its bytes are not kept."""
        with self._lock:
            self._free.append((kind, buffer))

    def take(self, nbytes: int, kind: MemoryKind, device: torch.device) -> torch.Tensor:
        """A buffer of ``nbytes`` bytes: the smallest given-back one that fits, else a new one.

        Either way its bytes are whatever they were (see :func:`allocate` without prefault).
        """
        return self._take(nbytes, kind, device, lent=False)[:nbytes]

    def _take(
        self, nbytes: int, kind: MemoryKind, device: torch.device, *, lent: bool
    ) -> torch.Tensor:
        """The smallest buffer that fits, whole (a borrowed one goes back as it was), or a new
        one; counted as lent or reused, or as fresh."""
        where = torch.device(device) if kind is MemoryKind.GPU else torch.device("cpu")
        with self._lock:
            fits = [
                (b.numel(), i)
                for i, (k, b) in enumerate(self._free)
                if k is kind and b.device == where and b.numel() >= nbytes
            ]
            if fits:
                _, i = min(fits)
                if lent:
                    self.lent_bytes += nbytes
                else:
                    self.reused_bytes += nbytes
                return self._free.pop(i)[1]
        buffer = allocate(nbytes, kind, device, prefault=False)
        with self._lock:
            self.fresh_bytes += nbytes
        return buffer

    @contextlib.contextmanager
    def borrowed(
        self, nbytes: int, kind: MemoryKind, device: torch.device
    ) -> Iterator[torch.Tensor]:
        """A buffer of ``nbytes`` bytes for the ``with`` block (the smallest that fits, else a
        new one), given to the pool after it (a restore's receive buffer, which a slot takes
        next); counted in :attr:`lent_bytes` (or :attr:`fresh_bytes`), not as handed out."""
        buffer = self._take(nbytes, kind, device, lent=True)
        try:
            yield buffer[:nbytes]
        finally:
            self.put(kind, buffer)

    def __len__(self) -> int:
        with self._lock:
            return len(self._free)

    @property
    def free_bytes(self) -> int:
        """Bytes of the buffers in the pool now."""
        with self._lock:
            return sum(b.numel() for _, b in self._free)


class PreparedPool:
    """Buffers allocated before they are needed, on a thread of their own: a hot spare's.

    A spare learns from the coordinator the sizes of the buffers any rank's replicator holds
    (:mod:`launcher.prepare`) and allocates them here while it waits, pinned, zeroed (every page
    touched) or in GPU memory as the ranks keep theirs. When it takes a rank, its replicator's
    slots come out of :meth:`take`'s pool instead of being allocated on the recovery's critical
    path. What would not fit is not allocated (a warning says so): the replicator's own check
    decides then, as on any rank.

    Args:
        device: The spare's training device (GPU memory is allocated there).
        max_fraction: Largest share of the free memory of a kind the buffers may take.
    """

    def __init__(self, device: torch.device, max_fraction: float) -> None:
        self.device = device
        self.max_fraction = max_fraction
        self._lock = threading.Lock()
        self._spec: tuple[MemoryKind, tuple[int, ...]] | None = None
        self._pool: BufferPool | None = None
        self._thread: threading.Thread | None = None
        self._cancel = threading.Event()
        self._done = False
        self.prepared_bytes = 0
        """Bytes allocated into the current pool so far."""
        self.prepare_s = 0.0
        """Seconds the current pool took to allocate (0 while it is being allocated)."""

    def prepare(self, kind: MemoryKind, sizes: tuple[int, ...]) -> None:
        """Hold buffers of ``sizes`` bytes of ``kind`` (the previous ones are let go unless
        they already hold every size). Returns at once: they are allocated on a thread."""
        with self._lock:
            if self._done:
                return  # taken or closed: the spare holds a rank, with slots of its own
            if self._spec is not None and self._spec[0] is kind and _holds(self._spec[1], sizes):
                return
            # The previous allocation stops at its next buffer; not waited for here (this is
            # the control client's thread, which must keep heartbeating).
            self._cancel.set()
            self._spec, self._pool = (kind, sizes), BufferPool()
            self.prepared_bytes, self.prepare_s = 0, 0.0
            self._cancel = threading.Event()
            self._thread = threading.Thread(
                target=self._allocate,
                args=(self._pool, kind, sizes, self._cancel),
                name="p2p-prepare-memory",
                daemon=True,
            )
            self._thread.start()

    def take(self, timeout_s: float = 60.0) -> BufferPool | None:
        """The prepared pool (``None`` if none was asked for), once its allocation is done or
        ``timeout_s`` passed (then with what it holds so far); the pool is the caller's."""
        with self._lock:
            thread, pool = self._thread, self._pool
            self._spec, self._pool, self._thread, self._done = None, None, None, True
        if thread is not None:
            thread.join(timeout_s)
            if thread.is_alive():
                logger.warning(
                    "the spare's buffers were not all allocated within %.0fs: the rest are "
                    "allocated when first needed",
                    timeout_s,
                )
                self._cancel.set()
        return pool

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop allocating (waiting up to ``timeout_s`` for the buffer being allocated) and let
        go of the buffers."""
        with self._lock:
            thread = self._thread
            self._cancel.set()
            self._spec, self._pool, self._thread, self._done = None, None, None, True
        if thread is not None:
            thread.join(timeout_s)

    def _allocate(
        self,
        pool: BufferPool,
        kind: MemoryKind,
        sizes: tuple[int, ...],
        cancel: threading.Event,
    ) -> None:
        t0 = time.perf_counter()
        size = pinned_footprint if kind is MemoryKind.PINNED else int
        what = f"a spare's buffers for a rank's copies ({len(sizes)} buffers)"
        try:
            if kind is not MemoryKind.HOST and self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # the current device is per thread
            check_fits({kind: sum(size(n) for n in sizes)}, self.device, self.max_fraction, what)
            for n in sizes:
                if cancel.is_set():
                    return  # taken, closed or asked for other sizes meanwhile
                buffer = allocate(n, kind, self.device, prefault=True)
                if cancel.is_set():
                    return
                pool.put(kind, buffer)
                self.prepared_bytes += n
        except (InsufficientMemoryError, RuntimeError, ValueError) as e:
            logger.warning("%s were not allocated ahead: %s", what, e)
            return
        self.prepare_s = time.perf_counter() - t0
        logger.info(
            "allocated %.1f MiB of %s memory for a rank's copies in %.2f s",
            self.prepared_bytes / 2**20,
            kind.value,
            self.prepare_s,
        )


def _holds(have: tuple[int, ...], want: tuple[int, ...]) -> bool:
    """Whether buffers of sizes ``have`` give each of ``want`` one at least as large (largest
    first, each the smallest free one that fits, as :meth:`BufferPool.take` hands them out)."""
    free = sorted(have)
    for n in sorted(want, reverse=True):
        fits = [i for i, m in enumerate(free) if m >= n]
        if not fits:
            return False
        free.pop(fits[0])
    return True


def available_bytes(kind: MemoryKind, device: torch.device) -> int:
    """Memory of this kind that is free now (GPU: the device's free memory; host: MemAvailable)."""
    if kind is MemoryKind.GPU:
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_fits(
    needed: dict[MemoryKind, int],
    device: torch.device,
    max_fraction: float,
    what: str,
    step_peak_bytes: int = 0,
) -> None:
    """Refuse, with a message naming the numbers and the fix, what would not fit.

    Args:
        needed: Bytes to allocate per kind of memory (pinned: as the allocator rounds them,
            see :func:`pinned_footprint`).
        device: The training device (for GPU memory).
        max_fraction: Largest share of the currently free memory the engine may take.
        what: Description of the allocation for the message.
        step_peak_bytes: The training step's transient GPU memory when measured beforehand
            (``ReplicationConfig.step_peak_bytes``); the larger of it and the allocator's
            record is kept free.
    """
    host_free = available_bytes(MemoryKind.HOST, device)
    budget, step_peak = None, 0
    if device.type == "cuda":
        budget, step_peak = _gpu_budget_now(device, step_peak_bytes)
    for kind, nbytes in needed.items():
        refusal = memory_verdict(
            what,
            nbytes,
            kind,
            gpu_budget=budget,
            step_peak=step_peak,
            host_free=host_free,
            max_fraction=max_fraction,
        )
        if refusal is not None:
            raise InsufficientMemoryError(refusal)


def _gpu_budget_now(device: torch.device, step_peak_bytes: int) -> tuple[int, int]:
    """:func:`gpu_budget` from the allocator's figures now (one query, no synchronisation)."""
    stats = torch.cuda.memory_stats(device)
    return gpu_budget(
        available_bytes(MemoryKind.GPU, device),
        reserved=stats.get("reserved_bytes.all.current", 0),
        allocated=stats.get("allocated_bytes.all.current", 0),
        peak=stats.get("allocated_bytes.all.peak", 0),
        declared_peak=step_peak_bytes,
    )


def recheck_after_step(
    held: int, device: torch.device, max_fraction: float, what: str, step_peak_bytes: int = 0
) -> str | None:
    """:func:`check_fits`'s GPU verdict again once a training step has run, or ``None``.

    Before the first step the allocator has not seen the step's peak; afterwards it has, and
    ``held`` bytes of snapshots and replicas are allocated already (so they count as part of
    the budget they were checked against). One query of the allocator, no synchronisation.
    """
    budget, step_peak = _gpu_budget_now(device, step_peak_bytes)
    return memory_verdict(
        what,
        held,
        MemoryKind.GPU,
        gpu_budget=budget + held,
        step_peak=step_peak,
        host_free=available_bytes(MemoryKind.HOST, device),
        max_fraction=max_fraction,
    )


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def memory_verdict(
    what: str,
    needed: int,
    kind: MemoryKind,
    *,
    gpu_budget: int | None,
    step_peak: int,
    host_free: int,
    max_fraction: float,
) -> str | None:
    """Whether ``needed`` bytes fit in ``kind``: ``None``, or the one-line refusal.

    The decision between GPU and pinned memory, with the training step's peak in view: GPU
    memory fits when ``needed`` is within ``max_fraction`` of the GPU budget (free memory and
    the allocator's cache, less the step's transient peak, see :func:`gpu_budget`); pinned and
    plain host memory when it is within ``max_fraction`` of the host's available memory. A
    refusal names the sizes and the fix: the other kind where that one fits, else fewer copies
    or more ranks.

    Args:
        what: Description of the allocation.
        needed: Bytes needed.
        kind: Where they are meant to live.
        gpu_budget: GPU bytes the snapshots may use (``None``: no GPU).
        step_peak: The training step's transient GPU peak kept out of ``gpu_budget``.
        host_free: Available host memory.
        max_fraction: Largest share of a budget the engine may take.
    """
    gpu_fits = gpu_budget is not None and needed <= max_fraction * gpu_budget
    host_fits = needed <= max_fraction * host_free
    if gpu_fits if kind is MemoryKind.GPU else host_fits:
        return None
    if kind is MemoryKind.GPU:
        free = (
            f"{_gib(gpu_budget)} is free after {_gib(step_peak)} kept for the training step's peak"
            if gpu_budget is not None
            else "0 GiB is free (the training state is not on a GPU)"
        )
    else:
        free = f"{_gib(host_free)} of host memory is available"
    line = (
        f"{what} needs {_gib(needed)} of {kind.value} memory but only {free} and "
        f"ReplicationConfig.max_memory_fraction is {max_fraction}"
    )
    if kind is MemoryKind.GPU and host_fits:
        return (
            f"{line}; use ReplicationConfig.memory='pinned' (host memory has "
            f"{_gib(host_free)} available), lower the replication factor k, or shard over more "
            "ranks"
        )
    if kind is not MemoryKind.GPU and gpu_fits:
        assert gpu_budget is not None
        return (
            f"{line}; use ReplicationConfig.memory='gpu' ({_gib(gpu_budget)} of GPU memory is "
            "free beside the training step), lower the replication factor k, or shard over "
            "more ranks"
        )
    other = (
        f"pinned host memory has {_gib(host_free)} available"
        if kind is MemoryKind.GPU
        else (
            f"GPU memory has {_gib(gpu_budget)} beside the training step's {_gib(step_peak)} peak"
            if gpu_budget is not None
            else "there is no GPU"
        )
    )
    return (
        f"{line}, and {other}: neither holds it; lower the replication factor k or shard over "
        "more ranks"
    )


def pinned_footprint(nbytes: int) -> int:
    """Pinned bytes a buffer of ``nbytes`` takes: the caching host allocator rounds each
    allocation up to a power of two."""
    return 1 << max(0, nbytes - 1).bit_length() if nbytes else 0


def gpu_budget(
    free: int, *, reserved: int, allocated: int, peak: int, declared_peak: int = 0
) -> tuple[int, int]:
    """GPU memory the snapshots may use, and the step's transient peak kept out of it.

    Memory the caching allocator holds but has not handed out is usable too; what the training
    step needed above what is allocated now (its activations, gradients, unsharded parameters:
    the peak since start-up minus the current allocation) must stay free for the next step.
    Before the first step the allocator has not seen the peak: ``declared_peak`` (measured
    beforehand, e.g. ``torch.cuda.max_memory_allocated()`` after one step of a trial run, less
    the memory allocated before it) is kept instead, the larger of the two where both exist.

    Returns:
        ``(budget_bytes, step_peak_bytes)``.
    """
    step_peak = max(0, peak - allocated, declared_peak)
    return max(0, free + max(0, reserved - allocated) - step_peak), step_peak
