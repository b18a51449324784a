"""A spare's buffers allocated while it waits (:class:`p2p_state.memory.PreparedPool`); pinned
ones in ``test_gpu.py``."""

from __future__ import annotations

import logging

import torch

from p2p_state.memory import MemoryKind, PreparedPool

CPU = torch.device("cpu")


def _sizes_in(pool) -> list[int]:
    taken = []
    while len(pool):
        taken.append(pool.take(1, MemoryKind.HOST, CPU))
    return sorted(t.untyped_storage().nbytes() for t in taken)


def test_the_buffers_are_allocated_zeroed_and_handed_out_as_slots():
    prepared = PreparedPool(CPU, max_fraction=0.8)
    prepared.prepare(MemoryKind.HOST, (4096, 4096, 1024, 1024))
    pool = prepared.take(timeout_s=60)
    assert pool is not None and pool.free_bytes == 2 * 4096 + 2 * 1024
    slot = pool.take(4000, MemoryKind.HOST, CPU)  # the smallest that fits
    assert slot.numel() == 4000 and not slot.any(), "prefaulted: every page touched (zeroed)"
    assert pool.reused_bytes == 4000 and pool.fresh_bytes == 0
    assert prepared.prepared_bytes == 10240 and prepared.prepare_s > 0


def test_sizes_already_held_are_not_allocated_again_and_larger_ones_are():
    prepared = PreparedPool(CPU, max_fraction=0.8)
    prepared.prepare(MemoryKind.HOST, (4096, 4096))
    prepared.prepare(MemoryKind.HOST, (4000, 4000))  # held already: kept as they are
    assert _sizes_in(prepared.take(timeout_s=60)) == [4096, 4096]
    prepared = PreparedPool(CPU, max_fraction=0.8)
    prepared.prepare(MemoryKind.HOST, (4096, 4096))
    prepared.prepare(MemoryKind.HOST, (8192, 4096))  # one is larger: allocated anew
    assert _sizes_in(prepared.take(timeout_s=60)) == [4096, 8192]


def test_what_would_not_fit_is_not_allocated_and_says_so(caplog):
    prepared = PreparedPool(CPU, max_fraction=0.8)
    with caplog.at_level(logging.WARNING, logger="p2p_state.memory"):
        prepared.prepare(MemoryKind.HOST, (2**44,))
        pool = prepared.take(timeout_s=60)
    assert pool is not None and pool.free_bytes == 0
    (line,) = [r.getMessage() for r in caplog.records]
    assert "were not allocated ahead" in line and "16384.00 GiB of host memory" in line


def test_once_taken_or_closed_nothing_more_is_allocated():
    prepared = PreparedPool(CPU, max_fraction=0.8)
    assert prepared.take(timeout_s=1) is None, "nothing was asked for"
    prepared.prepare(MemoryKind.HOST, (4096,))  # the spare holds a rank: its slots are its own
    assert prepared.take(timeout_s=1) is None
    closed = PreparedPool(CPU, max_fraction=0.8)
    closed.prepare(MemoryKind.HOST, (4096,))
    closed.close()
    closed.prepare(MemoryKind.HOST, (4096,))
    assert closed.take(timeout_s=1) is None


def test_a_restore_borrows_a_prepared_buffer_and_gives_it_back_whole_for_a_slot():
    prepared = PreparedPool(CPU, max_fraction=0.8)
    prepared.prepare(MemoryKind.HOST, (8192, 4096))
    pool = prepared.take(timeout_s=60)
    assert pool is not None
    with pool.borrowed(4000, MemoryKind.HOST, CPU) as target:
        assert target.numel() == 4000 and pool.free_bytes == 8192  # the smallest that fits
        target.fill_(7)
    assert pool.lent_bytes == 4000 and pool.reused_bytes == pool.fresh_bytes == 0
    assert pool.free_bytes == 8192 + 4096, "given back whole, not as the 4000 bytes lent"
    slot = pool.take(4096, MemoryKind.HOST, CPU)  # a slot takes it next
    assert slot.numel() == 4096 and pool.reused_bytes == 4096
    with pool.borrowed(10_000, MemoryKind.HOST, CPU) as bigger:  # none fits: a new one
        assert bigger.numel() == 10_000
    assert pool.lent_bytes == 4000 and pool.free_bytes == 8192 + 10_000
    assert pool.fresh_bytes == 10_000
