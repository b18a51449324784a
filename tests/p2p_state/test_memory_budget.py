"""How much GPU memory snapshots may take, with the training step's peak kept free."""

from __future__ import annotations

from p2p_state.memory import MemoryKind, gpu_budget, memory_verdict, pinned_footprint


def test_the_gpu_budget_keeps_the_training_step_s_peak_free() -> None:
    gib = 2**30
    # 10 GiB free on the device, 4 GiB cached by the allocator of which 3 GiB handed out, and a
    # step that peaked 5 GiB above today's allocation: 10 + 1 - 5 = 6 GiB for snapshots.
    assert gpu_budget(10 * gib, reserved=4 * gib, allocated=3 * gib, peak=8 * gib) == (
        6 * gib,
        5 * gib,
    )
    assert gpu_budget(gib, reserved=0, allocated=0, peak=4 * gib) == (0, 4 * gib)
    assert gpu_budget(gib, reserved=gib, allocated=gib, peak=gib) == (gib, 0)  # before a step


def test_a_declared_step_peak_is_kept_before_the_allocator_has_seen_one() -> None:
    gib = 2**30
    assert gpu_budget(10 * gib, reserved=0, allocated=0, peak=0, declared_peak=3 * gib) == (
        7 * gib,
        3 * gib,
    )
    # After a step the larger of the two is kept.
    assert gpu_budget(10 * gib, reserved=0, allocated=0, peak=5 * gib, declared_peak=3 * gib)[
        1
    ] == (5 * gib)


def _verdict(kind: MemoryKind, needed_gib: float, **kw) -> str | None:
    gib = 2**30
    args = {"gpu_budget": 10 * gib, "step_peak": 30 * gib, "host_free": 100 * gib}
    args.update({k: int(v * gib) if v is not None else None for k, v in kw.items()})
    return memory_verdict(
        "rank 0's snapshots", int(needed_gib * gib), kind, max_fraction=0.8, **args
    )


def test_gpu_memory_is_decided_with_the_step_peak_and_refused_with_pinned_as_the_fix() -> None:
    assert _verdict(MemoryKind.GPU, 8) is None  # 8 <= 0.8 x 10 beside the 30 GiB peak
    refusal = _verdict(MemoryKind.GPU, 9)
    assert refusal == (
        "rank 0's snapshots needs 9.00 GiB of gpu memory but only 10.00 GiB is free after "
        "30.00 GiB kept for the training step's peak and ReplicationConfig.max_memory_fraction "
        "is 0.8; use ReplicationConfig.memory='pinned' (host memory has 100.00 GiB available), "
        "lower the replication factor k, or shard over more ranks"
    )


def test_pinned_memory_that_does_not_fit_names_gpu_memory_when_it_would() -> None:
    assert _verdict(MemoryKind.PINNED, 6, host_free=8) is None  # 6 <= 0.8 x 8
    refusal = _verdict(MemoryKind.PINNED, 7, host_free=4)
    assert refusal is not None
    assert "needs 7.00 GiB of pinned memory but only 4.00 GiB of host memory is available" in (
        refusal
    )
    assert "use ReplicationConfig.memory='gpu' (10.00 GiB of GPU memory is free beside" in (refusal)


def test_when_neither_fits_the_refusal_names_both_sizes_in_one_line() -> None:
    refusal = _verdict(MemoryKind.GPU, 90, host_free=50)
    assert refusal is not None and "\n" not in refusal
    assert refusal.startswith("rank 0's snapshots needs 90.00 GiB of gpu memory but only 10.00")
    assert "and pinned host memory has 50.00 GiB available: neither holds it" in refusal
    assert refusal.endswith("lower the replication factor k or shard over more ranks")
    host = _verdict(MemoryKind.HOST, 90, host_free=50, gpu_budget=None)
    assert host is not None and "and there is no GPU: neither holds it" in host


def test_pinned_buffers_are_counted_at_the_host_allocator_s_size() -> None:
    assert [pinned_footprint(n) for n in (0, 1, 4096, 4097, 3 * 2**30)] == [
        0,
        1,
        4096,
        8192,
        4 * 2**30,
    ]


def test_gpu_memory_for_a_state_not_on_a_gpu_is_refused_in_one_line() -> None:
    refusal = _verdict(MemoryKind.GPU, 1, gpu_budget=None)
    assert refusal is not None and "the training state is not on a GPU" in refusal
