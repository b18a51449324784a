"""Layout, snapshot buffers, checksums and the in-place restore, in one process."""

from __future__ import annotations

import random
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.testing._internal.distributed.fake_pg  # registers the ``fake`` backend
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import p2p_state.state as state_mod
from bench.models import PRESETS, build_model, synthetic_batch
from p2p_state.config import ReplicationConfig
from p2p_state.layout import (
    ALIGN_BYTES,
    LayoutMismatchError,
    StateLayout,
    check_same_structure,
)
from p2p_state.memory import BufferPool, MemoryKind, allocate, checksum
from p2p_state.snapshot import DoubleBuffer, SnapshotHeader
from p2p_state.state import TrainingState, _dry_step, ensure_optimizer_state
from recovery.comms import _init_default


def _trained(optimizer_cls, steps=2, **opt_kwargs):
    torch.manual_seed(0)
    model = build_model("tiny")
    opt = optimizer_cls(model.parameters(), lr=0.01, **opt_kwargs)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    state = TrainingState(model, opt, sched)
    for step in range(steps):
        model.loss(synthetic_batch(PRESETS["tiny"], step=step, rank=0, batch_size=2)).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, opt, sched, state


def _snapshot(state, step=7, extras=None):
    buf = allocate(state.layout.total_bytes, MemoryKind.HOST, torch.device("cpu"))
    state.capture(buf, step, extras or {"offset": 3})
    return buf


def _live(state):
    return [t.clone() for t in state.live_tensors()]


@pytest.mark.parametrize(
    "optimizer_cls, kwargs",
    [
        (torch.optim.AdamW, {"weight_decay": 0.1}),
        (torch.optim.SGD, {"momentum": 0.9}),
        (torch.optim.Adam, {}),
        (torch.optim.RMSprop, {"momentum": 0.5}),
    ],
)
def test_restore_puts_exact_bytes_back_in_place(optimizer_cls, kwargs):
    model, _, sched, state = _trained(optimizer_cls, **kwargs)
    names = [e.name for e in state.layout.entries]
    assert any(n.startswith("optim/") for n in names), "optimizer state must be captured"
    assert "rng/cpu" in names
    torch.manual_seed(42)
    random.seed(5)
    np.random.seed(6)
    expected = _live(state)
    rng = torch.get_rng_state()
    py_rng, np_rng = random.getstate(), np.random.get_state()[1].copy()
    sched_state = sched.state_dict()
    ids = [id(p) for p in model.parameters()]
    buf = _snapshot(state)

    with torch.no_grad():
        for t in state.live_tensors():
            t.add_(1)
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    sched.step()

    step, extras = state.restore(buf)
    assert (step, extras) == (7, {"offset": 3})
    for a, b in zip(state.live_tensors(), expected):
        assert torch.equal(
            a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8) if b.dim() else b
        )
    assert torch.equal(torch.get_rng_state(), rng)
    assert random.getstate() == py_rng
    assert np.array_equal(np.random.get_state()[1], np_rng)
    assert sched.state_dict() == sched_state
    assert [id(p) for p in model.parameters()] == ids


def test_a_tensor_changed_after_set_up_is_named():
    model, _, _, state = _trained(torch.optim.AdamW)
    model.double()
    with pytest.raises(LayoutMismatchError, match=r"^param/\S+ is now torch.float64 .* set up"):
        _snapshot(state)


def test_fresh_optimizer_is_left_untouched_and_restore_builds_its_state():
    _, _, _, trained = _trained(torch.optim.AdamW)
    buf = _snapshot(trained)
    model = build_model("tiny", seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    fresh = TrainingState(model, opt, sched)
    assert not opt.state, "wrapping must not change a fresh optimizer"
    assert fresh.layout.layout_hash == trained.layout.layout_hash
    with pytest.raises(RuntimeError, match="after the first optimizer step"):
        fresh.live_tensors()
    fresh.restore(buf)
    for a, b in zip(fresh.live_tensors(), trained.live_tensors()):
        assert torch.equal(a, b)
    assert opt.param_groups[0]["lr"] == trained.optimizer.param_groups[0]["lr"]


class _KwargsAdam(torch.optim.Adam):
    """A user's optimizer that passes its settings through ``**kwargs``."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)


def _state_shape(opt, model):
    return [
        sorted(
            (k, (type(v), tuple(v.shape), v.dtype, v.device) if torch.is_tensor(v) else v)
            for k, v in opt.state[p].items()
        )
        for p in model.parameters()
    ]


@pytest.mark.parametrize(
    "make, steps",
    [
        (lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1), 0),
        (lambda ps: torch.optim.Adam(ps, lr=torch.tensor(0.01), amsgrad=True), 0),
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), 0),
        (lambda ps: torch.optim.RMSprop(ps, momentum=0.5, centered=True), 0),
        (lambda ps: torch.optim.NAdam(ps), 0),
        (lambda ps: torch.optim.Adafactor(ps), 1),  # factored state: one real (dry) step
        (lambda ps: _KwargsAdam(ps, lr=0.01, amsgrad=True), 0),
    ],
    ids=[
        "AdamW",
        "Adam-amsgrad-tensor-lr",
        "SGD-momentum",
        "RMSprop",
        "NAdam",
        "Adafactor",
        "kwargs-only",
    ],
)
def test_optimizer_state_is_created_as_a_real_step_creates_it(make, steps, monkeypatch):
    dry_steps = []
    monkeypatch.setattr(state_mod, "_dry_step", lambda *a: dry_steps.append(_dry_step(*a)))
    model, reference = build_model("tiny", seed=3), build_model("tiny", seed=3)
    params = [p.detach().clone() for p in model.parameters()]
    opt, ref_opt = make(model.parameters()), make(reference.parameters())
    ensure_optimizer_state(opt)
    _dry_step(ref_opt, list(reference.parameters()))
    assert opt.state, "the state must exist afterwards"
    assert _state_shape(opt, model) == _state_shape(ref_opt, reference)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), params))
    assert all(p.grad is None for p in model.parameters())
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    assert len(dry_steps) == steps, "only state not shaped like the parameters needs a step"


def _sharded_on_a_fake_rank(rank: int, world_size: int):
    _init_default(dist.HashStore(), "fake", rank, world_size, timedelta(seconds=30))
    model = torch.nn.Sequential(torch.nn.Linear(8, 13), torch.nn.Linear(13, 6))
    fully_shard(model)  # 13 rows over 4 ranks: 4/4/4/1
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _dtensor_layout(t):
    local = t.to_local()
    return (t.device_mesh, t.placements, t.shape, t.stride(), local.shape, local.stride(), t.dtype)


def test_sharded_optimizer_state_is_allocated_as_the_optimizer_would(leave_no_group):
    model, opt = _sharded_on_a_fake_rank(3, 4)
    ensure_optimizer_state(opt)
    ref_model, ref_opt = _sharded_on_a_fake_rank(3, 4)
    _dry_step(ref_opt, list(ref_model.parameters()))
    for p, ref_p in zip(model.parameters(), ref_model.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            mine, theirs = opt.state[p][key], ref_opt.state[ref_p][key]
            assert isinstance(mine, DTensor) and _dtensor_layout(mine) == _dtensor_layout(theirs)
            assert not mine.to_local().any()


@pytest.mark.parametrize("reshard_after_forward", [None, False])  # None: all but the root
def test_a_snapshot_after_an_evaluation_holds_the_local_shards(
    leave_no_group, reshard_after_forward
):
    # A forward under no_grad() (an evaluation in the step) leaves the modules that keep their
    # parameters after forward (the root, by default) unsharded: the state must still read
    # shards.
    _init_default(dist.HashStore(), "fake", 0, 4, timedelta(seconds=30))
    model = torch.nn.Sequential(torch.nn.Linear(8, 13), torch.nn.Linear(13, 6))
    fully_shard(model[0], reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = TrainingState(model, opt)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    before = _live(state)
    model.eval()
    with torch.no_grad():
        model(torch.randn(2, 8))
    unsharded = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    assert unsharded, "the evaluation left every parameter sharded: this test shows nothing"
    buf = _snapshot(state)
    assert all(torch.equal(a, b) for a, b in zip(_live(state), before))
    assert all(isinstance(p, DTensor) for p in model.parameters())
    restored = TrainingState(model, opt)
    restored.restore(buf)
    assert all(torch.equal(a, b) for a, b in zip(_live(restored), before))


def test_layout_is_aligned_and_round_trips():
    _, _, _, state = _trained(torch.optim.AdamW)
    layout = state.layout
    assert all(e.offset % ALIGN_BYTES == 0 for e in layout.entries)
    assert all(a.end <= b.offset for a, b in zip(layout.entries, layout.entries[1:]))
    again = StateLayout.from_bytes(layout.to_bytes())
    assert again == layout and again.layout_hash == layout.layout_hash
    with pytest.raises(ValueError, match="malformed state layout"):
        StateLayout.from_bytes(b"\x93garbage")


def test_structure_mismatch_names_both_layouts_and_the_difference():
    _, _, _, a = _trained(torch.optim.AdamW)
    model = build_model("small")
    b = TrainingState(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(LayoutMismatchError) as info:
        check_same_structure([a.layout, a.layout, b.layout])
    msg = str(info.value)
    assert a.layout.layout_hash in msg and b.layout.layout_hash in msg
    assert "rank 2" in msg
    assert "entry 'param/pos': float32[32, 64] vs float32[64, 128]" in msg


def test_blob_overflow_is_a_clear_error():
    model = build_model("tiny")
    state = TrainingState(model, None, blob_capacity=8192)
    buf = allocate(state.layout.total_bytes, MemoryKind.HOST, torch.device("cpu"))
    with pytest.raises(ValueError, match="blob_capacity_bytes"):
        state.capture(buf, 1, {"big": "x" * 10000})


def test_checksum_catches_every_single_bit_flip_position():
    buf = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    base = checksum(buf)
    for pos in range(0, 4096, 97):
        for bit in (0, 7):
            buf[pos] ^= 1 << bit
            assert checksum(buf) != base
            buf[pos] ^= 1 << bit
    assert checksum(buf) == base


def test_double_buffer_never_hands_out_the_latest_complete_slot():
    db = DoubleBuffer(1024, MemoryKind.HOST, torch.device("cpu"))
    seen = []
    for step in range(1, 6):
        slot = db.writable()
        assert slot is not db.latest()
        slot.buffer.fill_(step)
        db.publish(slot, SnapshotHeader(step, 0, "0" * 16, 1024, checksum(slot.buffer), 1))
        seen.append(db.complete_steps())
    assert seen[-1] == [4, 5]
    # Taking the next slot invalidates only the older one.
    db.writable()
    assert db.complete_steps() == [5]


CPU = torch.device("cpu")


def _publish(db: DoubleBuffer, step: int) -> None:
    slot = db.writable()
    slot.buffer.fill_(step)
    db.publish(slot, SnapshotHeader(step, 0, "0" * 16, db.nbytes, checksum(slot.buffer), 1))


def test_pool_hands_out_the_smallest_given_buffer_that_fits_and_allocates_otherwise():
    pool = BufferPool()
    big, small = torch.empty(200, dtype=torch.uint8), torch.empty(100, dtype=torch.uint8)
    pool.put(MemoryKind.HOST, big)
    pool.put(MemoryKind.HOST, small)
    pool.put(MemoryKind.PINNED, torch.empty(500, dtype=torch.uint8))  # another kind: never used
    first = pool.take(90, MemoryKind.HOST, CPU)
    assert first.numel() == 90 and first.data_ptr() == small.data_ptr()
    second = pool.take(150, MemoryKind.HOST, CPU)
    assert second.numel() == 150 and second.data_ptr() == big.data_ptr()
    fresh = pool.take(300, MemoryKind.HOST, CPU)
    assert fresh.numel() == 300 and len(pool) == 1  # only the pinned one is left
    assert pool.reused_bytes == 90 + 150


def test_double_buffer_with_a_pool_takes_each_buffer_when_its_slot_is_first_written():
    pool = BufferPool()
    given = torch.empty(1024, dtype=torch.uint8)
    pool.put(MemoryKind.HOST, given)
    db = DoubleBuffer(1024, MemoryKind.HOST, CPU, pool=pool)
    assert all(slot.buffer is None for slot in db.slots) and not db.allocated
    _publish(db, 1)
    assert db.latest().buffer.data_ptr() == given.data_ptr()
    later = torch.empty(4096, dtype=torch.uint8)  # given back after the first slot was taken
    pool.put(MemoryKind.HOST, later)
    _publish(db, 2)
    assert db.latest().buffer.data_ptr() == later.data_ptr() and db.latest().buffer.numel() == 1024
    assert db.allocated and db.complete_steps() == [1, 2]
    pool.put(MemoryKind.HOST, torch.empty(1024, dtype=torch.uint8))
    _publish(db, 3)  # both slots have buffers: the pool is not drawn from again
    assert len(pool) == 1 and db.complete_steps() == [2, 3]


def test_giving_back_keeps_the_copy_of_the_kept_step_readable():
    db = DoubleBuffer(1024, MemoryKind.HOST, CPU)
    _publish(db, 4)
    _publish(db, 5)
    pool = BufferPool()
    assert db.give_back(pool, keep={5}) == 1024
    assert db.complete_steps() == [5] and bool((db.find(5).buffer == 5).all())
    assert db.latest() is db.find(5) and len(pool) == 1
    assert db.give_back(pool) == 1024
    assert db.complete_steps() == [] and db.latest() is None and len(pool) == 2
    assert db.give_back(pool) == 0  # nothing left to give


def test_snapshot_header_round_trips_and_rejects_garbage():
    h = SnapshotHeader(12, 3, "fedcba9876543210", 4096, 0xFFFFFFFFFFFFFFFF, 2)
    assert SnapshotHeader.from_tensor(h.to_tensor()) == h
    with pytest.raises(ValueError, match="bad magic"):
        SnapshotHeader.from_tensor(torch.zeros(8, dtype=torch.int64))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"k": 0}, "k"),
        ({"interval_steps": 0}, "interval_steps"),
        ({"memory": "disk"}, "memory"),
        ({"backend": "mpi"}, "backend"),
        ({"chunk_bytes": 100}, "chunk_bytes"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"max_memory_fraction": 2}, "max_memory_fraction"),
    ],
)
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"ReplicationConfig.{field}"):
        ReplicationConfig(**kwargs)


def test_gpu_memory_without_a_gpu_is_refused_clearly():
    from p2p_state.memory import resolve_kind

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_kind("pinned", torch.device("cpu"))
