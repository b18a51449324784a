"""Gloo groups whose pairs connect on first use, and how to break them when a generation ends.

A gloo group made eagerly connects every pair of its members when it is created: each member
reads every other's address from the rendezvous store, N^2 reads a group (N^2 / 128 requests
with the store's batched API) and N^2 / 2 TCP connections, the largest term of a recovery at
2,048 ranks (docs/scale-model.md). Made with ``TORCH_GLOO_LAZY_INIT=1``, a member only writes
its own address when the group is created and reads a peer's (and connects to it) the first
time an operation uses that pair: a ring collective uses two pairs a member, a tree or a
barrier a few more, a gather at a root N of them at the root only.

Breaking such a group (:meth:`GlooPairs.release`) must find sockets made after it was created,
on gloo's own threads. This module learns every listening address of the generation's lazy
groups the way gloo does, from the store: the member's own when gloo writes it, a peer's when
gloo reads it to connect (:meth:`GlooPairs.saw`, called by the store client for every value
it writes or reads). Every connected TCP socket of the generation's lazy groups then has one
end on one of those addresses: accepted on this member's listener, or made to a peer's
listener. A release does three things:

1. shuts down (``shutdown(2)``, the descriptor stays gloo's) every such socket, so every
   operation in flight on it fails here and at the peer, as for an eager group;
2. wakes every pair still waiting for a peer to connect to it: of a pair, the member with the
   lower address waits for the other to connect and present its rank, and gloo waits five
   times the group's timeout for that, uninterrupted (:func:`waits_for`). The release connects
   to this member's own listener once for each peer whose address gloo read and that this
   member waits for, presenting that peer's rank, and shuts the connection down: the waiting
   pair takes it, finds it closed, and its operation fails. A pair that is already connected
   never sees it (gloo drops a second connection for a number nobody waits for);
3. goes on doing both (:meth:`GlooPairs.reap`) until the generation's groups are destroyed: a
   connection gloo began before the release can complete just after it, and a read of an
   address answered just before the store closed be followed by a connect. Nothing new begins:
   closing the store makes gloo's next read of an address fail.

A pair first used later in the generation must find its peer's address when the store may be
gone (every coordinator lost) or new (a standby took over): once the groups are formed, the
members give each other their records (:meth:`GlooPairs.records`) over the ring, and their
store clients answer those reads themselves (``recovery.comms.Comms.share_addresses``).

Which bytes are a gloo address is gloo's format (``Rank::bytes`` in
gloo/transport/tcp/context.cc): the host name and the listener's ``Address`` (a
``sockaddr_storage`` and a sequence number), each behind its ``size_t`` length, then the pair
numbers (none with ``GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER``). :func:`lazy_pairs_work` checks it
against the kernel once a process: a one-member lazy group's written address must be the
listening socket that appeared when it was made. Where it is not (another gloo), groups are
made eagerly, with a warning.

Which generations connect on first use (:func:`pairs_on_first_use`): those of
:data:`LAZY_FROM_RANKS` ranks or more, unless ``p2p-run --lazy-gloo`` or ``--eager-gloo``
decides for every size.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import struct
import sys
import threading
from datetime import timedelta
from typing import Any

from recovery.sockets import shutdown_socket, tcp_listeners, tcp_sockets

logger = logging.getLogger(__name__)

#: What ProcessGroupGloo reads, when a group is constructed, to connect pairs on first use.
ENV_GLOO_LAZY_INIT = "TORCH_GLOO_LAZY_INIT"
#: The bytes of gloo's tcp ``Address``: a ``sockaddr_storage`` and a sequence number.
_ADDRESS_BYTES = 128 + 8
_SIZE = struct.Struct("=Q")  # size_t
_FAMILY = struct.Struct("=H")  # sa_family_t
_PORT = struct.Struct("!H")  # in_port_t, network order
_SEQUENCE = struct.Struct("=q")  # gloo's sequence_number_t (ssize_t)
_MAX_HOSTNAME_BYTES = 255
#: How often :meth:`GlooPairs.reap` looks for sockets a connection under way made after a
#: release (they may only appear until the groups are destroyed, soon after).
REAP_INTERVAL_S = 0.02
#: World size from which a generation's gloo groups connect pairs on first use by default: the
#: first power of two at which the scale model's rendezvous of three lazily made groups costs
#: less than that of three eager ones (0.53 s against 0.73 s at 512 ranks, 0.26 s against
#: 0.24 s at 256; docs/scale-model.md). Below it the eager way costs no more, and its groups
#: need no address sharing and have no pair left waiting for a peer when they are broken.
LAZY_FROM_RANKS = 512

Endpoint = tuple[str, int]


def pairs_on_first_use(world_size: int, choice: bool | None = None) -> bool:
    """Whether a generation of ``world_size`` ranks makes its gloo groups with pairs connected
    on first use: ``choice`` where one was made (``--lazy-gloo``: ``True``, ``--eager-gloo``:
    ``False``), else from :data:`LAZY_FROM_RANKS` ranks."""
    return choice if choice is not None else world_size >= LAZY_FROM_RANKS


def listener_of(record: bytes) -> Endpoint | None:
    """The listening address in gloo's record of a member, or ``None`` if it is not one."""
    if len(record) < 2 * _SIZE.size:
        return None
    (hostname_bytes,) = _SIZE.unpack_from(record, 0)
    if hostname_bytes > _MAX_HOSTNAME_BYTES:
        return None
    offset = _SIZE.size + hostname_bytes
    if offset + _SIZE.size > len(record):
        return None
    (address_bytes,) = _SIZE.unpack_from(record, offset)
    offset += _SIZE.size
    rest = len(record) - offset - address_bytes
    if address_bytes != _ADDRESS_BYTES or rest < 0 or rest % _SEQUENCE.size:
        return None
    (family,) = _FAMILY.unpack_from(record, offset)
    (port,) = _PORT.unpack_from(record, offset + _FAMILY.size)
    if family == socket.AF_INET:
        host = socket.inet_ntop(socket.AF_INET, record[offset + 4 : offset + 8])
    elif family == socket.AF_INET6:
        host = socket.inet_ntop(socket.AF_INET6, record[offset + 8 : offset + 24])
    else:
        return None
    return (host, port) if port else None


def waits_for(own: Endpoint, peer: Endpoint) -> bool:
    """Whether, of a pair, the member listening on ``own`` waits for the one on ``peer`` to
    connect (gloo's ``Device::isInitiator``: the higher address connects, comparing the IP
    addresses byte by byte, then the ports as stored, in network byte order)."""

    def order(endpoint: Endpoint) -> tuple[bytes, int]:
        host, port = endpoint
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return socket.inet_pton(family, host), int.from_bytes(_PORT.pack(port), sys.byteorder)

    return order(own) < order(peer)


def _split(key: str) -> tuple[str, int] | None:
    """A gloo address key's group prefix and member rank (gloo keys each member by its rank)."""
    prefix, _, rank = key.rpartition("/")
    return (prefix, int(rank)) if rank.isdigit() else None


class GlooPairs:
    """The pairs of one generation's lazily connected gloo groups on this member.

    Args:
        rank: This member's rank in the generation.
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._lock = threading.Lock()
        self._own: dict[str, Endpoint] = {}  # group prefix -> this member's listener
        self._records: dict[str, bytes] = {}  # this member's address records, by store key
        self._read: dict[str, dict[int, Endpoint]] = {}  # group prefix -> rank -> listener
        self._peers: set[Endpoint] = set()
        self._presented: set[tuple[str, int]] = set()
        self._destroyed = threading.Event()
        self._reaper: threading.Thread | None = None

    def saw(self, key: str, value: bytes, *, written: bool) -> None:
        """Learn from a value this member wrote to the store or read from it (never raises)."""
        try:
            place = _split(key)
            endpoint = listener_of(value) if place is not None else None
        except Exception as e:  # a store hook must not fail the store's caller
            logger.debug("reading a store value of %s: %s", key, e)
            return
        if endpoint is None or place is None:
            return
        prefix, rank = place
        with self._lock:
            if written and rank == self.rank:
                self._own[prefix] = endpoint
                self._records[key] = bytes(value)
            elif not written and rank != self.rank:
                self._read.setdefault(prefix, {})[rank] = endpoint
                self._peers.add(endpoint)

    @property
    def listeners(self) -> list[Endpoint]:
        """This member's listening addresses, one a group."""
        with self._lock:
            return list(self._own.values())

    def records(self) -> dict[str, bytes]:
        """This member's address records as gloo wrote them to the store, by key."""
        with self._lock:
            return dict(self._records)

    def read(self, rank: int) -> bool:
        """Whether gloo read member ``rank``'s address (to connect to it) in any group."""
        with self._lock:
            return any(rank in peers for peers in self._read.values())

    def sockets(self) -> dict[int, int]:
        """This member's connected sockets of these groups: fd -> inode."""
        with self._lock:
            own = set(self._own.values())
            peers = set(self._peers)
        if not own and not peers:
            return {}
        return {
            fd: inode
            for fd, (inode, peer, local) in tcp_sockets().items()
            if tuple(local[:2]) in own or tuple(peer[:2]) in peers
        }

    def release(self) -> int:
        """Make every operation in flight on these groups fail now; the number of sockets shut
        down and connections presented. Idempotent; call :meth:`destroyed` when they are gone."""
        n = self._break()
        with self._lock:
            if self._reaper is None and not self._destroyed.is_set():
                self._reaper = threading.Thread(target=self.reap, name="p2p-gloo-reap", daemon=True)
                self._reaper.start()
        return n

    def reap(self) -> None:
        """Break these groups' pairs as they appear, until :meth:`destroyed` is called."""
        while not self._destroyed.wait(REAP_INTERVAL_S):
            self._break()

    def _break(self) -> int:
        n = sum(shutdown_socket(fd, inode) for fd, inode in self.sockets().items())
        with self._lock:
            waiting = [
                (prefix, rank, self._own[prefix])
                for prefix, peers in self._read.items()
                if prefix in self._own
                for rank, peer in peers.items()
                if (prefix, rank) not in self._presented and waits_for(self._own[prefix], peer)
            ]
            self._presented.update((prefix, rank) for prefix, rank, _ in waiting)
        return n + sum(_present(listener, rank) for _, rank, listener in waiting)

    def destroyed(self) -> None:
        """The groups are gone: stop looking for their sockets (their ports may be reused)."""
        self._destroyed.set()
        with self._lock:
            reaper = self._reaper
        if reaper is not None and reaper is not threading.current_thread():
            reaper.join(timeout=1.0)


def _present(listener: Endpoint, rank: int) -> int:
    """Connect to ``listener`` as member ``rank`` would, then shut the connection down."""
    family = socket.AF_INET6 if ":" in listener[0] else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.settimeout(1.0)
            sock.connect(listener)
            sock.sendall(_SEQUENCE.pack(rank))
            sock.shutdown(socket.SHUT_RDWR)
        return 1
    except OSError as e:  # the listener is gone: so is every pair that waited on it
        logger.debug("presenting rank %d to %s:%d: %s", rank, *listener, e)
        return 0


@functools.cache
def lazy_pairs_work() -> bool:
    """Whether this process's gloo writes the addresses :func:`listener_of` reads (once)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import Store

    class _Recorder(Store):
        def __init__(self) -> None:
            super().__init__()
            self.inner = dist.HashStore()  # type: ignore[attr-defined]
            self.written: list[bytes] = []

        def set(self, key: str, value: Any) -> None:
            self.written.append(bytes(value))
            self.inner.set(key, value)

        def get(self, key: str) -> bytes:
            return bytes(self.inner.get(key))

        def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
            self.inner.wait(keys)

    previous = os.environ.get(ENV_GLOO_LAZY_INIT)
    os.environ[ENV_GLOO_LAZY_INIT] = "1"
    store = _Recorder()
    before = tcp_listeners()
    try:
        pg = dist.ProcessGroupGloo(store, 0, 1, timedelta(seconds=10))
        appeared = {
            tuple(local[:2])
            for fd, (inode, local) in tcp_listeners().items()
            if before.get(fd, (None,))[0] != inode
        }
        found = {listener_of(value) for value in store.written}
        del pg
    except Exception as e:
        logger.warning("gloo groups connect every pair when made: checking gloo failed: %s", e)
        return False
    finally:
        if previous is None:
            os.environ.pop(ENV_GLOO_LAZY_INIT, None)
        else:
            os.environ[ENV_GLOO_LAZY_INIT] = previous
    if not appeared or found != appeared:
        logger.warning(
            "gloo groups connect every pair when made: this gloo's address records (%s) are not "
            "its listening sockets (%s)",
            found,
            appeared,
        )
        return False
    return True
