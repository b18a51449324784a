"""The communicators of one generation, and how to break them when the generation ends.

Every generation of a job has its own process groups: the default group (training and FSDP)
and the groups made from it (replication, the cold checkpoint's gloo group). They rendezvous
through the coordinator's ``TCPStore`` under the generation's own key prefix (``gen<g>/``), so
no key of a dead generation is ever read again.

When a generation ends (a member died or hung), collectives blocked in its groups must return at
once, whatever thread they run on. NCCL groups have ``abort()``. Gloo has no abort for an
operation in flight (pytorch#130345): a blocked gloo operation returns only when a socket of one
of its pairs fails or its timeout (minutes) expires, and a rank blocked waiting for a *healthy*
peer that has moved on would wait the whole timeout. So :meth:`Comms.abort` shuts down
(``shutdown(2)``, not ``close``: the descriptors stay gloo's) every connected TCP socket the
generation's groups and store client opened. Every operation in flight on them then fails with
"Connection closed" on this rank and on its peers, and gloo releases the descriptors itself when
the groups are destroyed. Which sockets belong to a generation is recorded when its groups are
created: the training thread creates them one at a time under a lock, and the connected TCP
sockets that appear during each creation are that group's (listening sockets are never touched:
gloo treats a failed ``accept`` as fatal).

NCCL groups are aborted all at once, each on a thread of its own (:func:`abort_together`):
aborting communicators that have kernels in flight one after another hangs (pytorch#119797),
and FSDP's group and the replication group both have kernels in flight by design. An abort may
still block (a wedged GPU), so it never runs on the thread that sends heartbeats
(:meth:`Comms.abort_in_background`): a survivor whose abort blocks stays alive to the
coordinator and is not declared hung.

Every group is created with :data:`NCCL_ENVIRONMENT`: ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``,
the setting the abort API requires (with torch's default, ProcessGroupNCCL's watchdog tears the
process down on an NCCL error or timeout, and a survivor whose collective failed before the
interrupt arrived would die and use up a spare); ``TORCH_NCCL_DUMP_ON_TIMEOUT=0`` and
``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC=0``: the watchdog that sees the dead peer's error before
the abort does waits that long (15 s by default) for a flight-recorder dump, then sleeps four
times as long whether a dump was made or not, and destroying the group joins the watchdog, so a
survivor missed the next generation's acknowledgement deadline and was replaced (both seen on
an H100).

With ``CommsSpec.lazy_gloo`` (generations of 512 ranks or more, or ``p2p-run --lazy-gloo``)
gloo groups connect a pair on first use instead (:mod:`recovery.gloo_pairs`, which also finds
and releases their sockets in an abort), and each runs one all-reduce while forming, which
connects its ring pairs within the join deadline; once the generation's groups are formed the
members share their addresses over the ring (:meth:`Comms.share_addresses`), so a pair first
used later never needs the store. When a standby coordinator takes over, the generation's store
client moves to its store (:meth:`Comms.store_moved`).

And with :data:`GLOO_ENVIRONMENT`: a gloo group's creation reads every member's address from
the store; those addresses stay a few hundred bytes at any world size and are read with one
``multi_get`` per 128 members (the authenticated store has the extended API), so forming a
group costs the store N^2 / 128 requests of constant-size values instead of N^2 requests of
values that grow with N.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import msgpack
import torch
import torch.distributed as dist

from recovery.gloo_pairs import ENV_GLOO_LAZY_INIT, LAZY_FROM_RANKS, GlooPairs, lazy_pairs_work
from recovery.sockets import shutdown_socket, tcp_sockets
from recovery.tracebacks import rank_prefix

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import Store

logger = logging.getLogger(__name__)

#: Read by ProcessGroupNCCL when a group is constructed (torch's name, not ours).
ENV_NCCL_ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
#: No handling by the watchdog: errors surface as failed collectives and this engine aborts.
NCCL_ASYNC_ERROR_HANDLING = "0"
#: What ProcessGroupNCCL reads when a group is constructed, as every group of the engine is made
#: (see the module docstring), and why.
NCCL_ENVIRONMENT = {
    ENV_NCCL_ASYNC_ERROR_HANDLING: (
        NCCL_ASYNC_ERROR_HANDLING,
        "the engine aborts NCCL groups itself, and the watchdog's handling would tear down "
        "survivors",
    ),
    "TORCH_NCCL_DUMP_ON_TIMEOUT": (
        "0",
        "a flight-recorder dump holds the watchdog for up to TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC "
        "on every failure, and leaving the generation waits for the watchdog",
    ),
    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": (
        "0",
        "the watchdog that sees a failure waits this long for a dump and then sleeps four times "
        "as long, dump or not, and leaving the generation waits for the watchdog",
    ),
}

#: What gloo reads when a group is constructed, as every group of the engine is made, and why.
#: A gloo group connects every pair of its members, each member reading every other's address
#: from the store: at N ranks that is N^2 reads per group, and by default each address also
#: carries N pair numbers (N^3 bytes, tens of GB per group at 2,048 ranks).
GLOO_ENVIRONMENT = {
    "GLOO_ENABLE_STORE_V2_API": (
        "1",
        "each member reads the group's addresses with one multi_get per 128 members instead of "
        "one get per member (the store has the extended API)",
    ),
    "GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER": (
        "1",
        "a member's address names its rank instead of one pair number per member, so it stays a "
        "few hundred bytes at any world size",
    ),
}
#: Every variable set before a group of the engine is created.
GROUP_ENVIRONMENT = {**NCCL_ENVIRONMENT, **GLOO_ENVIRONMENT}

#: Serialises the creation of sockets whose ownership is recorded (see the module docstring).
_CREATE_LOCK = threading.Lock()


class Interrupted(RuntimeError):
    """The generation these communicators belong to has ended; its work must be abandoned."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CommsSpec:
    """Where and how one generation's groups are created."""

    generation: int
    rank: int
    world_size: int
    store_host: str
    store_port: int
    store_prefix: str
    store_secret: bytes = b""
    """The job's secret: the rendezvous store is the authenticated one
    (:mod:`launcher.store`). Empty: a plain ``TCPStore`` (jobs without a coordinator)."""
    job_id: str = ""
    backend: str
    """Default group backend, e.g. ``gloo`` or ``cpu:gloo,cuda:nccl``."""
    timeout_s: float
    """Collective timeout of every group (a last resort: faults are normally interrupts)."""
    join_timeout_s: float = 60.0
    """Deadline for forming a group. Waiting for a member that died after it published its
    address cannot be interrupted; the deadline bounds it (see :func:`creation_timeout`). It
    must be shorter than the coordinator's acknowledgement deadline, so a member stuck in a
    dead generation gets out in time to join the next one."""
    ignore_peers: tuple[tuple[str, int], ...] = ()
    """Peer addresses never treated as a group's socket (the coordinator's control socket)."""
    lazy_gloo: bool = False
    """Gloo groups connect a pair of members the first time an operation uses it, not every
    pair when made (:mod:`recovery.gloo_pairs`; the session sets it from
    :func:`~recovery.gloo_pairs.pairs_on_first_use`): forming a group then costs the store one
    write a member instead of N reads (:meth:`Comms.share_addresses` gives the members the
    rest). Needs the authenticated store (its client tells which addresses gloo reads);
    without it, or where this gloo's addresses are not the ones understood, groups connect
    every pair when made."""
    side_group_max_ctas: int = 8
    """CTA limit (``NCCLConfig.max_ctas``) of every NCCL group made after the default one (the
    replication group): its sends run while FSDP's kernels do, and with no limit they would
    take SMs from compute. A starting value, not yet measured on GPUs."""

    def __post_init__(self) -> None:
        if self.side_group_max_ctas < 1:
            raise ValueError(
                f"CommsSpec.side_group_max_ctas={self.side_group_max_ctas}; use at least 1"
            )


@dataclass
class Comms:
    """The groups of one generation; create with :func:`create_comms`."""

    spec: CommsSpec
    default: dist.ProcessGroup | None = None
    store: Store | None = None
    base_store: Store | None = None
    """The connection ``store`` prefixes (closed by :meth:`abort` and :meth:`destroy`)."""
    groups: dict[str, dist.ProcessGroup] = field(default_factory=dict)
    """Further groups of this generation by name (:meth:`group`)."""
    pairs: GlooPairs | None = None
    """The pairs of this generation's gloo groups, where they connect on first use."""
    _sockets: dict[int, int] = field(default_factory=dict)  # fd -> inode
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _aborted: bool = False
    _abort_done: threading.Event = field(default_factory=threading.Event)
    _destroyed: bool = False

    @property
    def generation(self) -> int:
        """The generation these groups belong to."""
        return self.spec.generation

    @property
    def aborted(self) -> bool:
        """Whether :meth:`abort` was called."""
        return self._aborted

    def _track(self, create: Callable[[], Any]) -> Any:
        """Run ``create`` and record the connected TCP sockets that appeared meanwhile."""
        if self._aborted:
            raise Interrupted(f"generation {self.generation} ended before its groups were made")
        ignore = set(self.spec.ignore_peers)
        with _CREATE_LOCK:
            _set_group_environment(lazy_gloo=self.pairs is not None)
            before = tcp_sockets()
            try:
                return create()
            finally:
                after = tcp_sockets()
                new = {
                    fd: ino
                    for fd, (ino, peer, _) in after.items()
                    if before.get(fd, (None,))[0] != ino and tuple(peer[:2]) not in ignore
                }
                with self._lock:
                    self._sockets.update(new)
                    aborted = self._aborted
                if aborted:  # abort() ran meanwhile and could not see these yet
                    self._shutdown_all()

    def group(self, name: str, backend: str) -> dist.ProcessGroup:
        """The generation's group called ``name`` over all its ranks, created on first use.

        Creation is collective: every member must ask for the same groups in the same order.

        Raises:
            Interrupted: the comms were aborted before or during the creation.
        """
        pg = self.groups.get(name)
        if pg is None:
            t0 = time.monotonic()
            timeout = self._creation_timeout(backend)
            options = _side_group_options(backend, self.spec.side_group_max_ctas)
            try:
                pg = self._track(
                    lambda: dist.new_group(backend=backend, timeout=timeout, pg_options=options)
                )
                self._connect_first(pg, name, backend, t0)
            except Exception as e:
                if self._aborted and not isinstance(e, Interrupted):
                    raise Interrupted(
                        f"generation {self.generation} ended while its {name} group was being "
                        "formed"
                    ) from e
                raise
            pg.set_timeout(timedelta(seconds=self.spec.timeout_s))
            self.groups[name] = pg
        return pg

    def _creation_timeout(self, backend: str) -> timedelta:
        """The timeout this generation's group of ``backend`` is created with."""
        if "gloo" in backend and self.pairs is not None:
            # Its pairs connect on first use, at any time in the generation: a member that
            # comes to an operation first waits for the peer as for any collective. An abort
            # releases that wait (:meth:`GlooPairs.release`); forming is bounded by
            # :meth:`_connect_first`.
            return timedelta(seconds=self.spec.timeout_s)
        return creation_timeout(backend, self.spec.join_timeout_s)

    def _connect_first(self, pg: Any, name: str, backend: str, t0: float) -> None:
        """Connect a lazy gloo group's ring pairs (those of its all-reduces, all-gathers and
        reduce-scatters) now, within the join deadline, so that forming them counts in the
        ``communicators`` phase and a member that is missing is found while forming.

        Raises:
            RuntimeError: not every member connected within the join deadline.
        """
        if "gloo" not in backend or self.pairs is None:
            return
        left_s = self.spec.join_timeout_s - (time.monotonic() - t0)
        work = dist.all_reduce(torch.zeros(1), group=pg, async_op=True)
        try:
            work.wait(timeout=timedelta(seconds=max(left_s, 0.001)))
        except Exception as e:
            if not self._aborted:
                self.pairs.release()  # the wait goes on in gloo: end it
            raise RuntimeError(
                f"generation {self.generation}: the {name} group did not connect within the "
                f"join deadline ({self.spec.join_timeout_s:.0f}s; a member is missing): {e}"
            ) from e

    def abort(self) -> None:
        """Make every collective in flight on these groups fail now. Thread-safe, idempotent.

        A caller that finds an abort already under way (the heartbeat thread started it) waits
        for it, within :data:`ABORT_WAIT_S`: whoever goes on to destroy the groups or form new
        ones must not do so under a running abort.
        """
        with self._lock:
            first, destroyed = not self._aborted, self._destroyed
            self._aborted = True
        if destroyed:  # nothing left to abort, nor to wait for
            return
        if not first:
            if not self._abort_done.wait(ABORT_WAIT_S):
                logger.warning(
                    "generation %d: its groups' abort still running after %.0f s; going on",
                    self.generation,
                    ABORT_WAIT_S,
                )
            return
        try:
            nccl = [pg for pg in (*self.groups.values(), self.default) if pg and _has_nccl(pg)]
            if nccl:
                abort_together(nccl, self.generation)
            # Closed first: a gloo pair that would connect after this reads its peer's address
            # from the store, and now fails instead (a member blocked in the rendezvous returns).
            self._close_store()
            n = self._shutdown_all()
            if self.pairs is not None:
                n += self.pairs.release()
        finally:
            self._abort_done.set()
        logger.info("generation %d: aborted its groups (%d sockets shut down)", self.generation, n)

    def store_moved(self, host: str, port: int) -> threading.Thread | None:
        """The rendezvous store moved (a standby coordinator took over with a new one): this
        generation's store client writes its keys there again and asks it from now on, so a
        gloo pair first used later (or a group made later) still finds its peers' addresses.

        Moves on a thread of its own, which it returns (``None``: nothing to move): the caller
        is the control-plane client's, and a request in flight holds the store client until
        its next slice.
        """
        move = getattr(self.base_store, "move_to", None)
        if move is None or self._aborted or self._destroyed:
            return None

        def moving() -> None:
            try:
                move(host, port)
            except Exception as e:  # the generation's operations will fail, and be recovered
                logger.warning(
                    "generation %d: moving to the rendezvous store at %s:%d failed: %s",
                    self.generation,
                    host,
                    port,
                    e,
                )

        thread = threading.Thread(
            target=moving, name=f"p2p-store-move-gen{self.generation}", daemon=True
        )
        thread.start()
        return thread

    def share_addresses(self) -> int:
        """Give every member every member's addresses in the gloo groups made so far, so that
        a pair first used later reads its peer's address from this process's store client and
        never from the store, which may be gone by then (every coordinator lost) or new (a
        standby took over). They travel over the default group's ring pairs, connected when it
        formed: one all-gather of a few hundred bytes a member, N - 1 ring steps. Collective
        over the default group; nothing to do (0) where gloo groups connect every pair when
        made.

        Returns:
            How many addresses this member learnt.
        """
        from p2p_state.transfer import gather_bytes

        know = getattr(self.base_store, "know", None)
        if self.pairs is None or self.default is None or know is None:
            return 0
        mine = msgpack.packb(self.pairs.records(), use_bin_type=True)
        tables = gather_bytes(mine, self.default, torch.device("cpu"), self.spec.timeout_s)
        learnt: dict[str, bytes] = {}
        for rank, table in enumerate(tables):
            if rank != self.spec.rank:
                learnt.update(_records(msgpack.unpackb(table, raw=False)))
        know(learnt)
        logger.info(
            "generation %d: %d gloo addresses shared over the ring", self.generation, len(learnt)
        )
        return len(learnt)

    def abort_in_background(self) -> threading.Thread | None:
        """Run :meth:`abort` on a thread of its own and return it (``None`` if already aborted).

        For the thread that sends heartbeats: an NCCL abort can block, and that thread must go
        on beating meanwhile, or a healthy survivor would be declared hung and killed.
        """
        with self._lock:
            if self._aborted:
                return None
        thread = threading.Thread(
            target=self.abort, name=f"p2p-abort-gen{self.generation}", daemon=True
        )
        thread.start()
        return thread

    def _shutdown_all(self) -> int:
        with self._lock:
            sockets = dict(self._sockets) if not self._destroyed else {}
        return sum(shutdown_socket(fd, ino) for fd, ino in sockets.items())

    def destroy(self) -> None:
        """Destroy every group of this generation (the default group last)."""
        with self._lock:
            if self._destroyed:
                return
            self._destroyed = True
            self._sockets.clear()
        if self.pairs is not None:  # before the groups' ports can be reused
            self.pairs.destroyed()
        for pg in self.groups.values():
            try:
                dist.destroy_process_group(pg)
            except Exception as e:
                logger.debug("destroying a group of generation %d: %s", self.generation, e)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as e:
                logger.debug("destroying generation %d's default group: %s", self.generation, e)
        self.groups.clear()
        self._close_store()
        self.default = self.store = self.base_store = None

    def _close_store(self) -> None:
        close = getattr(self.base_store, "close", None)  # the authenticated store's client
        if close is not None:
            close()


def _records(doc: Any) -> dict[str, bytes]:
    """Address records a member shared: key -> gloo's bytes (anything else is dropped)."""
    if not isinstance(doc, dict):
        return {}
    return {k: v for k, v in doc.items() if isinstance(k, str) and isinstance(v, bytes)}


def _nccl_backend(pg: Any) -> Any:
    try:
        backend = pg._get_backend(torch.device("cuda"))
    except Exception:
        return None
    return backend if backend.__class__.__name__ == "ProcessGroupNCCL" else None


def _has_nccl(pg: Any) -> bool:
    return _nccl_backend(pg) is not None


#: How long an abort waits for the NCCL aborts it started (torch bounds each by the group's
#: timeout, minutes; a survivor must be out in time to join the next generation).
ABORT_WAIT_S = 30.0


def abort_together(groups: list[Any], generation: int, wait_s: float = ABORT_WAIT_S) -> None:
    """Abort ``groups`` all at once, each on a thread of its own; wait up to ``wait_s``.

    ``ncclCommAbort`` first tells its communicator's kernels to quit, then reclaims the
    communicator, which waits for the device; while a kernel of another communicator still
    spins for a dead peer, that wait never ends. Aborted one after another, the first abort
    waits for a kernel only the second would stop (pytorch#119797). Torch's answer, one NCCL
    group around the aborts, does not hold where ``ProcessGroupNCCL.abort`` runs
    ``ncclCommAbort`` on a thread of its own (torch 2.11: the group is per thread), and there
    the aborts hung on an H100. Started together, every communicator's kernels are told to
    quit before any reclaim waits.

    A failing abort does not stop the others; an abort still running at the deadline is
    logged and left behind (its thread is a daemon).
    """

    def abort(pg: Any) -> None:
        try:
            pg.abort()
        except Exception as e:
            logger.warning("aborting a NCCL group of generation %d: %s", generation, e)

    threads = [
        threading.Thread(target=abort, args=(pg,), name=f"p2p-abort-gen{generation}-{i}")
        for i, pg in enumerate(groups)
    ]
    for thread in threads:
        thread.daemon = True
        thread.start()
    deadline = time.monotonic() + wait_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    left = sum(thread.is_alive() for thread in threads)
    if left:
        logger.warning(
            "generation %d: %d of %d NCCL group aborts still running after %.0f s; going on",
            generation,
            left,
            len(threads),
            wait_s,
        )


def _side_group_options(backend: str, max_ctas: int) -> Any:
    """NCCL options of a group made after the default one (``None`` for other backends)."""
    if backend != "nccl":
        return None
    options = dist.ProcessGroupNCCL.Options()
    options.config.max_ctas = max_ctas
    return options


def _set_group_environment(*, lazy_gloo: bool) -> None:
    """Give the group about to be created the NCCL environment the engine's abort requires and
    the gloo environment that keeps its rendezvous small; its gloo pairs connect on first use
    when ``lazy_gloo``."""
    lazy = "1" if lazy_gloo else "0"
    if os.environ.get(ENV_GLOO_LAZY_INIT, lazy) != lazy:
        logger.warning(
            "%s=%s replaced by %s: the engine finds a group's sockets in an abort only as it "
            "made them (pairs connect on first use from %d ranks; p2p-run --lazy-gloo or "
            "--eager-gloo for one way at every size)",
            ENV_GLOO_LAZY_INIT,
            os.environ[ENV_GLOO_LAZY_INIT],
            lazy,
            LAZY_FROM_RANKS,
        )
    os.environ[ENV_GLOO_LAZY_INIT] = lazy
    for name, (value, why) in GROUP_ENVIRONMENT.items():
        previous = os.environ.get(name)
        if previous not in (None, value):
            logger.warning("%s=%s replaced by %s: %s", name, previous, value, why)
        os.environ[name] = value


def create_comms(spec: CommsSpec, register: Callable[[Comms], None]) -> Comms:
    """Create the default group of one generation (further groups come from :meth:`Comms.group`).

    Collective over the generation's members. ``register`` is called with the :class:`Comms`
    before anything blocks, so another thread can :meth:`Comms.abort` a rendezvous that waits
    for a member that died.

    Raises:
        Interrupted: the comms were aborted during creation.
        RuntimeError: a group could not be formed within ``spec.timeout_s``.
    """
    from torch.distributed.distributed_c10d import PrefixStore

    comms = Comms(spec)
    register(comms)
    join = timedelta(seconds=spec.join_timeout_s)
    t0 = time.monotonic()
    try:
        # Pairs on first use need the authenticated store's client (it tells which addresses
        # gloo writes and reads) and a gloo whose addresses are understood (checked once).
        with _CREATE_LOCK:
            if spec.lazy_gloo and spec.store_secret and lazy_pairs_work():
                comms.pairs = GlooPairs(spec.rank)
        base = comms._track(lambda: _connect_store(spec, join))
        comms.base_store = base
        if comms.pairs is not None:
            base.observer = comms.pairs.saw
        store = comms.store = PrefixStore(spec.store_prefix, base)
        timeout = comms._creation_timeout(spec.backend)
        comms.default = comms._track(
            lambda: _init_default(store, spec.backend, spec.rank, spec.world_size, timeout)
        )
        comms.default.set_timeout(timedelta(seconds=spec.timeout_s))
        comms._connect_first(comms.default, "default", spec.backend, t0)
    except Exception as e:
        if comms.aborted:
            comms.destroy()
            raise Interrupted(
                f"generation {spec.generation} ended while its groups were being formed"
            ) from e
        comms.destroy()
        raise
    logger.info(
        "rank %d joined generation %d (%d ranks%s) in %.0f ms",
        spec.rank,
        spec.generation,
        spec.world_size,
        ", gloo pairs connect on first use" if comms.pairs is not None else "",
        (time.monotonic() - t0) * 1e3,
    )
    return comms


#: How many times its group's timeout gloo waits for a member to connect to it
#: (``Pair::waitUntil`` in gloo/transport/tcp/pair.h: "a longer timeout when waiting for initial
#: connect"). Of the two members of a pair, the one with the higher address connects and the
#: other waits.
GLOO_CONNECT_WAIT_FACTOR = 5


def creation_timeout(backend: str, join_timeout_s: float) -> timedelta:
    """The timeout a group of ``backend`` is created with (its collectives get theirs after).

    A member that published its address and then left the rendezvous (it died, or its
    generation was superseded while it still read the store) never connects, and a peer that
    waits for it to connect waits in gloo, which nothing interrupts, for
    :data:`GLOO_CONNECT_WAIT_FACTOR` times the group's timeout. Created with the join deadline,
    that peer would leave a dead generation five join deadlines late, long after the next one
    gave up waiting for it (the coordinator then replaces it as a member that never arrived).
    Gloo groups are therefore created with a timeout that ends that wait within half the join
    deadline: out of the dead generation by then, the member still has the other half to reach
    the next one, whose members wait a whole join deadline for it. Connecting to a member that
    is gone fails at once (the connection is refused), so the shorter timeout costs nothing
    there. The rendezvous store's waits keep the whole join deadline (the store client has its
    own timeout), and so do groups without gloo.
    """
    if "gloo" not in backend:
        return timedelta(seconds=join_timeout_s)
    return timedelta(seconds=join_timeout_s / (2 * GLOO_CONNECT_WAIT_FACTOR))


def _connect_store(spec: CommsSpec, timeout: timedelta) -> Store:
    if not spec.store_secret:
        return dist.TCPStore(  # type: ignore[attr-defined]
            spec.store_host, spec.store_port, is_master=False, timeout=timeout
        )
    from launcher.store_client import SignedStore

    return SignedStore(spec.store_host, spec.store_port, spec.store_secret, spec.job_id, timeout)


def _init_default(
    store: Store, backend: str, rank: int, world_size: int, timeout: timedelta
) -> dist.ProcessGroup | None:
    if dist.is_initialized():
        dist.destroy_process_group()  # also restarts the group-name counter
    else:
        # Every member must name its groups alike (the names key the rendezvous), and a failed
        # init_process_group used up a name without leaving a group to destroy: restart the
        # counter as destroy_process_group() does for recovering trainers.
        from torch.distributed import distributed_c10d

        distributed_c10d._world.group_count = 0
    with rank_prefix(rank):  # one "[rank<r>]: " on a traceback, not one per generation
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=_eager_device(backend),
        )
    _forget_stale_shardings(world_size, rank)
    return dist.group.WORLD


def _eager_device(backend: str) -> torch.device | None:
    """The GPU to bind an NCCL default group to, or ``None`` without NCCL.

    Bound to a device, the default group creates its NCCL communicator at once (inside the
    ``communicators`` phase, not in the first collective of the redone step), and every group
    made from it afterwards is split from it (``ncclCommSplit``) instead of initialised anew.
    """
    if "nccl" not in backend or not torch.cuda.is_available():
        return None
    return torch.device("cuda", torch.cuda.current_device())


#: This process's rank in each world size that DTensor's caches may hold results for.
_cached_places: dict[int, int] = {}


def _forget_stale_shardings(world_size: int, rank: int) -> None:
    """Empty DTensor's sharding caches if this process's rank in a world of this size changed.

    DTensor caches sharding decisions keyed by device mesh, and two meshes of the same ranks
    compare equal whatever this process's place in them. A cached result carries the mesh it
    was first computed on, and with it that mesh's coordinate of this process: after a resize
    renumbers the ranks, a world of a size seen before would give the new build the old rank's
    shard offsets (and pad uneven shards as for the old rank). A replace keeps every survivor's
    rank, so its caches stay warm.
    """
    if _cached_places.get(world_size, rank) != rank:
        from torch.distributed.tensor import _redistribute
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache

        _clear_sharding_prop_cache()  # type: ignore[no-untyped-call]
        _redistribute.clear_redistribute_planner_cache()
        _redistribute._gen_transform_infos.cache_clear()
        _cached_places.clear()
    _cached_places[world_size] = rank
