"""This process's TCP sockets, read from ``/proc/self/fd``, and shutting one down.

What :class:`recovery.comms.Comms` records as a generation's sockets while its groups are
created (or, for pairs connected on first use, finds by address: :mod:`recovery.gloo_pairs`),
and shuts down (``shutdown(2)``, not ``close``: the descriptors stay their owner's) to break the
generation's operations in flight.
"""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Iterator
from typing import Any


def tcp_sockets() -> dict[int, tuple[Any, ...]]:
    """Connected TCP sockets of this process: fd -> (inode, peer address, local address)."""
    return {
        fd: (inode, peer, local)
        for fd, inode, local, peer in _tcp(listening=False)
        if peer is not None
    }


def tcp_listeners() -> dict[int, tuple[Any, ...]]:
    """Listening TCP sockets of this process: fd -> (inode, local address)."""
    return {fd: (inode, local) for fd, inode, local, _ in _tcp(listening=True)}


def _tcp(*, listening: bool) -> Iterator[tuple[int, int, Any, Any]]:
    """This process's TCP sockets that listen (or do not): fd, inode, local and peer address
    (``None`` where not connected)."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            st = os.stat(fd)
        except OSError:
            continue
        if not stat.S_ISSOCK(st.st_mode):
            continue
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            if sock.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            if sock.type != socket.SOCK_STREAM:
                continue
            if bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)) != listening:
                continue
            local = sock.getsockname()
            try:
                peer = None if listening else sock.getpeername()
            except OSError:
                peer = None  # not connected (yet)
        except OSError:
            continue
        finally:
            sock.detach()
        yield fd, st.st_ino, local, peer


def shutdown_socket(fd: int, inode: int) -> bool:
    """Shut down socket ``fd`` if it is still the socket it was (same inode)."""
    try:
        if os.stat(fd).st_ino != inode:
            return False  # the descriptor was closed and reused: not ours any more
        sock = socket.socket(fileno=fd)
    except OSError:
        return False
    try:
        sock.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False
    finally:
        sock.detach()
