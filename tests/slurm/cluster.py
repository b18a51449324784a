"""A real Slurm cluster on this machine: one slurmctld and three slurmd "nodes" (n1..n3).

Everything lives under one temporary folder (state, spool, logs, pid files) and every daemon
listens on a free port picked at start, so several clusters never meet. ``auth/none`` and
``cred/none`` need no munge. :func:`start` raises :class:`Unavailable` with the reason when the
binaries are missing or the daemons do not come up; :meth:`Cluster.stop` ends exactly the
daemons it started, by their pid files.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from launcher.lifetime import alive

NODES = ("n1", "n2", "n3")
BINARIES = ("slurmctld", "slurmd", "srun", "sbatch", "scontrol", "sinfo", "squeue", "scancel")
_START_S = 30.0


class Unavailable(RuntimeError):
    """No local Slurm cluster can run here (the message says why)."""


def _free_ports(count: int) -> list[int]:
    # Held open together so the ports differ; closed right before the daemons bind them.
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _conf(root: Path, host: str, ports: list[int], first_job_id: int) -> str:
    ctld, slurmd, *node_ports = ports
    nodes = "\n".join(
        f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 CPUs=2 RealMemory=1000 "
        f"Port={p} State=UNKNOWN"
        for n, p in zip(NODES, node_ports)
    )
    return f"""ClusterName=p2ptest
FirstJobId={first_job_id}
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld}
SlurmdPort={slurmd}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=2
MinJobAge=300
{nodes}
PartitionName=debug Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""


class Cluster:
    """A running local cluster; ``env`` points Slurm's clients at it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *cmd: str, timeout: float = 30.0, check: bool = True) -> str:
        """Run a Slurm client command against this cluster; returns its stdout."""
        r = subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")
        return r.stdout

    def node_states(self) -> dict[str, str]:
        """``{node: state}`` as sinfo reports them (e.g. ``idle``, ``alloc``, ``down*``)."""
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False)
        return dict(line.split() for line in out.splitlines() if line.strip())

    def resume_all(self) -> None:
        """Bring every node back after a test marked one down."""
        for node, state in self.node_states().items():
            if "down" in state or "drain" in state:
                self.run("scontrol", "update", f"nodename={node}", "state=resume", check=False)

    def pids(self) -> list[int]:
        """Pids of the daemons this cluster started (from their pid files)."""
        out = []
        for f in (self.root / "run").glob("*.pid"):
            try:
                out.append(int(f.read_text().strip()))
            except (OSError, ValueError):
                pass
        return out

    def logs(self) -> str:
        """The tail of every daemon log (for a failure's report)."""
        parts = []
        for f in sorted((self.root / "log").glob("*.log")):
            lines = f.read_text(errors="replace").splitlines()[-15:]
            parts.append(f"== {f.name}\n" + "\n".join(lines))
        return "\n".join(parts)

    def stop(self) -> None:
        """SIGTERM the daemons, SIGKILL what is left after a few seconds."""
        pids = self.pids()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(alive(p) for p in pids):
            time.sleep(0.1)
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def start(root: Path) -> Cluster:
    """Start slurmctld and three slurmd under ``root``; wait until every node is idle.

    Raises:
        Unavailable: a binary is missing, this is not root, or a daemon does not come up.
    """
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        raise Unavailable(
            f"Slurm binaries not found ({', '.join(missing)}): install slurmctld slurmd "
            "slurm-client (as .ci/run does) to run the Slurm tier"
        )
    if os.geteuid() != 0:
        raise Unavailable("a local Slurm cluster needs root (SlurmUser=root, auth/none)")
    for sub in ("state", "log", "run", *(f"spool/{n}" for n in NODES)):
        (root / sub).mkdir(parents=True, exist_ok=True)
    cluster = Cluster(root)
    # Job ids (and so the coordinator ports p2p-run derives from them) differ between runs.
    first_job_id = random.randrange(1000, 1_000_000)
    cluster.conf.write_text(
        _conf(root, socket.gethostname(), _free_ports(2 + len(NODES)), first_job_id)
    )
    try:
        subprocess.run(
            ["slurmctld", "-i", "-f", str(cluster.conf)],
            env=cluster.env,
            check=True,
            timeout=_START_S,
            capture_output=True,
        )
        for node in NODES:
            subprocess.run(
                ["slurmd", "-N", node, "-f", str(cluster.conf)],
                env=cluster.env,
                check=True,
                timeout=_START_S,
                capture_output=True,
            )
        deadline = time.monotonic() + _START_S
        while set(cluster.node_states().values()) != {"idle"}:
            if time.monotonic() > deadline:
                raise Unavailable(
                    f"the Slurm nodes did not become idle within {_START_S:.0f}s "
                    f"({cluster.node_states()}):\n{cluster.logs()}"
                )
            time.sleep(0.2)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        cluster.stop()
        raise Unavailable(f"a Slurm daemon did not start ({e}):\n{cluster.logs()}") from None
    except BaseException:
        cluster.stop()
        raise
    return cluster
