"""The order point-to-point operations are posted in, which NCCL relies on (it ignores tags)."""

from __future__ import annotations

import pytest
import torch

from p2p_state import transfer
from p2p_state.transfer import Recv, Send, exchange, posting_order, transfer_tag


def _buf(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.uint8)


def test_every_round_is_posted_in_tag_order_per_pair(monkeypatch) -> None:
    posted: list[list[tuple[str, int, int]]] = []

    class Done:
        def wait(self, timeout=None) -> bool:
            return True

    monkeypatch.setattr(
        transfer.dist,
        "P2POp",
        lambda fn, piece, peer, group, tag: (fn.__name__, peer, tag),
    )
    monkeypatch.setattr(
        transfer.dist, "batch_isend_irecv", lambda ops: posted.append(ops) or [Done()]
    )
    # Given out of tag order (as a restore may list them), to and from the same peer.
    sends = [Send(1, _buf(10), transfer_tag(2)), Send(1, _buf(10), transfer_tag(0))]
    recvs = [Recv(1, _buf(10), transfer_tag(1)), Recv(2, _buf(20), transfer_tag(0))]
    exchange(sends, recvs, group=None, chunk_bytes=10, timeout_s=5.0)
    t1, t2 = transfer_tag(1), transfer_tag(2)
    assert posted == [
        [("isend", 1, 0), ("irecv", 2, 0), ("irecv", 1, t1), ("isend", 1, t2)],
        [("irecv", 2, 1)],
    ]


def test_two_transfers_one_way_with_one_tag_are_refused() -> None:
    items = [(True, 1, _buf(4), 0), (False, 1, _buf(4), 0)]
    assert posting_order(items) == items  # one each way is fine
    with pytest.raises(AssertionError, match="two sends to rank 1 with tag 0"):
        posting_order([*items, (True, 1, _buf(4), 0)])
