"""What an idle spare is told to allocate: a cover of every rank's buffers, checked input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from launcher.prepare import MAX_BUFFERS, SpareMemory, cover, memory_spec
from p2p_state.memory import BufferPool, MemoryKind

SIZES = st.lists(st.integers(1, 64), min_size=1, max_size=6)


@given(st.lists(SIZES, min_size=1, max_size=5), st.randoms())
def test_every_rank_takes_all_its_slots_from_a_pool_of_the_cover(reports, rnd):
    for buffers in reports:
        pool = BufferPool()
        for n in cover(reports):
            pool.put(MemoryKind.HOST, torch.empty(n, dtype=torch.uint8))
        order = list(buffers)
        rnd.shuffle(order)  # slots are first written in any order
        for n in order:
            assert pool.take(n, MemoryKind.HOST, torch.device("cpu")).numel() == n
        assert pool.fresh_bytes == 0 and pool.reused_bytes == sum(buffers)


def test_the_cover_is_no_larger_than_the_largest_rank_position_by_position():
    assert cover([[10, 10, 4, 4], [12, 12, 3, 3], [9, 9]]) == (12, 12, 4, 4)
    # A rank holding more replicas (an uneven placement) adds its extra buffers.
    assert cover([[8, 8, 8, 8], [8, 8, 8, 8, 8, 8]]) == (8, 8, 8, 8, 8, 8)


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ({"kind": "disk", "buffers": [1]}, "memory kind 'disk'"),
        ({"kind": "host", "buffers": [0]}, "buffer size 0"),
        ({"kind": "host", "buffers": ["8"]}, "buffer size '8'"),
        ({"kind": "host", "buffers": [True]}, "buffer size True"),
        ({"kind": "host", "buffers": [2**50]}, "not a byte count"),
        ({"kind": "host", "buffers": [1] * (MAX_BUFFERS + 1)}, "more than 64"),
    ],
)
def test_a_report_that_is_not_sizes_of_a_known_kind_is_refused(body, problem):
    with pytest.raises(ValueError, match=problem):
        memory_spec(body)


def test_the_spares_are_told_once_every_rank_of_the_generation_reported_and_on_change():
    memory = SpareMemory()
    ranks = ["rank/0/0", "rank/1/0"]
    memory.report("rank/0/0", 1, "host", (100, 100, 60, 60))
    assert memory.changed(ranks, 1) is None, "rank 1 has not reported"
    memory.report("rank/1/0", 0, "host", (10, 10))
    assert memory.changed(ranks, 1) is None, "rank 1's report is of another generation"
    memory.report("rank/1/0", 1, "host", (110, 110, 50, 50))
    assert memory.changed(ranks, 1) == ("host", (110, 110, 60, 60))
    memory.report("rank/1/0", 0, "host", (999,))  # late, of an older generation: ignored
    assert memory.changed(ranks, 1) is None, "nothing changed"
    # Rank 1 is lost and a spare takes its place in generation 2: its report counts, the
    # lost rank's is forgotten.
    ranks = ["rank/0/0", "spare/0/3"]
    memory.report("rank/0/0", 2, "host", (100, 100, 60, 60))
    memory.report("spare/0/3", 2, "host", (100, 100, 60, 60))
    assert memory.changed(ranks, 2) == ("host", (100, 100, 60, 60))
