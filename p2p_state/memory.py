"""Where snapshot and replica bytes live, and how much there is room for
(checksums: :mod:`p2p_state.checksum`).

Three kinds of memory: GPU memory (fastest to copy to and from the training state, uses HBM),
pinned host memory (page-locked, so GPU<->host copies are DMA at full PCIe speed), and plain
host memory (the only kind on a CPU-only build).
"""

from __future__ import annotations

import enum
import logging
import os
import threading

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

    def put(self, kind: MemoryKind, buffer: torch.Tensor) -> None:
        """Give ``buffer`` (1-D ``uint8`` of ``kind``) to the pool; its bytes are not kept."""
        with self._lock:
            self._free.append((kind, buffer))

    def take(self, nbytes: int, kind: MemoryKind, device: torch.device) -> torch.Tensor:
        """A buffer of ``nbytes`` bytes: the smallest given-back one that fits, else a new one.

        Either way its bytes are whatever they were (see :func:`allocate` without prefault).
        """
        where = torch.device(device) if kind is MemoryKind.GPU else torch.device("cpu")
        with self._lock:
            fits = [
                (b.numel(), i)
                for i, (k, b) in enumerate(self._free)
                if k is kind and b.device == where and b.numel() >= nbytes
            ]
            if fits:
                _, i = min(fits)
                self.reused_bytes += nbytes
                return self._free.pop(i)[1][:nbytes]
        return allocate(nbytes, kind, device, prefault=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._free)


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
