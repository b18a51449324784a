"""The restore planner, executed on plain byte arrays: replace, shrink and grow rebuild exactly."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_state.layout import StateLayout
from recovery.planner import plan_restore, shard_layout

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8]


def fsdp_layouts(specs, world: int) -> list[StateLayout]:
    """Layouts of every rank, computed here independently of the planner (torch.chunk rule)."""
    out = []
    for rank in range(world):
        rank_specs = []
        for name, dtype, gshape, sharded in specs:
            if sharded:
                chunk = -(-gshape[0] // world)
                start = min(rank * chunk, gshape[0])
                end = min(start + chunk, gshape[0])
                rank_specs.append((name, dtype, (end - start, *gshape[1:]), gshape, start))
            else:
                rank_specs.append((name, dtype, gshape, gshape, 0))
        out.append(StateLayout.build(rank_specs, blob_capacity=512))
    return out


def _bytes(tag: str, n: int) -> np.ndarray:
    seed = int.from_bytes(hashlib.sha256(tag.encode()).digest()[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def fill(layouts, specs) -> list[np.ndarray]:
    """Old buffers: sharded rows encode (entry, global row); per-rank data encodes the rank."""
    bufs = []
    for rank, layout in enumerate(layouts):
        buf = np.zeros(layout.total_bytes, dtype=np.uint8)
        for name, _, _, sharded in specs:
            e = layout.entry(name)
            if sharded:
                rows = e.shape[0]
                row = e.nbytes // rows if rows else 0
                for r in range(rows):
                    g = e.dim0_offset + r
                    buf[e.offset + r * row : e.offset + (r + 1) * row] = _bytes(f"{name}/{g}", row)
            else:
                buf[e.offset : e.end] = _bytes(f"{name}@{rank}", e.nbytes)
        buf[layout.blob_offset : layout.blob_offset + 512] = _bytes(f"blob@{rank}", 512)
        bufs.append(buf)
    return bufs


def run_plan(plan, old_bufs, new_layouts, holders):
    new = [np.zeros(layout.total_bytes, dtype=np.uint8) for layout in new_layouts]
    for t in plan.transfers:
        assert t.src in holders[t.owner], "a rank may only serve copies it holds"
        new[t.dst][t.dst_start : t.dst_start + t.nbytes] = old_bufs[t.owner][
            t.src_start : t.src_end
        ]
    return new


@st.composite
def models(draw):
    n = draw(st.integers(1, 6))
    specs = []
    for i in range(n):
        inner = tuple(draw(st.lists(st.integers(1, 5), max_size=2)))
        rows = draw(st.integers(1, 17))
        specs.append((f"param/w{i}", draw(st.sampled_from(DTYPES)), (rows, *inner), True))
    specs.append(("optim/step", torch.float32, (), False))
    specs.append(("rng/cpu", torch.uint8, (40,), False))
    return specs


@settings(max_examples=120, deadline=None)
@given(models(), st.integers(1, 6), st.integers(1, 6), st.data())
def test_any_resize_rebuilds_every_new_buffer_exactly(specs, old_world, new_world, data):
    old = fsdp_layouts(specs, old_world)
    new = fsdp_layouts(specs, new_world)
    inherits = [data.draw(st.integers(0, old_world - 1)) for _ in range(new_world)]
    # Each old buffer survives on one or two of the new ranks.
    holders = {
        o: sorted(set(data.draw(st.lists(st.integers(0, new_world - 1), min_size=1, max_size=2))))
        for o in range(old_world)
    }
    plan = plan_restore(old, new, holders, inherits, step=5)
    assert not plan.needs_fallback
    got = run_plan(plan, fill(old, specs), new, holders)
    want = fill(new, specs)
    for dst, layout in enumerate(new):
        for name, _, _, sharded in specs:
            e = layout.entry(name)
            if sharded:
                assert np.array_equal(got[dst][e.offset : e.end], want[dst][e.offset : e.end])
            else:
                src = old[inherits[dst]].entry(name)
                assert np.array_equal(
                    got[dst][e.offset : e.end],
                    fill(old, specs)[inherits[dst]][src.offset : src.end],
                )


def test_shard_layout_matches_fsdp_chunking():
    specs = [("param/a", torch.float32, (10, 3), True), ("rng/cpu", torch.uint8, (8,), False)]
    for world in (1, 3, 4, 7):
        ref = fsdp_layouts(specs, world)
        template = fsdp_layouts(specs, 2)[0]
        assert [shard_layout(template, world, r) for r in range(world)] == ref


def test_replace_moves_only_the_lost_ranks_bytes_spread_over_its_holders():
    specs = [
        ("param/big", torch.float32, (4096, 1024), True),
        ("rng/cpu", torch.uint8, (64,), False),
    ]
    layouts = fsdp_layouts(specs, 4)
    lost = 1
    # Survivors hold their own snapshots; rank 1's copies live on ranks 2 and 3 (k=2); the spare
    # that takes rank 1's place is new rank 1 and holds nothing yet.
    holders = {0: [0], 1: [2, 3], 2: [2], 3: [3]}
    plan = plan_restore(layouts, layouts, holders, [0, 1, 2, 3], step=9, split_bytes=2**20)
    network = [t for t in plan.transfers if t.src != t.dst]
    assert {t.dst for t in network} == {lost}
    sent = plan.bytes_by_src()
    assert set(sent) == {2, 3} and abs(sent[2] - sent[3]) <= sent[2] // 10
    assert (
        sum(sent.values())
        == layouts[lost].tensor_bytes + layouts[lost].blob_capacity - sum(0 for _ in ())
        or sum(sent.values()) >= layouts[lost].entry("param/big").nbytes
    )
    got = run_plan(plan, fill(layouts, specs), layouts, holders)
    want = fill(layouts, specs)
    assert all(np.array_equal(g, w) for g, w in zip(got, want))


def test_a_shard_with_no_surviving_copy_is_reported_for_fallback():
    specs = [("param/a", torch.float32, (8, 2), True)]
    layouts = fsdp_layouts(specs, 4)
    holders = {0: [0], 1: [], 2: [2], 3: [3]}  # rank 1 and its only buddy lost together
    plan = plan_restore(layouts, layouts, holders, [0, 1, 2, 3], step=3)
    assert plan.needs_fallback
    assert {m.owner for m in plan.missing} == {1}


def test_different_models_are_refused():
    a = fsdp_layouts([("param/a", torch.float32, (8, 2), True)], 2)
    b = fsdp_layouts([("param/a", torch.float32, (8, 3), True)], 2)
    with pytest.raises(ValueError, match="different models"):
        plan_restore(a, b, {0: [0], 1: [1]}, [0, 1], step=1)


def test_the_no_copy_message_names_only_shards_lost_with_every_replica():
    from recovery.restore import describe_gap

    # 4 ranks, k=1, holders r -> r+1: ranks 1 and 2 died (their places hold nothing now).
    # Step 4 was complete; step 5 was in flight, so only rank 0's own copy of it exists.
    held = [
        {(4, 0, 4, True), (4, 3, 4, False), (4, 0, 5, True)},
        set(),
        set(),
        {(4, 3, 4, True), (4, 2, 4, False)},
    ]
    message = describe_gap(_copies(held))
    assert "shards of ranks [1] of the 4-rank world were lost" in message
    assert "members [1, 2] hold no copy" in message
    assert "[1, 2, 3]" not in message
    # No shard gone at every step: the gap of each step is named instead.
    split = [{(4, 0, 3, True), (4, 0, 4, True)}, {(4, 1, 3, True)}, {(4, 2, 4, True)}, set()]
    split[3] = {(4, 3, 3, True), (4, 3, 4, True)}
    message = describe_gap(_copies(split))
    assert "step 3 lacks ranks [2]; step 4 lacks ranks [1]" in message
    assert "lost together" not in message and "hold no copy" not in message


def test_the_census_line_names_every_members_copies_by_owner_and_step():
    from recovery.restore import describe_census

    held = [{(4, 0, 4, True), (4, 0, 5, True), (4, 3, 4, False)}, set()]
    assert (
        describe_census(_copies(held)) == "member 0: W=4 own 0@{4,5}, W=4 3@{4}; member 1: nothing"
    )


def _copies(held):
    from p2p_state.snapshot import Copy

    return [{Copy(*c) for c in h} for h in held]
