"""One 64-bit checksum for every copy of a snapshot, computed where the copy lives.

The hash (``XXH64_BLOCKS``) splits the bytes into blocks of :data:`BLOCK_BYTES` and takes the
standard XXH64 (seed 0) of each block; the checksum is the XXH64 of the blocks' digests (64-bit
little-endian words, in order) seeded with the total length. Blocks are independent, so a GPU
hashes all of them at once, one thread per block, in one pass over the bytes with no
temporaries (:data:`_KERNEL_SOURCE`, a ``cupy.RawKernel``); the host hashes them with the
``xxhash`` C library. Both compute the same function, so any holder of a copy (GPU, pinned or
plain host memory) can verify any other copy.

A partial last block is always hashed on the host (at most :data:`BLOCK_BYTES` cross PCIe). Where
cupy is missing on a CUDA machine the full blocks are hashed with torch integer ops instead
(:func:`_block_digests_torch`, the same function, slower and with temporaries), said once in
the log.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import xxhash

if TYPE_CHECKING:
    from cupy import RawKernel  # untyped, and optional at run time

logger = logging.getLogger(__name__)

#: Checksum algorithm id carried in every snapshot header (1 and 2 were CRC-32 and a GPU sum).
XXH64_BLOCKS = 3
#: Bytes per independently hashed block: 64 KiB gives a 16 GiB snapshot 262,144 GPU threads,
#: each reading whole 32-byte sectors (one XXH64 stripe per load), and 2 MiB of digests.
BLOCK_BYTES = 1 << 16

_MASK64 = (1 << 64) - 1
_P1 = 0x9E3779B185EBCA87
_P2 = 0xC2B2AE3D27D4EB4F
_P3 = 0x165667B19E3779F9
_P4 = 0x85EBCA77C2B2AE63

_KERNEL_SOURCE = r"""
typedef unsigned long long u64;
#define P1 0x9E3779B185EBCA87ULL
#define P2 0xC2B2AE3D27D4EB4FULL
#define P3 0x165667B19E3779F9ULL
#define P4 0x85EBCA77C2B2AE63ULL
__device__ __forceinline__ u64 rotl(u64 x, int r) { return (x << r) | (x >> (64 - r)); }
__device__ __forceinline__ u64 round1(u64 acc, u64 in) { return rotl(acc + in * P2, 31) * P1; }
__device__ __forceinline__ u64 merge(u64 h, u64 v) { return (h ^ round1(0, v)) * P1 + P4; }

// XXH64 (seed 0) of each full block of block_bytes; one thread per block, one pass.
extern "C" __global__ void xxh64_blocks(const ulonglong4* data, u64* out, long long num_blocks,
                                        long long block_bytes) {
    long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= num_blocks) return;
    const long long stripes = block_bytes / 32;
    const ulonglong4* p = data + b * stripes;
    u64 v1 = P1 + P2, v2 = P2, v3 = 0, v4 = 0 - P1;
    for (long long i = 0; i < stripes; ++i) {
        ulonglong4 s = p[i];
        v1 = round1(v1, s.x); v2 = round1(v2, s.y); v3 = round1(v3, s.z); v4 = round1(v4, s.w);
    }
    u64 h = rotl(v1, 1) + rotl(v2, 7) + rotl(v3, 12) + rotl(v4, 18);
    h = merge(h, v1); h = merge(h, v2); h = merge(h, v3); h = merge(h, v4);
    h += (u64)block_bytes;
    h ^= h >> 33; h *= P2; h ^= h >> 29; h *= P3; h ^= h >> 32;
    out[b] = h;
}
"""

_kernel: RawKernel | None = None
_told_no_cupy = False


def _cupy_kernel() -> RawKernel | None:
    """The compiled kernel, or ``None`` (said once) where cupy is missing."""
    global _kernel, _told_no_cupy
    if _kernel is None:
        try:
            import cupy
        except ImportError:
            if not _told_no_cupy:
                _told_no_cupy = True
                logger.warning(
                    "cupy is not installed: GPU checksums use torch ops (same hash, slower, "
                    "with temporaries); `pip install cupy-cuda12x` for the one-pass kernel"
                )
            return None
        _kernel = cupy.RawKernel(_KERNEL_SOURCE, "xxh64_blocks")
    return _kernel


def _block_digests_host(data: np.ndarray) -> np.ndarray:
    """XXH64 of each block of host bytes ``data`` (the last one may be partial)."""
    view = data.data  # the array's own memoryview
    return np.fromiter(
        (
            xxhash.xxh64_intdigest(view[i : i + BLOCK_BYTES])
            for i in range(0, len(view), BLOCK_BYTES)
        ),
        dtype=np.uint64,
    )


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def _lsr(x: torch.Tensor, r: int) -> torch.Tensor:
    """Logical right shift of int64 lanes (torch's ``>>`` is arithmetic)."""
    return (x >> r) & ((1 << (64 - r)) - 1)


def _rotl(x: torch.Tensor, r: int) -> torch.Tensor:
    return (x << r) | _lsr(x, 64 - r)


def _round(acc: torch.Tensor, lane: torch.Tensor) -> torch.Tensor:
    return _rotl(acc + lane * _signed(_P2), 31) * _signed(_P1)


def _block_digests_torch(full: torch.Tensor) -> torch.Tensor:
    """XXH64 of each full block of the 1-D ``uint8`` tensor ``full``, with int64 torch ops.

    Wrapping int64 arithmetic is the same as XXH64's unsigned 64-bit arithmetic bit for bit;
    only right shifts need masking. Returns int64 digests (bit patterns of the unsigned ones).
    """
    num_blocks = full.numel() // BLOCK_BYTES
    lanes = full.view(torch.int64).view(num_blocks, BLOCK_BYTES // 32, 4)
    v = [
        torch.full((num_blocks,), _signed(s), dtype=torch.int64, device=full.device)
        for s in ((_P1 + _P2) & _MASK64, _P2, 0, (-_P1) & _MASK64)
    ]
    for i in range(lanes.shape[1]):
        stripe = lanes[:, i]
        v = [_round(v[j], stripe[:, j]) for j in range(4)]
    h = _rotl(v[0], 1) + _rotl(v[1], 7) + _rotl(v[2], 12) + _rotl(v[3], 18)
    for vj in v:
        h = (h ^ _round(torch.zeros_like(vj), vj)) * _signed(_P1) + _signed(_P4)
    h = h + BLOCK_BYTES
    h = h ^ _lsr(h, 33)
    h = h * _signed(_P2)
    h = h ^ _lsr(h, 29)
    h = h * _signed(_P3)
    return h ^ _lsr(h, 32)


def _block_digests_gpu(full: torch.Tensor) -> torch.Tensor:
    """XXH64 of each full block of device bytes ``full``, enqueued on the current stream."""
    num_blocks = full.numel() // BLOCK_BYTES
    kernel = _cupy_kernel()
    if kernel is None:
        return _block_digests_torch(full)
    assert full.data_ptr() % 32 == 0, "blocks are read as 32-byte stripes"
    out = torch.empty(num_blocks, dtype=torch.int64, device=full.device)
    threads = 128
    with _cupy_stream(torch.cuda.current_stream(full.device)):
        kernel(
            ((num_blocks + threads - 1) // threads,),
            (threads,),
            (full.data_ptr(), out.data_ptr(), np.int64(num_blocks), np.int64(BLOCK_BYTES)),
        )
    return out


def _cupy_stream(stream: torch.cuda.Stream) -> Any:
    """``stream`` as a cupy stream, for launching on it (cupy 14 deprecates ``ExternalStream``
    for ``Stream.from_external``, which takes streams that speak the CUDA stream protocol)."""
    import cupy

    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None and hasattr(stream, "__cuda_stream__"):
        return from_external(stream)
    return cupy.cuda.ExternalStream(stream.cuda_stream)


def combine(digests: np.ndarray, nbytes: int) -> int:
    """The checksum of ``nbytes`` bytes whose blocks have the XXH64 ``digests`` (in order)."""
    words = np.ascontiguousarray(digests, dtype="<u8")
    return xxhash.xxh64_intdigest(words.data.cast("B"), seed=nbytes & _MASK64)


class Checksum:
    """Incremental :data:`XXH64_BLOCKS` checksum of a 1-D ``uint8`` buffer fed in order.

    Computed where the bytes live: on the host with the ``xxhash`` C library, on a GPU with the
    block kernel (only the digests and a partial last block cross PCIe). Chunks may have any
    size on the host; on a GPU every chunk but the last must be a whole number of blocks.
    """

    algo = XXH64_BLOCKS

    def __init__(self, on_gpu: bool = False) -> None:
        self._on_gpu = on_gpu
        self._parts: list[np.ndarray | torch.Tensor] = []
        self._pending = np.empty(0, dtype=np.uint8)  # host bytes of an unfinished block
        self._next = 0

    def update(self, chunk: torch.Tensor, offset: int) -> None:
        """Add bytes ``[offset, offset + len(chunk))``; chunks must come in order, no gaps."""
        assert chunk.dtype == torch.uint8 and chunk.dim() == 1
        assert offset == self._next, "checksum chunks must be fed in order"
        self._next += chunk.numel()
        if chunk.is_cuda:
            assert self._pending.size == 0, "only the last GPU chunk may end inside a block"
            num_full = chunk.numel() // BLOCK_BYTES * BLOCK_BYTES
            if num_full:
                self._parts.append(_block_digests_gpu(chunk[:num_full]))
            self._pending = chunk[num_full:].cpu().numpy()
            return
        data = chunk.numpy()
        if self._pending.size:
            need = BLOCK_BYTES - self._pending.size
            self._pending = np.concatenate([self._pending, data[:need]])
            data = data[need:]
            if self._pending.size < BLOCK_BYTES:
                return
            self._parts.append(_block_digests_host(self._pending))
            self._pending = np.empty(0, dtype=np.uint8)
        num_full = data.size // BLOCK_BYTES * BLOCK_BYTES
        if num_full:
            self._parts.append(_block_digests_host(data[:num_full]))
        self._pending = data[num_full:].copy()

    def value(self) -> int:
        """The checksum of everything fed so far (waits for the GPU's digests, if any)."""
        parts = [
            p.cpu().numpy().view(np.uint64) if isinstance(p, torch.Tensor) else p
            for p in self._parts
        ]
        if self._pending.size:
            parts.append(_block_digests_host(self._pending))
        digests = np.concatenate(parts) if parts else np.empty(0, dtype=np.uint64)
        return combine(digests, self._next)


def checksum(buf: torch.Tensor) -> int:
    """Checksum of a whole 1-D ``uint8`` buffer, wherever it lives (see :class:`Checksum`)."""
    c = Checksum(buf.is_cuda)
    c.update(buf, 0)
    return c.value()
