"""A job's shape from Slurm: what ``p2p-run`` reads when it runs inside an allocation.

Pure functions of the flags given and the environment Slurm sets, tested without Slurm; the one
effect (asking ``scontrol`` for a node's address) is passed in. Any flag given wins; otherwise a
setting comes from ``SLURM_*``, otherwise from the launcher's default, and every resolved
setting remembers which (``p2p-run --print-config``).

The launch this is made for is one ``p2p-run`` task per node, one ``srun`` step per node (so a
node can be lost without losing the others' steps)::

    srun --no-kill -N1 -n1 -w n1 p2p-run --spares 1 train.py &
    srun --no-kill -N1 -n1 -w n2 p2p-run --spares 1 train.py &

Inside a one-node step ``SLURM_NNODES`` is 1 and ``SLURM_NODEID`` is 0 on every node, so the
job's size comes from ``SLURM_JOB_NUM_NODES`` and a node's rank from the place of its name
(``SLURMD_NODENAME``) in ``SLURM_JOB_NODELIST``, which are the allocation's on every step.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import socket
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from launcher.config import setting

# The variables Slurm sets that p2p-run reads.
SLURM_JOB_ID = "SLURM_JOB_ID"
SLURM_JOB_NUM_NODES = "SLURM_JOB_NUM_NODES"
SLURM_NNODES = "SLURM_NNODES"
SLURM_JOB_NODELIST = "SLURM_JOB_NODELIST"
SLURMD_NODENAME = "SLURMD_NODENAME"
SLURM_NODEID = "SLURM_NODEID"
SLURM_STEP_ID = "SLURM_STEP_ID"
SLURM_GPUS_ON_NODE = "SLURM_GPUS_ON_NODE"
SLURM_NTASKS_PER_NODE = "SLURM_NTASKS_PER_NODE"

#: The coordinator's port, when no flag names it, is derived from the job id so that every
#: node computes the same one without talking, and two jobs sharing a node rarely collide.
PORT_BASE = 29500
PORT_SPAN = 2000
#: torchrun's default ``--master-port``.
MASTER_PORT = 29500
#: A host list expanding to more names than this is refused (a typo like ``n[1-999999999]``).
MAX_HOSTS = 1_000_000

FLAG = "flag"
DEFAULT = "default"

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


# -- host lists -----------------------------------------------------------------------------------


def _split_top(text: str, what: str) -> list[str]:
    """Split at the commas outside brackets; refuses unbalanced or nested brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            if depth:
                raise ValueError(f"host list {what!r} has nested brackets")
            depth = 1
        elif ch == "]":
            if not depth:
                raise ValueError(f"host list {what!r} has a ']' without its '['")
            depth = 0
        elif ch == "," and not depth:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"host list {what!r} has a '[' without its ']'")
    parts.append(text[start:])
    return parts


def _expand_brackets(body: str, what: str) -> list[str]:
    """``1-3,07`` -> ``['1', '2', '3', '07']`` (a range keeps its low bound's zero padding)."""
    out: list[str] = []
    for item in body.split(","):
        m = _RANGE.fullmatch(item)
        if m is None:
            raise ValueError(f"host list {what!r}: {item!r} is not a number or a range a-b")
        lo_text, hi_text = m.group(1), m.group(2)
        lo = int(lo_text)
        hi = lo if hi_text is None else int(hi_text)
        if hi < lo:
            raise ValueError(f"host list {what!r}: range {item!r} runs backwards")
        if len(out) + hi - lo + 1 > MAX_HOSTS:
            raise ValueError(f"host list {what!r} names more than {MAX_HOSTS} hosts")
        width = len(lo_text)
        out += [f"{n:0{width}d}" for n in range(lo, hi + 1)]
    return out


def expand_hostlist(text: str) -> list[str]:
    """Expand a host list as Slurm writes them, in order.

    ``n[1-3,7],gpu-[01-02]a,x`` -> ``n1 n2 n3 n7 gpu-01a gpu-02a x``. A range keeps the zero
    padding of its low bound; several brackets in one name expand to every combination
    (``r[1-2]n[1-2]`` -> ``r1n1 r1n2 r2n1 r2n2``, the last bracket varying fastest).

    Raises:
        ValueError: the text is not a host list (the message names the part that is wrong).
    """
    text = text.strip()
    if not text:
        raise ValueError("the host list is empty")
    hosts: list[str] = []
    for entry in _split_top(text, text):
        if not entry:
            raise ValueError(f"host list {text!r} has an empty entry")
        # [literal, bracket body, literal, bracket body, ..., literal]
        pieces = re.split(r"\[([^\]]*)\]", entry)
        names = [pieces[0]]
        for body, literal in zip(pieces[1::2], pieces[2::2]):
            if not body:
                raise ValueError(f"host list {text!r} has empty brackets")
            names = [n + s + literal for n in names for s in _expand_brackets(body, text)]
            if len(hosts) + len(names) > MAX_HOSTS:
                raise ValueError(f"host list {text!r} names more than {MAX_HOSTS} hosts")
        hosts += names
    return hosts


def compress_hostlist(hosts: Sequence[str]) -> str:
    """A Slurm host list of ``hosts`` with runs of numbers in brackets, order kept: the
    inverse of :func:`expand_hostlist` for names without brackets or commas."""
    entries: list[str] = []
    i = 0
    while i < len(hosts):
        m = re.fullmatch(r"(.*?)(\d+)", hosts[i])
        if m is None:
            entries.append(hosts[i])
            i += 1
            continue
        prefix = m.group(1)
        # Consecutive names with this prefix go into one bracket: a number one above the last
        # that prints back the same with its run's padding extends the run, others start one.
        runs: list[tuple[str, str]] = []  # (low as written, high as written)
        while i < len(hosts):
            m = re.fullmatch(re.escape(prefix) + r"(\d+)", hosts[i])
            if m is None:
                break
            digits = m.group(1)
            if runs:
                low, high = runs[-1]
                n = int(high) + 1
                if int(digits) == n and f"{n:0{len(low)}d}" == digits:
                    runs[-1] = (low, digits)
                    i += 1
                    continue
            runs.append((digits, digits))
            i += 1
        parts = [low if low == high else f"{low}-{high}" for low, high in runs]
        if len(parts) == 1 and "-" not in parts[0]:
            entries.append(prefix + parts[0])
        else:
            entries.append(f"{prefix}[{','.join(parts)}]")
    return ",".join(entries)


# -- resolution ----------------------------------------------------------------------------------


#: torchrun's words for ``--nproc-per-node`` (counted on the node: ``launcher.cli``).
NPROC_WORDS = ("gpu", "cpu", "auto")


def nproc_value(text: str) -> int | str:
    """``--nproc-per-node``: a number, or one of :data:`NPROC_WORDS`.

    Raises:
        argparse.ArgumentTypeError: neither.
    """
    if text in NPROC_WORDS:
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of ranks, nor gpu, cpu or auto"
        ) from None


@dataclass(frozen=True, slots=True)
class Flags:
    """The settings given on the command line (``None``: not given)."""

    nnodes: str | None = setting(
        None,
        flag="--nnodes",
        help="number of nodes, or MIN:MAX (start with MIN, nodes up to MAX may join) "
        "(default: SLURM_JOB_NUM_NODES, else 1)",
    )
    """``N`` or torchrun's ``MIN:MAX``."""
    node_rank: int | None = setting(
        None,
        flag=("--node-rank", "--node_rank"),
        help="this node's rank (default: its place in SLURM_JOB_NODELIST, else 0)",
    )
    nproc_per_node: int | None = setting(
        None,
        flag=("--nproc-per-node", "--nproc_per_node"),
        help="rank processes per node, or torchrun's gpu (the node's GPUs less --spares), "
        "cpu or auto (default: SLURM_GPUS_ON_NODE less --spares, else 1)",
        type=nproc_value,
    )
    """A number; p2p-run turns ``gpu``, ``cpu`` and ``auto`` into one before resolving."""
    coordinator: str | None = setting(
        None,
        flag="--coordinator",
        help="host:port of the coordinator; node 0 starts one there (port 0: any) "
        "(default: the first host of SLURM_JOB_NODELIST, port from the job id)",
    )
    rdzv_endpoint: str | None = setting(
        None,
        flag=("--rdzv-endpoint", "--rdzv_endpoint"),
        help="torchrun's name for --coordinator",
    )
    master_addr: str | None = setting(
        None,
        flag=("--master-addr", "--master_addr"),
        help="torchrun's static rendezvous, node 0's address: --coordinator "
        "MASTER_ADDR:MASTER_PORT",
    )
    master_port: int | None = setting(
        None,
        flag=("--master-port", "--master_port"),
        help=f"with --master-addr (default {MASTER_PORT}, or 127.0.0.1 without it)",
    )
    standalone: bool = setting(
        False,
        flag="--standalone",
        help="one node on this machine with a coordinator of its own, as torchrun's: "
        "--nnodes 1 --node-rank 0, the coordinator on 127.0.0.1 at any free port, whatever "
        "SLURM_* says",
    )
    job_id: str | None = setting(
        None,
        flag=("--job-id", "--rdzv-id", "--rdzv_id"),
        help="job name (default: SLURM_JOB_ID, else p2p-job)",
    )
    run_dir: str | None = setting(
        None,
        flag="--run-dir",
        help="directory for the event log, secret and coordinator address, shared by every "
        "node (default runs/<job-id>)",
    )
    max_ranks: int | None = None
    """``--max-ranks`` (declared by :class:`launcher.policy.ElasticConfig`)."""
    spares: int = setting(
        0,
        flag="--spares",
        help="hot spare processes on this node (default {default})",
        flag_default=None,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Resolved:
    """The job's shape for this node, and where each setting came from."""

    nnodes: int
    node_rank: int
    nproc_per_node: int
    coordinator: str | None
    """``host:port``; ``None``: node 0 starts one on 127.0.0.1 with any port."""
    job_id: str
    run_dir: str
    max_ranks: int | None
    """From ``--nnodes MIN:MAX`` (MAX nodes' ranks) or ``--max-ranks``; ``None``: the start size."""
    sources: dict[str, str] = field(default_factory=dict)


def _int(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        # Slurm writes some counts as e.g. "2(x3)"; these are not the ones read here.
        raise ValueError(f"{name}={raw!r} is not a number; unset it or pass the flag") from None


def _nnodes_flag(text: str) -> tuple[int, int | None]:
    low, sep, high = text.partition(":")
    try:
        start = int(low)
        most = int(high) if sep else None
    except ValueError:
        raise ValueError(f"--nnodes {text!r} is not N or MIN:MAX") from None
    if start < 1 or (most is not None and most < start):
        raise ValueError(f"--nnodes {text!r}: need 1 <= MIN <= MAX")
    return start, most


def default_port(job_id: str) -> int:
    """The coordinator port of a Slurm job when no flag gives one (same on every node)."""
    digits = int(job_id) if job_id.isdigit() else sum(job_id.encode())
    return PORT_BASE + digits % PORT_SPAN


def resolve(
    flags: Flags,
    environ: Mapping[str, str],
    node_address: Callable[[str], str] = lambda name: name,
) -> Resolved:
    """The job's shape: a flag given wins, then ``SLURM_*`` inside an allocation, then defaults.

    Args:
        flags: What the command line gave.
        environ: The environment (``os.environ``).
        node_address: Maps a Slurm node name to an address to connect to (its ``NodeAddr``).

    Raises:
        ValueError: a flag or a Slurm variable does not make sense (one line with the fix).
    """
    if flags.standalone:
        return _standalone(flags, environ)
    src: dict[str, str] = {}
    slurm = SLURM_JOB_ID in environ
    in_step = slurm and SLURM_STEP_ID in environ

    # nnodes (and torchrun's MIN:MAX: start with MIN nodes, nodes up to MAX may join).
    most_nodes = None
    if flags.nnodes is not None:
        nnodes, most_nodes = _nnodes_flag(flags.nnodes)
        src["nnodes"] = FLAG
    elif slurm and _int(environ, SLURM_JOB_NUM_NODES) is not None:
        nnodes = _int(environ, SLURM_JOB_NUM_NODES) or 1
        src["nnodes"] = SLURM_JOB_NUM_NODES
    elif slurm and _int(environ, SLURM_NNODES) is not None:
        nnodes = _int(environ, SLURM_NNODES) or 1
        src["nnodes"] = SLURM_NNODES
    else:
        nnodes = 1
        src["nnodes"] = DEFAULT

    hosts: list[str] = []
    if slurm and environ.get(SLURM_JOB_NODELIST):
        hosts = expand_hostlist(environ[SLURM_JOB_NODELIST])

    # node rank: this node's place in the allocation's node list.
    if flags.node_rank is not None:
        node_rank = flags.node_rank
        src["node_rank"] = FLAG
    elif slurm and environ.get(SLURMD_NODENAME) and hosts:
        name = environ[SLURMD_NODENAME]
        if name not in hosts:
            raise ValueError(
                f"{SLURMD_NODENAME}={name} is not in {SLURM_JOB_NODELIST}="
                f"{environ[SLURM_JOB_NODELIST]}; pass --node-rank"
            )
        node_rank = hosts.index(name)
        src["node_rank"] = f"{SLURMD_NODENAME}={name} in {SLURM_JOB_NODELIST}"
    elif slurm and _int(environ, SLURM_NODEID) is not None:
        node_rank = _int(environ, SLURM_NODEID) or 0
        src["node_rank"] = SLURM_NODEID
    else:
        node_rank = 0
        src["node_rank"] = DEFAULT

    # ranks per node: the node's GPUs less its spares (a spare needs a device too), or the
    # allocation's tasks per node when p2p-run itself is not one of a step's tasks.
    gpus = _int(environ, SLURM_GPUS_ON_NODE) if slurm else None
    tasks = _int(environ, SLURM_NTASKS_PER_NODE) if slurm else None
    if in_step and tasks is not None and tasks > 1 and flags.node_rank is None:
        raise ValueError(
            f"{SLURM_NTASKS_PER_NODE}={tasks}: p2p-run starts a node's ranks itself; run one "
            "task per node (srun --ntasks-per-node=1) and give --nproc-per-node"
        )
    if flags.nproc_per_node is not None:
        nproc = flags.nproc_per_node
        src["nproc_per_node"] = FLAG
    elif gpus:
        nproc = gpus - flags.spares
        if nproc < 1:
            raise ValueError(
                f"{SLURM_GPUS_ON_NODE}={gpus} leaves no GPU for a rank beside --spares "
                f"{flags.spares}; pass --nproc-per-node or fewer --spares"
            )
        src["nproc_per_node"] = f"{SLURM_GPUS_ON_NODE}={gpus} less --spares {flags.spares}"
    elif not in_step and tasks:
        nproc = tasks
        src["nproc_per_node"] = SLURM_NTASKS_PER_NODE
    else:
        nproc = 1
        src["nproc_per_node"] = DEFAULT

    # job id and run dir.
    if flags.job_id is not None:
        job_id = flags.job_id
        src["job_id"] = FLAG
    elif slurm and environ[SLURM_JOB_ID]:
        job_id = environ[SLURM_JOB_ID]
        src["job_id"] = SLURM_JOB_ID
    else:
        job_id = "p2p-job"
        src["job_id"] = DEFAULT
    if flags.run_dir is not None:
        run_dir = flags.run_dir
        src["run_dir"] = FLAG
    else:
        run_dir = str(Path("runs") / job_id)
        src["run_dir"] = f"runs/<job_id> ({src['job_id']})"

    # coordinator: a flag, else the allocation's first node.
    master = None
    if flags.master_addr is not None or flags.master_port is not None:
        master = f"{flags.master_addr or '127.0.0.1'}:{flags.master_port or MASTER_PORT}"
    given = [
        (n, v)
        for n, v in (
            ("--coordinator", flags.coordinator),
            ("--rdzv-endpoint", flags.rdzv_endpoint),
            ("--master-addr/--master-port", master),
        )
        if v is not None
    ]
    for name, value in given[1:]:
        if value != given[0][1]:
            raise ValueError(f"{given[0][0]} {given[0][1]} and {name} {value} differ; give one")
    if given:
        coordinator = given[0][1]
        src["coordinator"] = FLAG
    elif hosts:
        first = hosts[0]
        coordinator = f"{node_address(first)}:{default_port(job_id)}"
        src["coordinator"] = (
            f"first host {first} of {SLURM_JOB_NODELIST}, port from {src['job_id']}"
        )
    else:
        coordinator = None
        src["coordinator"] = DEFAULT

    if flags.max_ranks is not None:
        max_ranks = flags.max_ranks
        src["max_ranks"] = FLAG
    elif most_nodes is not None:
        max_ranks = most_nodes * nproc
        src["max_ranks"] = "--nnodes MIN:MAX (MAX x nproc_per_node)"
    else:
        max_ranks = None
        src["max_ranks"] = DEFAULT
    return Resolved(
        nnodes=nnodes,
        node_rank=node_rank,
        nproc_per_node=nproc,
        coordinator=coordinator,
        job_id=job_id,
        run_dir=run_dir,
        max_ranks=max_ranks,
        sources=src,
    )


def _standalone(flags: Flags, environ: Mapping[str, str]) -> Resolved:
    """``--standalone``: one node with a coordinator of its own on this machine.

    Raises:
        ValueError: a flag asks for another node or another coordinator.
    """
    clash = [
        f"{name} {value}"
        for name, value, alone in (
            ("--nnodes", flags.nnodes, "1"),
            ("--node-rank", flags.node_rank, 0),
            ("--coordinator", flags.coordinator, None),
            ("--rdzv-endpoint", flags.rdzv_endpoint, None),
            ("--master-addr", flags.master_addr, None),
            ("--master-port", flags.master_port, None),
        )
        if value is not None and value != alone
    ]
    if clash:
        raise ValueError(
            f"--standalone runs one node with a coordinator of its own on this machine: drop "
            f"{', '.join(clash)} (or --standalone)"
        )
    # Everything but the shape still comes from the flags, SLURM_* and the defaults.
    alone = dataclasses.replace(flags, standalone=False, nnodes="1", node_rank=0)
    resolved = resolve(alone, {k: v for k, v in environ.items() if k != SLURM_JOB_NODELIST})
    sources = {**resolved.sources, "nnodes": "--standalone", "node_rank": "--standalone"}
    sources["coordinator"] = "--standalone"
    return dataclasses.replace(resolved, sources=sources)


def format_config(resolved: Resolved, extra: Mapping[str, tuple[object, str]] | None = None) -> str:
    """The resolved settings as a table: name, value, where it came from."""
    rows = [
        ("nnodes", resolved.nnodes),
        ("node_rank", resolved.node_rank),
        ("nproc_per_node", resolved.nproc_per_node),
        ("coordinator", resolved.coordinator or "127.0.0.1:<any> (started by node 0)"),
        ("job_id", resolved.job_id),
        ("run_dir", resolved.run_dir),
        ("max_ranks", resolved.max_ranks if resolved.max_ranks is not None else "start size"),
    ]
    lines = [f"{n:<15} {v!s:<32} {resolved.sources[n]}" for n, v in rows]
    lines += [f"{n:<15} {v!s:<32} {s}" for n, (v, s) in (extra or {}).items()]
    return "\n".join(lines)


def node_address(name: str, timeout_s: float = 10.0) -> str:
    """An IP address for Slurm node ``name``: its ``NodeAddr`` from ``scontrol``, else DNS.

    Node names need not resolve (several slurmd on one host, or names only Slurm knows);
    ``NodeAddr`` is the address Slurm itself reaches the node at. Falls back to ``name``.
    """
    address = name
    try:
        r = subprocess.run(
            ["scontrol", "show", "node", "-o", name],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        m = re.search(r"\bNodeAddr=(\S+)", r.stdout) if r.returncode == 0 else None
        if m:
            address = m.group(1)
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        # An AF_INET socket address is (host, port): its host is a str.
        return str(socket.getaddrinfo(address, None, socket.AF_INET)[0][4][0])
    except OSError:
        return address
