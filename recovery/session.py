"""A process's membership in a job: generations as they arrive, and the groups of the current one.

A :class:`Session` is created once per process by ``p2p_state.init_process_group()``. It owns the
control-plane client, keeps the rank map of every generation the coordinator announces, and the
communicators (:class:`recovery.comms.Comms`) of the generation the process is in. Generations
arrive on the client's background thread; when one arrives (or the coordinator announces a fault
and a generation to come), the current generation's groups are aborted at once, so the training
thread's blocked collectives fail now and recovery can start. The training thread then calls
:meth:`Session.next_generation` and :meth:`Session.join`.

Without ``p2p-run`` (no ``P2P_*`` environment) a session is *standalone*: it initialises the
default group from torchrun's environment, has no coordinator and cannot recover from a lost
process; replication and cold checkpoints still work.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from launcher.client import ClientConfig, ControlClient
from p2p_state.config import ReplicationConfig
from p2p_state.memory import BufferPool, MemoryKind, PreparedPool
from recovery.comms import Comms, CommsSpec, Interrupted, create_comms
from recovery.generation import GenerationInfo, decode_generation
from recovery.gloo_pairs import pairs_on_first_use

logger = logging.getLogger(__name__)


class JobEnded(RuntimeError):
    """The coordinator ended the job (``code`` 0: it finished; otherwise it failed)."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(f"the job ended (code {code}): {reason}")
        self.code = code
        self.reason = reason


class CoordinatorsLost(JobEnded):
    """No coordinator is left (the node's agent heard none for ``--coordinator-timeout``): no
    generation will ever come again."""

    def __init__(self, addresses: list[str]) -> None:
        super().__init__(1, f"no coordinator is left ({', '.join(addresses)})")
        self.addresses = addresses


#: The replication signal of a rank that must stop (:meth:`Session.pending_graceful`): above
#: any generation, so the round's agreement (a maximum) makes every rank stop at the same step.
STOP_SIGNAL = 1 << 40


class NotAMember(RuntimeError):
    """The new generation has no place for this process (it was given back by a resize)."""


def default_backend(device_type: str) -> str:
    """The default group's backend: NCCL for CUDA collectives (gloo beside it for CPU ones)."""
    return "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"


class Session:
    """This process's view of the job; see the module docstring.

    Args:
        client_config: How to reach the coordinator; ``None`` for a standalone session.
        timeout_s: Collective timeout of every group (a last resort; faults interrupt).
        device_type: ``cuda`` or ``cpu``: which backends the groups use.
        backend: The default group's backend (default :func:`default_backend`).
        lazy_gloo: Gloo groups connect a pair on first use (:attr:`CommsSpec.lazy_gloo`):
            ``True`` in every generation, ``False`` in none, ``None`` in those of
            :data:`recovery.gloo_pairs.LAZY_FROM_RANKS` ranks or more.
    """

    def __init__(
        self,
        client_config: ClientConfig | None,
        *,
        timeout_s: float,
        device_type: str,
        backend: str | None = None,
        lazy_gloo: bool | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.lazy_gloo = lazy_gloo
        self.device_type = device_type
        self.backend = backend or default_backend(device_type)
        self.comms: Comms | None = None
        self.info: GenerationInfo | None = None
        """The generation this process is in (joined), if any."""
        self.joined_t = 0.0
        """When this process's groups of :attr:`info` were formed (``time.monotonic()``)."""
        self._cond = threading.Condition()
        self._generations: dict[int, GenerationInfo] = {}
        self._latest = 0
        self._latest_urgent = 0
        self._notice: dict[str, Any] | None = None
        self._shutdown: dict[str, Any] | None = None
        self._lost: list[str] | None = None
        self.client: ControlClient | None = None
        self.prepared: PreparedPool | None = None
        """A spare's buffers for the copies of the rank it will take (the coordinator says
        their sizes while it waits)."""
        if client_config is not None and client_config.role == "spare":
            # The job's ReplicationConfig is only known in protect(): its default share.
            fraction = ReplicationConfig().max_memory_fraction
            cuda = device_type == "cuda"
            device = (
                torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
            )
            self.prepared = PreparedPool(device, fraction)
        if client_config is not None:
            start_rank = int(os.environ["RANK"]) if client_config.role == "rank" else None
            self.client = ControlClient(
                client_config,
                rank=start_rank,
                on_generation=self._on_generation,
                on_shutdown=self._on_shutdown,
                on_interrupt=self._on_interrupt,
                on_coordinators_lost=self._on_coordinators_lost,
                on_store_moved=self._on_store_moved,
                on_prepare=self._on_prepare if self.prepared is not None else None,
            )

    @property
    def identity(self) -> str:
        """This process's control-plane identity."""
        return self.client.config.identity if self.client else f"rank/{dist.get_rank()}"

    @property
    def standalone(self) -> bool:
        """No coordinator: a lost process cannot be recovered in place."""
        return self.client is None

    # -- the client thread ---------------------------------------------------------------------

    def _on_generation(self, body: dict[str, Any]) -> None:
        now = time.monotonic()
        with self._cond:
            info = decode_generation(body, self._generations.get(self._latest), now)
            g = info.generation
            self._generations[g] = info
            self._latest = max(self._latest, g)
            if not info.graceful:
                self._latest_urgent = max(self._latest_urgent, g)
            self._cond.notify_all()
        if info.graceful:
            # Members switch at the next commit; they acknowledge now that they know.
            if self.client is not None and info.rank_of(self.identity) is not None:
                self.client.ack(g)
        else:
            self._abort_older_than(g)

    def _on_store_moved(self, host: str, port: int) -> None:
        comms = self.comms
        if comms is not None:
            comms.store_moved(host, port)

    def _on_prepare(self, kind: str, buffers: tuple[int, ...]) -> None:
        prepared = self.prepared
        if prepared is not None:  # None once taken: the spare holds a rank and its own slots
            prepared.prepare(MemoryKind(kind), buffers)

    def take_prepared(self) -> BufferPool | None:
        """A spare's buffers allocated ahead (see :attr:`prepared`), once; ``None`` if none."""
        prepared, self.prepared = self.prepared, None
        return prepared.take() if prepared is not None else None

    def _on_interrupt(self, body: dict[str, Any]) -> None:
        with self._cond:
            self._notice = dict(body, arrived_t=time.monotonic())
            self._cond.notify_all()
        self._abort_older_than(int(body.get("generation", 0)) + 1)

    def _on_shutdown(self, body: dict[str, Any]) -> None:
        with self._cond:
            self._shutdown = body
            self._cond.notify_all()
        self._abort_older_than(1 << 62)

    def _on_coordinators_lost(self, body: dict[str, Any]) -> None:
        # Nothing is aborted: the groups are how the ranks agree on the step they stop at.
        addresses = body.get("addresses")
        with self._cond:
            self._lost = [str(a) for a in addresses] if isinstance(addresses, list) else []
            self._cond.notify_all()

    def _abort_older_than(self, generation: int) -> None:
        comms = self.comms
        if comms is not None and comms.generation < generation:
            # Never on this (the heartbeat) thread: an NCCL abort can block.
            comms.abort_in_background()

    # -- the training thread -------------------------------------------------------------------

    @property
    def interrupted(self) -> bool:
        """A newer generation, a fault notice or the end of the job is waiting."""
        with self._cond:
            return self._pending_locked() is not None

    def _pending_locked(self) -> str | None:
        current = self.info.generation if self.info else 0
        if self._shutdown is not None:
            return "shutdown"
        if self._latest_urgent > current:
            return "generation"
        if self._notice is not None and int(self._notice.get("generation", 0)) >= current > 0:
            return "notice"
        return None

    def interrupt_time(self) -> float | None:
        """When the pending interruption arrived (``time.monotonic()``), if there is one."""
        with self._cond:
            kind = self._pending_locked()
            if kind == "generation":
                return self._generations[self._latest_urgent].arrived_t
            if kind == "notice":
                assert self._notice is not None  # what makes the kind "notice"
                return float(self._notice["arrived_t"])
            return None

    def pending_graceful(self) -> int:
        """The newest graceful generation waiting for this process's switch (0 if none), or
        :data:`STOP_SIGNAL` once no coordinator is left.

        This is what the rank gives each replication round's commit; the round agrees on the
        largest value given, so every rank switches, or stops, after the same step."""
        with self._cond:
            if self._lost is not None:
                return STOP_SIGNAL
            current = self.info.generation if self.info else 0
            return self._latest if self._latest > current else 0

    @property
    def coordinators_lost(self) -> list[str] | None:
        """The coordinators' addresses once the node's agent said none is left, else None."""
        with self._cond:
            return self._lost

    def next_generation(self, timeout_s: float, after: int | None = None) -> GenerationInfo:
        """Wait for a generation newer than the current one (or than ``after``: one that could
        not be joined is never joined again; its rendezvous keys are spent).

        A fault notice from the coordinator (a rank was lost and a spare is awaited) extends
        the wait by the time it announces.

        Raises:
            JobEnded: the coordinator ended the job.
            CoordinatorsLost: no coordinator is left: no generation will come.
            TimeoutError: nothing arrived in time (names ``timeout_s``'s setting).
        """
        assert self.client is not None, "a standalone session has no generations to wait for"
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                if self._lost is not None:
                    raise CoordinatorsLost(self._lost)
                if self._shutdown is not None:
                    raise JobEnded(
                        int(self._shutdown.get("code", 1)), str(self._shutdown.get("reason"))
                    )
                current = self.info.generation if self.info else 0
                if after is not None:
                    current = max(current, after)
                if self._latest > current:
                    return self._generations[self._latest]
                if self._notice is not None:
                    deadline = max(
                        deadline,
                        float(self._notice["arrived_t"]) + float(self._notice.get("wait_s", 0)),
                    )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"{self.identity}: no new generation from the coordinator within "
                        f"{timeout_s:.0f}s after a failure (RecoveryConfig.fault_wait_s)"
                    )
                self._cond.wait(remaining)

    def join(self, info: GenerationInfo) -> Comms:
        """Leave the current generation's groups and form ``info``'s; acknowledge it.

        Raises:
            NotAMember: ``info`` has no rank for this process.
            Interrupted: a newer generation arrived meanwhile.
        """
        rank = info.rank_of(self.identity)
        if rank is None:
            raise NotAMember(f"{self.identity} has no rank in generation {info.generation}")
        if self.comms is not None:
            self.comms.abort()
            self.comms.destroy()
            self.comms = None
        assert self.client is not None, "a standalone session has no generations to join"
        self.client.took_rank(rank)
        if not info.graceful:
            # Should the generation not form in time, whoever has not arrived is replaced, not
            # every member (one survivor held up leaving must not take the others down). Said
            # only if forming takes a while: a quarter of the deadline, before the group's own
            # join deadline (half of it) gives up.
            self.client.arrived(info.generation, after_s=info.ack_timeout_s / 4)
        host, port = self.client.store_address(self.timeout_s)
        spec = CommsSpec(
            generation=info.generation,
            rank=rank,
            world_size=info.world_size,
            store_host=host,
            store_port=port,
            store_prefix=info.store_prefix,
            store_secret=self.client.secret,
            job_id=self.client.config.job_id,
            backend=self.backend,
            timeout_s=self.timeout_s,
            # Out of a generation that cannot form (a member died) before the coordinator's
            # acknowledgement deadline of the next one expires. A graceful one was acknowledged
            # on arrival, and its members come when they reach the switch: wait for them.
            join_timeout_s=self.timeout_s
            if info.graceful
            else min(self.timeout_s, info.ack_timeout_s / 2),
            ignore_peers=tuple(_address(a) for a in self.client.config.coordinators),
            lazy_gloo=pairs_on_first_use(info.world_size, self.lazy_gloo),
        )
        comms = create_comms(spec, self._register)
        with self._cond:
            self.info = info
            self.joined_t = time.monotonic()
            if (
                self._notice is not None
                and int(self._notice.get("generation", 0)) < info.generation
            ):
                self._notice = None
        if not info.graceful:
            self.client.ack(info.generation)
        if self.interrupted:  # superseded while forming: the abort already broke these groups
            raise Interrupted(f"generation {info.generation} was superseded while joining it")
        return comms

    def _register(self, comms: Comms) -> None:
        self.comms = comms
        with self._cond:
            superseded = self._latest > comms.generation or self._shutdown is not None
        if superseded:
            comms.abort()

    def start_standalone(self) -> None:
        """Initialise the default group from torchrun's environment (no coordinator)."""
        if not dist.is_initialized():
            dist.init_process_group(self.backend, timeout=timedelta(seconds=self.timeout_s))
        spec = CommsSpec(
            generation=0,
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            store_host="",
            store_port=0,
            store_prefix="",
            backend=self.backend,
            timeout_s=self.timeout_s,
        )
        self.comms = Comms(spec, default=dist.group.WORLD)

    def report_failure(self, reason: str, *, fatal: bool) -> None:
        """Tell the coordinator this rank failed (it is replaced) or the job cannot go on."""
        if self.client is not None:
            self.client.report_error(reason, fatal=fatal)

    def event(self, name: str, **fields: Any) -> None:
        """An event for the job's log (nothing in a standalone session)."""
        if self.client is not None:
            self.client.event(name, **fields)

    def close(self) -> None:
        """Destroy the groups and stop the control-plane client."""
        if self.prepared is not None:
            self.prepared.close()
            self.prepared = None
        if self.comms is not None:
            self.comms.destroy()
            self.comms = None
        if self.client is not None:
            self.client.close()
            self.client = None


def _address(host_port: str) -> tuple[str, int]:
    host, _, port = host_port.rpartition(":")
    return host, int(port)


def device_type_of_job() -> str:
    """``cuda`` when this process has a GPU to train on, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"
