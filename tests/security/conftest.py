"""Fixtures the security tests share."""

from __future__ import annotations

import pytest
import zmq


@pytest.fixture
def ctx():
    """A ZeroMQ context whose sockets are closed at once when the test ends."""
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def dealer(ctx: zmq.Context, identity: bytes | str, port: int, **options: int) -> zmq.Socket:
    """A DEALER on loopback ``port`` under ``identity`` (no linger), with any further socket
    ``options`` (e.g. ``RECONNECT_IVL=50``)."""
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, identity.encode() if isinstance(identity, str) else identity)
    s.setsockopt(zmq.LINGER, 0)
    for name, value in options.items():
        s.setsockopt(getattr(zmq, name), value)
    s.connect(f"tcp://127.0.0.1:{port}")
    return s
