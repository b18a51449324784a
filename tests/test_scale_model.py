"""The scale model's formulas: units, monotonicity, copy loss and the sensitivity analysis."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench import scale_goodput as gp
from bench import scale_model as sm
from bench.scale_model import Input, Job
from recovery.gloo_pairs import LAZY_FROM_RANKS


def _inputs(**over: float) -> sm.Inputs:
    hw = sm.load("hardware")["h100-ib400"]
    inp = sm.job_inputs(
        params=70.6e9, tokens_per_step=4194304, model_source="test preset", hardware=hw
    )
    for name, v in (("exit_detect_s", 0.05), ("generation_s", 0.1), ("hang_detect_s", 3.3)):
        inp[name] = Input(v, "s", "measured", "test", v / 2, v * 2)
    for name, v in over.items():
        inp = sm.with_value(inp, name, v)
    return inp


def test_units_of_state_step_and_load():
    inp = _inputs()
    assert sm.state_bytes_per_gpu(inp, 2048) == pytest.approx(70.6e9 * 12 / 2048)
    assert sm.state_bytes_per_gpu(inp, 2048, shard_degree=256) == pytest.approx(70.6e9 * 12 / 256)
    # 6 * N * tokens / (gpus * peak * MFU): 70.6e9 params, 4M tokens, 2,048 H100s at 40 %.
    expected = 6 * 70.6e9 * 4194304 / (2048 * 989e12 * 0.40)
    assert sm.step_time_s(inp, 2048) == pytest.approx(expected)
    assert 1.0 < expected < 5.0
    # 847 GB over 2 TB/s.
    assert sm.checkpoint_load_s(inp, Job()) == pytest.approx(70.6e9 * 12 / 2000e9)
    s3 = sm.checkpoint_load_s(inp, Job(storage="s3"))
    assert s3 == pytest.approx(70.6e9 * 12 / (256 * 12.5e9))


def test_transfer_is_bytes_over_bandwidth_and_host_copies_are_pcie_bound():
    inp = _inputs(ib_gbps=50, pcie_gbps=20)
    s = sm.state_bytes_per_gpu(inp, 2048)
    gpu = sm.recovery_phases(inp, Job())
    host = sm.recovery_phases(inp, Job(replica_memory="host"))
    assert gpu["transfer"] == pytest.approx(s / 50e9)
    assert host["transfer"] == pytest.approx(s / 20e9)
    assert list(gpu) == list(sm.RECOVERY_PHASES)


def test_a_node_fault_waits_for_the_heartbeat_timeout():
    inp = _inputs()
    assert sm.recovery_phases(inp, Job(), node_fault=True)["detect"] == 3.3
    assert sm.recovery_phases(inp, Job())["detect"] == 0.05


def test_gloo_groups_cost_the_store_a_request_per_128_members_each():
    inp = _inputs()
    without = sm.recovery_phases(inp, Job(gpus=2048, lazy_gloo=False))["communicators"]
    inp.update(sm.rendezvous_inputs(sm.load("measured"), 2048))
    inp = sm.with_value(sm.with_value(inp, "store_request_s", 1e-4), "gloo_groups", 3)
    # 2,048 members each write one address and read 2,048 in 16 requests, three groups.
    assert sm.gloo_rendezvous_s(inp, 2048) == pytest.approx(3 * 2048 * 17 * 1e-4)
    added = sm.recovery_phases(inp, Job(gpus=2048, lazy_gloo=False))["communicators"] - without
    assert added == pytest.approx(3 * 2048 * 17 * 1e-4)
    grown = sm.resize_phases(inp, Job(gpus=2048, lazy_gloo=False), 2056)["communicators"]
    assert grown - sm.gloo_rendezvous_s(inp, 2056) == pytest.approx(without, rel=0.01)
    # Quadratic in ranks: eight times the ranks, about 64 times the store's work.
    assert sm.gloo_rendezvous_s(inp, 16384) / sm.gloo_rendezvous_s(inp, 2048) > 60


def test_with_lazy_gloo_a_member_reads_the_two_addresses_of_its_ring_pairs():
    inp = _inputs()
    inp.update(sm.rendezvous_inputs(sm.load("measured"), 2048))
    inp = sm.with_value(sm.with_value(inp, "lazy_request_s", 5e-5), "gloo_groups", 3)
    inp = sm.with_value(inp, "gloo_hop_s", 2e-5)
    # One write and a wait and a get for each of two neighbours, three groups, then one ring
    # all-gather of every member's addresses: linear in ranks.
    expected = 3 * 2048 * 5 * 5e-5 + 2047 * 2e-5
    assert sm.gloo_rendezvous_s(inp, 2048, lazy=True) == pytest.approx(expected)
    ratio = sm.gloo_rendezvous_s(inp, 16384, lazy=True) / sm.gloo_rendezvous_s(inp, 2048, lazy=True)
    assert ratio == pytest.approx(8, rel=0.01)
    eager = sm.recovery_phases(inp, Job(gpus=16384, lazy_gloo=False))["communicators"]
    lazy = sm.recovery_phases(inp, Job(gpus=16384, lazy_gloo=True))["communicators"]
    assert eager - lazy == pytest.approx(
        sm.gloo_rendezvous_s(inp, 16384) - sm.gloo_rendezvous_s(inp, 16384, lazy=True)
    )
    measured = sm.rendezvous_inputs(sm.load("measured"), 2048)["lazy_request_s"]
    assert measured.label == "measured" and "--lazy-gloo" in measured.source


def test_groups_connect_pairs_on_first_use_by_default_from_where_that_costs_the_store_less():
    # The default size is read off the model with the measured store costs: at LAZY_FROM_RANKS
    # the three lazily made groups cost less than three eager ones, at half of it not. A new
    # rendezvous measurement that moves the crossover fails here, and the constant moves too.
    def costs(n: int) -> tuple[float, float]:
        inp = _inputs()
        inp.update(sm.rendezvous_inputs(sm.load("measured"), n))
        return sm.gloo_rendezvous_s(inp, n), sm.gloo_rendezvous_s(inp, n, lazy=True)

    eager, lazy = costs(LAZY_FROM_RANKS)
    assert lazy < eager
    eager, lazy = costs(LAZY_FROM_RANKS // 2)
    assert eager <= lazy
    inp = _inputs()
    inp.update(sm.rendezvous_inputs(sm.load("measured"), 2048))
    for gpus, lazy in ((LAZY_FROM_RANKS // 2, False), (LAZY_FROM_RANKS, True), (16384, True)):
        chosen = sm.recovery_phases(inp, Job(gpus=gpus))["communicators"]
        assert chosen == sm.recovery_phases(inp, Job(gpus=gpus, lazy_gloo=lazy))["communicators"]
        other = sm.recovery_phases(inp, Job(gpus=gpus, lazy_gloo=not lazy))["communicators"]
        assert chosen != other


def test_the_store_cost_per_request_is_the_rendezvous_bench_s():
    measured = sm.load("measured")
    largest = max(measured["rendezvous"]["sizes"], key=lambda s: s["members"])
    got = sm.rendezvous_inputs(measured, largest["members"])["store_request_s"]
    assert got.label == "measured" and "p2p-bench rendezvous" in got.source
    assert got.value == pytest.approx(largest["store_cpu_s"] / largest["requests"])


def test_input_needs_a_known_label_and_a_source():
    with pytest.raises(ValueError):
        Input(1.0, "s", "guessed", "somewhere")
    with pytest.raises(ValueError):
        Input(1.0, "s", "cited", "")


def test_series_interpolates_in_log_ranks_and_says_when_it_extrapolates():
    pts = {256: 1.0, 1024: 3.0, 2048: 5.0}
    assert sm.series(pts, 1024) == (3.0, "at")
    v, how = sm.series(pts, 512)
    assert v == pytest.approx(2.0) and how.startswith("interpolated")
    v, how = sm.series(pts, 4096)
    assert v == pytest.approx(5.0 + 2.0 / 1024 * 2048) and how.startswith("extrapolated")


@settings(max_examples=40, deadline=None)
@given(
    st.floats(5, 100),
    st.floats(1.05, 4.0),
    st.floats(1e9, 5e11),
    st.sampled_from([256, 1024, 2048, 16384]),
)
def test_recovery_grows_with_state_and_shrinks_with_bandwidth(ib, factor, params, gpus):
    slow, fast = _inputs(ib_gbps=ib, params=params), _inputs(ib_gbps=ib * factor, params=params)
    job = Job(gpus=gpus)
    assert sum(sm.recovery_phases(fast, job).values()) <= sum(
        sm.recovery_phases(slow, job).values()
    )
    bigger = _inputs(ib_gbps=ib, params=params * factor)
    assert sm.recovery_phases(bigger, job)["transfer"] > sm.recovery_phases(slow, job)["transfer"]


@settings(max_examples=40, deadline=None)
@given(st.floats(1, 600), st.floats(1.01, 4), st.sampled_from([256, 2048, 16384]))
def test_restart_downtime_grows_with_the_checkpoint_interval(minutes, factor, gpus):
    inp = _inputs()
    short = sum(sm.restart_phases(inp, Job(gpus=gpus, checkpoint_every_min=minutes)).values())
    long = sum(
        sm.restart_phases(inp, Job(gpus=gpus, checkpoint_every_min=minutes * factor)).values()
    )
    assert long > short


@settings(max_examples=40, deadline=None)
@given(st.floats(1, 600), st.floats(1.01, 10), st.integers(1, 3))
def test_copy_loss_grows_with_the_window_and_falls_with_k(window, factor, k):
    inp = _inputs()
    job = Job(replicas=k)
    a = gp.copies_lost_fraction_analytic(inp, job, window, "ring")
    assert gp.copies_lost_fraction_analytic(inp, job, window * factor, "ring") > a
    more = Job(replicas=k + 1)
    assert gp.copies_lost_fraction_analytic(inp, more, window, "ring") < a


def test_copies_lost_needs_the_shard_and_all_its_holders():
    job = Job(gpus=32, gpus_per_node=8, replicas=1)
    assert gp.copies_lost({(0, 0), (1, 0)}, job, "ring")
    assert not gp.copies_lost({(0, 0), (1, 1)}, job, "ring")
    assert gp.copies_lost({(3, 2), (0, 2)}, job, "ring")  # the ring wraps
    k2 = Job(gpus=32, gpus_per_node=8, replicas=2)
    assert not gp.copies_lost({(0, 0), (1, 0)}, k2, "ring")
    assert gp.copies_lost({(0, 0), (1, 0), (2, 0)}, k2, "ring")
    node = {(0, i) for i in range(8)}
    assert gp.copies_lost(node, job, "same-node")
    assert not gp.copies_lost(node, job, "ring")


def test_monte_carlo_counts_faults_and_cold_fallbacks():
    inp = _inputs(node_level_fraction=1.0)
    job = Job(gpus=64, gpus_per_node=8)
    same = gp.simulate(
        inp, job, recovery_gpu_s=1, recovery_node_s=2, cold_s=100, window_s=1,
        placement="same-node", trials=200, days=30,
    )  # fmt: skip
    # Every fault takes a node and its same-node copies: each one is a cold fallback.
    expected = gp.fault_rate_per_s(inp, 64) * 30 * 86400
    assert same["faults_per_period"] == pytest.approx(expected, rel=0.2)
    assert same["cold_fallbacks_per_period"] == pytest.approx(
        same["faults_per_period"] - same["double_fault_incidents_per_period"], rel=0.05
    )
    ring = gp.simulate(
        inp, job, recovery_gpu_s=1, recovery_node_s=2, cold_s=100, window_s=1,
        placement="ring", trials=200, days=30,
    )  # fmt: skip
    assert ring["cold_fallbacks_per_period"] == 0
    assert ring["downtime_per_period_s"] == pytest.approx(2 * ring["faults_per_period"], rel=0.01)


def test_goodput_falls_with_downtime_and_overhead():
    assert gp.goodput(0, 0) == 1.0
    assert gp.goodput(86400, 0) == pytest.approx(1 - 1 / 30)
    assert gp.goodput(86400, 0.01) < gp.goodput(86400, 0)


def test_sensitivity_is_sorted_and_the_range_holds_the_base():
    inp = _inputs()
    job = Job()
    fn = lambda i: sum(sm.recovery_phases(i, job).values())  # noqa: E731
    rows = sm.sensitivity(inp, fn)
    assert rows and all(a["swing"] >= b["swing"] for a, b in itertools.pairwise(rows))
    lo, hi = sm.uncertainty(fn(inp), rows)
    assert lo <= fn(inp) <= hi and not math.isnan(lo)


def test_memory_says_what_does_not_fit_and_the_fix():
    inp = _inputs(params=405.9e9)
    small = sm.memory(inp, Job(gpus=64, replicas=2))
    assert not small["fits_gpu"] and small["fix"]
    fits = sm.memory(_inputs(), Job(gpus=2048, replicas=1))
    assert fits["fits_gpu"] and fits["fix"] is None
    gib = 70.6e9 * 12 / 2048 / 2**30
    assert fits["snapshot_and_replicas_gib_per_gpu"] == pytest.approx(2 * gib)


def test_node_restores_share_links_and_same_node_copies_use_nvlink():
    inp = _inputs()
    s = sm.state_bytes_per_gpu(inp, 2048)
    node = sm.recovery_phases(inp, Job(), node_fault=True)
    assert node["transfer"] == pytest.approx(s / 50e9)  # 8 restores over 8 NICs
    one_nic = sm.recovery_phases(sm.with_value(inp, "nics_per_node", 1), Job(), node_fault=True)
    assert one_nic["transfer"] == pytest.approx(8 * s / 50e9)
    same = sm.recovery_phases(inp, Job(placement="same-node"))
    assert same["transfer"] == pytest.approx(s / 450e9)


def _planner_shares(old, new, rpn, k, nodes):
    """Per new rank, the share of the sharded state the real planner has it receive and send,
    with the holders the launcher's renumbering and the placement give."""
    import torch

    from p2p_state.placement import place
    from recovery.planner import plan_restore, shard_layout

    rows, cols, tensors = 48, 64, 12
    from p2p_state.layout import StateLayout

    template = StateLayout.build(
        [(f"w{i}", torch.float32, (rows // 2, cols), (rows, cols), 0) for i in range(tensors)], 0
    )
    node_of = nodes or [r // rpn for r in range(old)]
    leaving = set(sm.leaving_ranks(old, new, node_of))
    survivors = [r for r in range(old) if r not in leaving]
    new_rank = {o: i for i, o in enumerate(survivors)}
    placement = place(old, rpn, k, nodes)
    holders = {
        o: sorted({new_rank[h] for h in (o, *placement.holders[o]) if h in new_rank})
        for o in range(old)
    }
    inherits = [survivors[d] if d < len(survivors) else d % old for d in range(new)]
    plan = plan_restore(
        [shard_layout(template, old, r) for r in range(old)],
        [shard_layout(template, new, r) for r in range(new)],
        holders,
        inherits,
        step=1,
        split_bytes=1 << 40,
    )
    total = rows * cols * 4 * tensors
    recv, send = [0] * new, [0] * new
    for t in plan.transfers:
        if t.src != t.dst:
            recv[t.dst] += t.nbytes
            send[t.src] += t.nbytes
    return [r / total for r in recv], [s / total for s in send]


@pytest.mark.parametrize(
    ("old", "new", "rpn", "k", "nodes"),
    [
        (3, 4, 1, 1, None),  # p2p-bench resize: grow into the spare
        (4, 3, 1, 1, [0, 1, 2, 0]),  # and give a rank back (the spare sat on node 0)
        (16, 12, 4, 1, None),  # shrink by a node
        (12, 16, 4, 1, None),  # grow by a node
        (16, 12, 4, 2, None),
    ],
)
def test_reshard_shares_match_the_real_planner(old, new, rpn, k, nodes):
    recv, send = sm.reshard_shares(old, new, rpn, k, nodes=nodes)
    p_recv, p_send = _planner_shares(old, new, rpn, k, nodes)
    assert recv == pytest.approx(p_recv, abs=1e-9)
    # The planner hands each tensor's piece to the least-loaded holder, the model levels the
    # loads: the totals agree, the largest sender within one tensor's piece of a shard.
    assert sum(send) == pytest.approx(sum(p_send))
    assert max(send) == pytest.approx(max(p_send), abs=1 / max(old, new) / 12)


def test_a_resize_by_a_node_reshards_almost_everything_at_scale():
    # Boundaries shift by up to a node's worth of shards: past the first ranks no rank holds
    # any of its new shard, so nearly every rank receives a whole shard, not only a newcomer.
    for old, new in ((2048, 2040), (2040, 2048)):
        recv, _ = sm.reshard_shares(old, new, 8, 1)
        assert sum(recv) > 0.85
        assert max(recv) == pytest.approx(1 / new)
    inp = _inputs()
    t = sm.resize_phases(inp, Job(gpus=2048), 2040)["transfer"]
    assert t >= sm.state_bytes_per_gpu(inp, 2040) / (inp["ib_gbps"].value * 1e9)


def test_a_larger_control_plane_run_counts_only_beyond_the_main_runs_sizes():
    measured = sm.load("measured")
    (run,) = measured["control_plane"]["larger"]
    (big,) = run["sizes"]
    without = {**measured, "control_plane": {**measured["control_plane"], "larger": []}}
    # Up to the main run's largest size, its inputs alone (values and ranges).
    for n in (256, 2048):
        assert sm.control_plane_inputs(measured, n) == sm.control_plane_inputs(without, n)
    at = sm.control_plane_inputs(measured, big["ranks"])
    assert at["generation_s"].value == pytest.approx(big["generation_ms_p50"] / 1e3)
    assert at["exit_detect_s"].value == pytest.approx(big["detect_ms_p50"] / 1e3)
    assert run["command"] in at["generation_s"].source and at["generation_s"].label == "measured"
    # Its hang detection ran with another heartbeat timeout: not an input.
    assert (
        big["heartbeat_timeout_s"] != measured["control_plane"]["sizes"][-1]["heartbeat_timeout_s"]
    )
    assert run["command"] not in at["hang_detect_s"].source
    between = sm.control_plane_inputs(measured, 4096)["generation_s"].value
    assert (
        measured["control_plane"]["sizes"][-1]["generation_ms_p50"] / 1e3
        < between
        < at["generation_s"].value
    )
