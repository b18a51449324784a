"""The order point-to-point operations are posted in, which NCCL relies on (it ignores tags)."""

from __future__ import annotations

import torch

from p2p_state import transfer
from p2p_state.transfer import RecvBuffer, SendBuffer, exchange, posting_order, transfer_tag


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
    sends = [SendBuffer(1, _buf(10), transfer_tag(2)), SendBuffer(1, _buf(10), transfer_tag(0))]
    recvs = [RecvBuffer(1, _buf(10), transfer_tag(1)), RecvBuffer(2, _buf(20), transfer_tag(0))]
    exchange(sends, recvs, group=None, chunk_bytes=10, timeout_s=5.0)
    t1, t2 = transfer_tag(1), transfer_tag(2)
    assert posted == [
        [("isend", 1, 0), ("irecv", 2, 0), ("irecv", 1, t1), ("isend", 1, t2)],
        [("irecv", 2, 1)],
    ]


def test_transfers_that_share_a_tag_keep_their_listed_order() -> None:
    a, b, c = _buf(4), _buf(4), _buf(4)
    items = [(True, 1, a, 5), (True, 1, b, 0), (True, 1, c, 5)]
    ordered = posting_order(items)
    assert [item[2] is buf for item, buf in zip(ordered, (b, a, c))] == [True, True, True]
