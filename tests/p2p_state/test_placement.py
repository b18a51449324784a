"""Buddy placement: pure properties, checked over many shapes with hypothesis."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_state.placement import place


@st.composite
def shapes(draw):
    rpn = draw(st.integers(1, 8))
    world = draw(st.integers(2, 96))
    k = draw(st.integers(1, min(4, world - 1)))
    return world, rpn, k


@settings(max_examples=300, deadline=None)
@given(shapes())
def test_no_rank_is_its_own_buddy_and_every_shard_has_k_distinct_holders(shape):
    world, rpn, k = shape
    p = place(world, rpn, k)
    for owner, holders in enumerate(p.holders):
        assert owner not in holders
        assert len(holders) == k
        assert len(set(holders)) == k
        assert all(0 <= h < world for h in holders)


@settings(max_examples=300, deadline=None)
@given(shapes())
def test_copies_leave_the_owners_node_whenever_possible(shape):
    world, rpn, k = shape
    p = place(world, rpn, k)
    num_nodes = p.num_nodes
    for owner, holders in enumerate(p.holders):
        nodes = [p.node_of(h) for h in holders]
        if num_nodes > 1:
            # With another node available, no shard keeps all its copies at home ...
            assert any(n != p.node_of(owner) for n in nodes)
            # ... and copies spread over as many distinct other nodes as exist.
            other_nodes = set(nodes) - {p.node_of(owner)}
            assert len(other_nodes) >= min(k, num_nodes - 1)
    if num_nodes > 1:
        assert p.exposed_to_node_loss == ()
    else:
        assert p.exposed_to_node_loss == tuple(range(world))
        assert p.warnings(), "a single-node job must be reported as exposed to node loss"


@settings(max_examples=200, deadline=None)
@given(shapes())
def test_placement_is_deterministic_and_held_by_is_its_inverse(shape):
    world, rpn, k = shape
    a, b = place(world, rpn, k), place(world, rpn, k)
    assert a.holders == b.holders
    pairs = {(o, h) for o, hs in enumerate(a.holders) for h in hs}
    assert pairs == {(o, h) for h, os_ in enumerate(a.held_by) for o in os_}


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 16), st.integers(1, 8), st.integers(1, 3))
def test_equal_nodes_are_perfectly_balanced(num_nodes, rpn, k):
    world = num_nodes * rpn
    if k >= world:
        return
    p = place(world, rpn, k)
    assert all(len(h) == k for h in p.held_by)
    assert p.max_load == k


def test_ring_example_two_nodes_of_two():
    # Nodes {0, 1} and {2, 3}: each rank's buddy is its peer on the other node.
    assert place(4, 2, 1).holders == ((2,), (3,), (1,), (0,))


def test_uneven_nodes_prefer_failure_domain_over_balance():
    p = place(3, 2, 1)  # nodes {0, 1} and {2}
    assert p.holders[0] == (2,) and p.holders[1] == (2,)
    assert p.max_load == 2 and any("uneven" in w for w in p.warnings())


@pytest.mark.parametrize(
    "args, message",
    [
        ((0, 1, 1), "world_size"),
        ((4, 0, 1), "ranks_per_node"),
        ((4, 2, 0), "k must"),
        ((2, 1, 2), "needs at least"),
    ],
)
def test_bad_inputs_are_refused_with_a_clear_message(args, message):
    with pytest.raises(ValueError, match=message):
        place(*args)


@st.composite
def node_maps(draw):
    world = draw(st.integers(2, 48))
    nodes = draw(st.lists(st.integers(0, 5), min_size=world, max_size=world))
    k = draw(st.integers(1, min(3, world - 1)))
    return nodes, k


@settings(max_examples=300, deadline=None)
@given(node_maps())
def test_an_explicit_node_map_keeps_copies_off_the_owners_node(shape):
    """Ranks renumbered by a resize, or spares in lost ranks' places: nodes by map."""
    nodes, k = shape
    world = len(nodes)
    p = place(world, 1, k, nodes=nodes)
    assert p.holders == place(world, 1, k, nodes=nodes).holders
    for owner, holders in enumerate(p.holders):
        assert owner not in holders and len(set(holders)) == k
        others = {n for r, n in enumerate(nodes) if r != owner and n != nodes[owner]}
        if others:
            assert any(nodes[h] != nodes[owner] for h in holders)
        if len(others) >= k:
            assert all(nodes[h] != nodes[owner] for h in holders)
    assert p.node_of(world - 1) == nodes[-1]


def test_the_default_node_map_is_the_numbering():
    assert place(8, 2, 1).holders == place(8, 2, 1, nodes=[r // 2 for r in range(8)]).holders
