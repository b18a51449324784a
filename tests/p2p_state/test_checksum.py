"""The snapshot checksum: XXH64 per block, combined, bit-exact wherever it is computed.

The host implementation (the ``xxhash`` C library) is checked against XXH64's published
vectors and against a pure-Python reference of XXH64 and of the block/combine scheme; the
torch-ops implementation used on GPUs without cupy is checked against the host one here, on
the CPU (the cupy kernel itself runs only where CUDA is, in ``test_gpu.py``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from p2p_state.checksum import BLOCK_BYTES, Checksum, _block_digests_torch, checksum

M = (1 << 64) - 1
P1, P2, P3, P4, P5 = (
    0x9E3779B185EBCA87,
    0xC2B2AE3D27D4EB4F,
    0x165667B19E3779F9,
    0x85EBCA77C2B2AE63,
    0x27D4EB2F165667C5,
)


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & M


def _round(acc: int, lane: int) -> int:
    return _rotl((acc + lane * P2) & M, 31) * P1 & M


def xxh64_reference(data: bytes, seed: int = 0) -> int:
    """XXH64 as its specification states it, one byte string at a time."""
    n, i = len(data), 0
    if n >= 32:
        v = [(seed + P1 + P2) & M, (seed + P2) & M, seed, (seed - P1) & M]
        while i + 32 <= n:
            v = [
                _round(v[j], int.from_bytes(data[i + 8 * j : i + 8 * j + 8], "little"))
                for j in range(4)
            ]
            i += 32
        h = (_rotl(v[0], 1) + _rotl(v[1], 7) + _rotl(v[2], 12) + _rotl(v[3], 18)) & M
        for vj in v:
            h = ((h ^ _round(0, vj)) * P1 + P4) & M
    else:
        h = (seed + P5) & M
    h = (h + n) & M
    while i + 8 <= n:
        h ^= _round(0, int.from_bytes(data[i : i + 8], "little"))
        h = (_rotl(h, 27) * P1 + P4) & M
        i += 8
    if i + 4 <= n:
        h ^= int.from_bytes(data[i : i + 4], "little") * P1 & M
        h = (_rotl(h, 23) * P2 + P3) & M
        i += 4
    while i < n:
        h ^= data[i] * P5 & M
        h = _rotl(h, 11) * P1 & M
        i += 1
    h ^= h >> 33
    h = h * P2 & M
    h ^= h >> 29
    h = h * P3 & M
    return h ^ (h >> 32)


def checksum_reference(data: bytes) -> int:
    """The block/combine scheme of :mod:`p2p_state.checksum`, in plain Python."""
    digests = [xxh64_reference(data[i : i + BLOCK_BYTES]) for i in range(0, len(data), BLOCK_BYTES)]
    words = b"".join(d.to_bytes(8, "little") for d in digests)
    return xxh64_reference(words, seed=len(data))


@pytest.mark.parametrize(
    ("data", "expected"),
    [  # XXH64 (seed 0) known answers from the xxHash test suite
        (b"", 0xEF46DB3751D8E999),
        (b"a", 0xD24EC4F1A98C6E5B),
        (b"abc", 0x44BC2CF5AD770999),
    ],
)
def test_xxh64_reference_and_library_give_the_published_values(data, expected) -> None:
    import xxhash

    assert xxh64_reference(data) == expected
    assert xxhash.xxh64_intdigest(data) == expected


@pytest.mark.parametrize("nbytes", [0, 5, 4096, BLOCK_BYTES, 2 * BLOCK_BYTES + 4099])
def test_host_checksum_is_the_reference_scheme(nbytes: int) -> None:
    gen = torch.Generator().manual_seed(nbytes)
    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    expected = checksum_reference(buf.numpy().tobytes())
    assert checksum(buf) == expected
    # Fed in chunks that do not line up with the blocks, the value is the same.
    c = Checksum()
    for off in range(0, nbytes, 40_000):
        c.update(buf[off : off + 40_000], off)
    assert c.value() == expected


def test_torch_block_digests_are_the_host_s_bit_for_bit() -> None:
    # The GPU fallback (no cupy) runs the same ops on CUDA; on the CPU it must already agree.
    buf = torch.randint(
        0, 256, (3 * BLOCK_BYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
    )
    digests = _block_digests_torch(buf).numpy().view(np.uint64)
    data = buf.numpy().tobytes()
    expected = [
        xxh64_reference(data[i : i + BLOCK_BYTES]) for i in range(0, len(data), BLOCK_BYTES)
    ]
    assert digests.tolist() == expected


def test_what_the_old_gpu_sum_missed_is_caught() -> None:
    # Two sign-bit flips two words apart, and two words 65,536 apart swapped with values 2^16
    # apart, left the position-weighted 32-bit sum unchanged.
    buf = torch.zeros(8 * BLOCK_BYTES, dtype=torch.uint8)
    base = checksum(buf)
    flipped = buf.clone()
    flipped.view(torch.int32)[[10, 12]] ^= torch.tensor(-(2**31), dtype=torch.int32)
    assert checksum(flipped) != base
    words = buf.clone().view(torch.int32)
    words[100], words[100 + 65_536] = 1 << 16, 0
    swapped = buf.clone().view(torch.int32)
    swapped[100], swapped[100 + 65_536] = 0, 1 << 16
    assert checksum(words.view(torch.uint8)) != checksum(swapped.view(torch.uint8))
    # Swapping two whole blocks changes it too (the combine keeps their order).
    a = torch.randint(
        0, 256, (2 * BLOCK_BYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2)
    )
    b = torch.cat([a[BLOCK_BYTES:], a[:BLOCK_BYTES]])
    assert checksum(a) != checksum(b)
