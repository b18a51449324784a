"""Fault specifications and the in-process injector that fires them at exact points of a step.

A fault is written as ``kind:target@when[:phase=...]``:

========================================  =====================================================
``kill:rank=3@step=20``                   SIGKILL rank 3 during step 20 (``phase``: ``forward``
                                          (default), ``backward``, ``optimizer``,
                                          ``replication``)
``hang:rank=2@step=60``                   SIGSTOP rank 2 during step 60 (a hang: only the
                                          heartbeat timeout notices it)
``kill-node:node=1@step=40``              SIGKILL node 1's agent at step 40: every process of
                                          the node dies with it
``partition:node=2@step=40``              take node 2's network link down at step 40 (the job's
                                          nodes in network namespaces, :mod:`bench.netns`):
                                          every process of the node runs on, cut off, until the
                                          job has recovered without it; then the link is back
``kill-buddies:rank=1@step=80``           rank 1 and every rank holding a copy of its shard die
                                          together (no copy survives: the cold checkpoint is used)
``during-replication:rank=1@step=5``      SIGKILL rank 1 while it sends its snapshot of step 5
``during-recovery:rank=2@recovery=1``     SIGKILL rank 2 in the middle of the first recovery
                                          (``phase``: a recovery phase, default ``plan``);
                                          recovery K is the one into generation K + 1, so a
                                          recovery a fault restarts is the next one
``bitflip:rank=1@step=3``                 flip one bit of rank 1's parameters, the top bit of
                                          the first value's mantissa, so rounding can never
                                          absorb it (silent data corruption: nothing crashes,
                                          the state diverges, and only the bitwise check
                                          against a fault-free run catches it)
``kill-coordinator@step=30``              SIGKILL the active coordinator at step 30 (its standby
                                          takes over; training does not stop)
``hang-coordinator@step=30``              SIGSTOP the active coordinator at step 30 (it is
                                          fenced off if it ever runs again)
``kill-coordinators@step=30``             SIGKILL the active coordinator and every standby at
                                          step 30: the job stops with a checkpoint of a step
                                          its ranks agree on (``inject`` refuses it: a stopped
                                          run has no end to compare; the tests resume it)
========================================  =====================================================

A node loss of node 0 (``kill-node:node=0``, ``partition:node=0``) takes the active coordinator
with it.

The faults a job should suffer are passed to its ranks as JSON in ``P2P_INJECT``; each rank arms
an :class:`Injector` on its protected job. Every fault fires once per job (a marker file in the
run directory), so the spare that takes a killed rank's place does not kill itself again.
Killing is a real ``SIGKILL`` (or ``SIGSTOP``) of the process, from inside it at the chosen
point: the rest of the job sees exactly what a crash or a hang looks like.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import re
import signal
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from launcher import lifetime
from launcher.protocol import ENV_AGENT_PID, ENV_INJECT
from recovery.phases import ANNOUNCED_PHASES

logger = logging.getLogger(__name__)


KINDS = (
    "kill",
    "hang",
    "kill-node",
    "partition",
    "kill-buddies",
    "during-replication",
    "during-recovery",
    "bitflip",
    "kill-coordinator",
    "hang-coordinator",
    "kill-coordinators",
)
#: Faults of a whole node: they name a node, not a rank.
NODE_KINDS = ("kill-node", "partition")
#: Faults of the control plane, not of a rank: they name no target.
COORDINATOR_KINDS = ("kill-coordinator", "hang-coordinator", "kill-coordinators")
STEP_PHASES = ("forward", "backward", "optimizer", "replication")
RECOVERY_PHASES = ANNOUNCED_PHASES
_SPEC = re.compile(
    r"^(?P<kind>[a-z-]+)(?::(?P<key>rank|node)=(?P<target>\d+))?@(?P<when>step|recovery)="
    r"(?P<at>\d+)"
    r"(?::phase=(?P<phase>[a-z]+))?$"
)


@dataclass(frozen=True, slots=True)
class Fault:
    """One fault to inject."""

    kind: str
    target: int
    """A rank, or a node for the :data:`NODE_KINDS`."""
    at: int
    """A step, or for ``during-recovery`` the ordinal of the recovery: K is the one into
    generation K + 1 (1 = the first)."""
    phase: str

    @property
    def id(self) -> str:
        """A stable name (marker files, reports)."""
        return f"{self.kind}-{self.target}-{self.at}-{self.phase}"

    @property
    def in_recovery(self) -> bool:
        """Whether it fires during a recovery (``at`` is then the recovery's ordinal)."""
        return self.kind == "during-recovery" or self.phase in RECOVERY_PHASES

    def __str__(self) -> str:
        if self.kind in COORDINATOR_KINDS:
            when = "recovery" if self.in_recovery else "step"
            return f"{self.kind}@{when}={self.at}:phase={self.phase}"
        key = "node" if self.kind in NODE_KINDS else "rank"
        when = "recovery" if self.kind == "during-recovery" else "step"
        return f"{self.kind}:{key}={self.target}@{when}={self.at}:phase={self.phase}"


def parse_fault(spec: str) -> Fault:
    """Parse one fault specification.

    Raises:
        ValueError: one line naming what is wrong and the accepted form.
    """
    m = _SPEC.match(spec.strip())
    usage = (
        "write kill:rank=R@step=S[:phase=forward|backward|optimizer|replication], "
        "hang:rank=R@step=S, kill-node:node=N@step=S, partition:node=N@step=S, "
        "kill-buddies:rank=R@step=S, "
        "during-replication:rank=R@step=S, during-recovery:rank=R@recovery=K[:phase=P], "
        "bitflip:rank=R@step=S, kill-coordinator@step=S, hang-coordinator@step=S, "
        "kill-coordinators@step=S "
        "(or @recovery=K[:phase=P]: in the middle of a recovery)"
    )
    if not m:
        raise ValueError(f"bad fault spec {spec!r}: {usage}")
    kind, key, when = m["kind"], m["key"], m["when"]
    if kind not in KINDS:
        raise ValueError(f"unknown fault kind {kind!r} in {spec!r}: {usage}")
    if (key is None) != (kind in COORDINATOR_KINDS):
        what = "names no rank or node" if kind in COORDINATOR_KINDS else "needs a target"
        raise ValueError(f"{kind} {what}: {usage}")
    if key is not None and (key == "node") != (kind in NODE_KINDS):
        raise ValueError(f"{kind} targets a {'node' if kind in NODE_KINDS else 'rank'}: {usage}")
    in_recovery = when == "recovery"
    if in_recovery != (kind == "during-recovery") and kind not in COORDINATOR_KINDS:
        raise ValueError(f"{kind} happens at a {'recovery' if when == 'step' else 'step'}: {usage}")
    phases = RECOVERY_PHASES if in_recovery else STEP_PHASES
    default = "plan" if in_recovery else {"during-replication": "replication"}.get(kind, "forward")
    phase = m["phase"] or default
    if phase not in phases:
        raise ValueError(f"phase {phase!r} of {spec!r} is not one of {', '.join(phases)}")
    if kind == "during-replication" and phase != "replication":
        raise ValueError(f"{spec!r}: during-replication always fires in the replication phase")
    at = int(m["at"])
    if at < 1:
        raise ValueError(f"{spec!r}: steps and recoveries count from 1")
    return Fault(kind, int(m["target"] or 0), at, phase)


def random_faults(
    num: int, *, seed: int, world_size: int, num_steps: int, first_step: int = 2
) -> list[Fault]:
    """``num`` kills and hangs of random ranks at distinct random steps (the chaos mode)."""
    if num < 0 or num_steps - first_step + 1 < num:
        raise ValueError(
            f"cannot place {num} faults at distinct steps between {first_step} and {num_steps}"
        )
    rng = random.Random(seed)
    steps = sorted(rng.sample(range(first_step, num_steps + 1), num))
    return [
        Fault(
            rng.choice(("kill", "kill", "hang")),
            rng.randrange(world_size),
            s,
            rng.choice(STEP_PHASES[:3]),
        )
        for s in steps
    ]


def to_env(faults: list[Fault]) -> str:
    """The value of ``P2P_INJECT`` for these faults."""
    return json.dumps([asdict(f) for f in faults])


def from_env(value: str | None = None) -> list[Fault]:
    """The faults in ``P2P_INJECT`` (none when it is unset)."""
    raw = os.environ.get(ENV_INJECT, "") if value is None else value
    return [Fault(**d) for d in json.loads(raw)] if raw else []


def _resume_after_takeover(pid: int, run_dir: Path, deadline_s: float = 120.0) -> None:
    """SIGCONT a hung coordinator once a standby has taken over: it must find itself fenced
    off (its term is older than everyone's) and change nothing."""
    from launcher.events import read_events

    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if any(e["event"] == "takeover" and "term" in e for e in read_events(run_dir)):
            break
        time.sleep(0.2)  # polls the job's event log; not a stand-in for a handshake
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def _coordinators(run_dir: Path) -> list[dict[str, Any]]:
    """What the active coordinator (``coordinator.json``) and every standby
    (``coordinator-<node>.json``) of the job in ``run_dir`` published, ``pid`` included."""
    found = []
    for path in sorted(run_dir.glob("coordinator*.json")):
        if re.fullmatch(r"coordinator(-[^.]+)?\.json", path.name):
            found.append(json.loads(path.read_text()))
    return found


def flip_top_mantissa_bit(t: Any) -> None:
    """Flip the top bit of the mantissa of ``t``'s first value, in place: the value changes by
    a quarter to a half of itself, which no later rounding absorbs (the lowest bit's one unit
    in the last place can vanish in the next multiplication)."""
    import torch

    mantissa_bits = round(-math.log2(torch.finfo(t.dtype).eps))
    as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    with torch.no_grad():
        t.reshape(-1)[:1].view(as_int).bitwise_xor_(1 << (mantissa_bits - 1))


class Injector:
    """Fires this rank's share of ``faults`` from the protected job's hooks.

    Args:
        faults: Every fault of the job (each rank decides which are its own).
        run_dir: Where the once-only markers go (the job's run directory).
        events: ``events(name, **fields)``: records ``fault_injected`` right before a fault
            fires (the bench's time zero for detection).
    """

    def __init__(self, faults: list[Fault], run_dir: str, events: Any) -> None:
        self.faults = faults
        self.markers = Path(run_dir) / "faults"
        self.markers.mkdir(parents=True, exist_ok=True)
        self._event = events
        self._job: Any = None
        self._step = 0
        self._last_rank = -1

    def arm(self, job: Any) -> None:
        """Attach to a :class:`recovery.job.ProtectedJob` (before its first step)."""
        self._job = job
        job.add_hook(self._on_hook)
        if job.model is not None:
            self._on_built(job.model, job.optimizer)

    # -- hook points ---------------------------------------------------------------------------

    def _on_hook(self, point: str, **info: Any) -> None:
        if point == "built":
            self._on_built(info["model"], info["optimizer"])
        elif point == "step_begin":
            self._step = info["step"]
            self._maybe("forward", self._step)
        elif point == "replication_chunk" and info["round"] == 0:
            self._maybe("replication", info["step"])
        elif point == "recovery_phase":
            self._maybe_recovery(info["phase"], info["generation"])

    def _on_built(self, model: Any, optimizer: Any) -> None:
        # Where this rank's process is, so a fault that takes several ranks down together can
        # kill them at the same instant (a rank cannot wait for its own trigger: the first
        # death interrupts it before it gets there).
        (self.markers / f"pid-rank{self._rank()}").write_text(str(os.getpid()))
        model.register_full_backward_pre_hook(lambda *_: self._maybe("backward", self._step))
        optimizer.register_step_pre_hook(lambda *_: self._maybe("optimizer", self._step))

    # -- firing --------------------------------------------------------------------------------

    def _rank(self) -> int:
        """This process's rank; between two generations (one whose groups could not be formed,
        the next one's not formed yet) there is no group, and it is the last rank it had."""
        import torch.distributed as dist

        if dist.is_initialized():
            self._last_rank = dist.get_rank()
        return self._last_rank

    def _mine(self, fault: Fault) -> bool:
        rank = self._rank()
        if fault.kind in COORDINATOR_KINDS:
            return rank == 0  # any rank would do: rank 0 always exists
        if fault.kind in NODE_KINDS:
            return int(os.environ.get("GROUP_RANK", "-1")) == fault.target
        if fault.kind == "kill-buddies":
            placement = self._job.replicator.placement if self._job.replicator else None
            buddies = placement.holders[fault.target] if placement else ()
            return rank == fault.target or rank in buddies
        return rank == fault.target

    def _maybe(self, phase: str, step: int) -> None:
        for fault in self.faults:
            if fault.in_recovery or fault.phase != phase or fault.at != step:
                continue
            if self._mine(fault):
                self._fire(fault)

    def _maybe_recovery(self, phase: str, generation: int) -> None:
        # Recovery K is the one into generation K + 1: every rank counts it the same, a spare
        # that joins in it and a survivor alike, and a recovery restarted by a fault during it
        # is the next one.
        ordinal = generation - 1
        for fault in self.faults:
            here = fault.in_recovery and (fault.phase, fault.at) == (phase, ordinal)
            if here and self._mine(fault):
                self._fire(fault)

    def _kill_together(self, fault: Fault) -> None:
        """SIGKILL every other victim of ``fault`` (marking it fired for them), then this rank."""
        placement = self._job.replicator.placement if self._job.replicator else None
        victims = {fault.target, *(placement.holders[fault.target] if placement else ())}
        for rank in sorted(victims - {self._rank()}):
            try:
                os.close(os.open(self.markers / f"{fault.id}-rank{rank}", os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                continue  # it fired itself already
            with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):
                os.kill(int((self.markers / f"pid-rank{rank}").read_text()), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    def _fire(self, fault: Fault) -> None:
        # One marker per rank for faults several ranks fire together (kill-buddies), one per
        # fault for a node loss (the first rank of the node to get there kills the agent).
        who = "" if fault.kind in NODE_KINDS else f"-rank{self._rank()}"
        marker = self.markers / f"{fault.id}{who}"
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return  # fired once already (this is the spare in the victim's place)
        self._event(
            "fault_injected",
            fault=str(fault),
            rank=self._rank(),
            pid=os.getpid(),
            t_fire=time.monotonic(),
        )
        logger.warning("injecting %s on rank %d", fault, self._rank())
        if fault.kind == "bitflip":
            param = next(iter(self._job.model.parameters()))
            flip_top_mantissa_bit(getattr(param, "_local_tensor", param))
        elif fault.kind == "kill-node":
            agent = int(os.environ.get(ENV_AGENT_PID, "0"))
            # The agent is the parent, or the grandparent through the node's fork server.
            if agent <= 1 or agent not in lifetime.ancestors()[:2]:
                raise RuntimeError(f"{fault} needs a rank started by p2p-run's agent")
            os.kill(agent, signal.SIGKILL)  # the node's agent; its children die with it
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.kind == "partition":
            from bench.netns import partition_this_node

            partition_this_node()  # the node's processes, this one included, run on cut off
        elif fault.kind == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif fault.kind == "kill-coordinators":
            for doc in _coordinators(self.markers.parent):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(doc["pid"]), signal.SIGKILL)
        elif fault.kind in COORDINATOR_KINDS:
            # The active coordinator of the job (the one node 0 started, until a takeover).
            doc = json.loads((self.markers.parent / "coordinator.json").read_text())
            pid = int(doc["pid"])
            if fault.kind == "kill-coordinator":
                os.kill(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGSTOP)
                threading.Thread(
                    target=_resume_after_takeover, args=(pid, self.markers.parent), daemon=True
                ).start()
        elif fault.kind == "kill-buddies":
            self._kill_together(fault)
        else:
            os.kill(os.getpid(), signal.SIGKILL)
