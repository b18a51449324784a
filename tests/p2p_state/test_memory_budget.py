"""How much GPU memory snapshots may take, with the training step's peak kept free."""

from __future__ import annotations

from p2p_state.memory import gpu_budget


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
