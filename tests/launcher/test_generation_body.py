"""The generation message's body: its maps as runs, read back exactly, bounded on bad input."""

from __future__ import annotations

import time

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from launcher.decisions import MAX_WORLD_SIZE, Generation, body_maps
from recovery.generation import decode_generation


def _generation(ranks: dict[int, str], nodes: dict[int, int], **kw) -> Generation:
    fields = dict(replaced={}, lost=[], committed_step=-1, store_prefix="gen1/", holders={})
    return Generation(1, len(ranks), ranks, nodes, **{**fields, **kw})


def _wire(body: dict) -> dict:
    """What a member decodes: map keys become strings, as msgpack carries them."""
    return msgpack.unpackb(msgpack.packb(body), strict_map_key=False)


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["rank/0/", "rank/1/", "spare/0/", "x", "rank/2/0", ""]),
            st.one_of(st.none(), st.integers(0, 12), st.sampled_from(["07", "00", "x1"])),
            st.integers(0, 3),
        ),
        min_size=1,
        max_size=40,
    )
)
def test_every_map_reads_back_exactly(rows):
    ranks = {r: f"{prefix}{'' if n is None else n}" for r, (prefix, n, _) in enumerate(rows)}
    nodes = {r: node for r, (_, _, node) in enumerate(rows)}
    body = _wire(_generation(ranks, nodes).to_body(full=True))
    assert body_maps(body) == (ranks, nodes)


def test_the_first_generation_of_16384_ranks_is_small_and_decodes_to_the_same_membership():
    n, per_node = 16384, 8
    ranks = {r: f"rank/{r // per_node}/{r % per_node + 1}" for r in range(n)}
    nodes = {r: r // per_node for r in range(n)}
    body = _generation(ranks, nodes, ranks_per_node=per_node).to_body(full=True)
    wire = msgpack.packb(body)
    assert len(wire) < 64 * 1024  # every member receives it: 16,384 of them
    info = decode_generation(_wire(body), None, time.monotonic())
    assert info.ranks == ranks and info.nodes == nodes
    assert info.rank_of("rank/2047/8") == n - 1 and info.holders[0]  # placement from the map


def test_a_delta_applies_to_the_full_maps_before_it():
    ranks = {r: f"rank/{r // 2}/{r % 2 + 1}" for r in range(4)}
    nodes = {r: r // 2 for r in range(4)}
    first = decode_generation(_wire(_generation(ranks, nodes).to_body()), None, 0.0)
    after = {**ranks, 1: "spare/1/3"}
    replaced = {1: ["rank/0/2", "spare/1/3"]}
    delta = _generation(after, {**nodes, 1: 1}, replaced=replaced).to_body(full=False)
    assert "rank_runs" not in delta and delta["ranks"] == {"1": "spare/1/3"}
    second = decode_generation(_wire(delta), first, 0.0)
    assert second.ranks == after and second.nodes == {**nodes, 1: 1}


@pytest.mark.parametrize(
    "change",
    [
        {"world_size": MAX_WORLD_SIZE + 1},
        {"world_size": True},
        {"rank_runs": [[0, 10**12, "rank/", 0]]},  # no huge allocation: refused by its bound
        {"rank_runs": [[3, 2, "rank/", 0]]},  # beyond the world
        {"rank_runs": [[-1, 1, "rank/", 0]]},
        {"rank_runs": [[0, 2, "only-one", None]]},
        {"rank_runs": [[0, 1, "rank/"]]},
        {"rank_runs": 7},
        {"node_runs": [[0, 0, 1]]},
        {"node_runs": [[0, True, 1]]},
        {"node_runs": [["0", 1, 1]]},
        {"nodes": {"x": 1}},
        {"ranks": [1, 2]},
    ],
)
def test_a_malformed_body_is_a_value_error(change):
    body = _wire(
        _generation({r: f"rank/0/{r}" for r in range(4)}, dict.fromkeys(range(4), 0)).to_body()
    )
    with pytest.raises(ValueError, match="generation body"):
        body_maps({**body, **change})
