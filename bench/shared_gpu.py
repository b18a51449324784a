"""Run a training script in a process that NCCL takes for a host of its own, so ranks can share
a GPU.

NCCL refuses two ranks of one communicator on one GPU of one host ("Duplicate GPU detected"),
and emulated nodes on one machine put every node's local rank 0 on GPU 0. Given a host identity
of its own per process (``NCCL_HOSTID``), with NCCL's peer-to-peer and shared-memory transports
off, ranks on one GPU talk through NCCL's socket transport instead: real NCCL communicators,
collectives, errors and aborts, on a machine with fewer GPUs than ranks. Bandwidth measured
this way is the socket transport's, not NVLink's or the network's.

    p2p-bench inject --script bench/shared_gpu.py --fault kill:rank=3@step=6 -- examples/train.py
"""

from __future__ import annotations

import os
import runpy
import sys
import uuid

#: NCCL's own variables (read when a communicator is created).
NCCL_HOST_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_NET": "Socket"}


def become_a_host_of_its_own() -> str:
    """Give this process a host identity of its own for NCCL; call before any NCCL
    communicator is created. Returns the identity."""
    host = f"p2p-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    os.environ["NCCL_HOSTID"] = host
    os.environ.update(NCCL_HOST_ENV)
    return host


def main(argv: list[str] | None = None) -> None:
    """``python bench/shared_gpu.py SCRIPT [ARGS...]``: run ``SCRIPT`` as a host of its own."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or not os.path.isfile(argv[0]):
        print(
            "usage: shared_gpu.py SCRIPT [ARGS...]: the training script to run as a host of its "
            f"own{f' ({argv[0]!r} is not a file)' if argv else ''}",
            file=sys.stderr,
        )
        raise SystemExit(2)
    become_a_host_of_its_own()
    script = os.path.abspath(argv[0])
    sys.path.insert(0, os.path.dirname(script))  # as if the script had been run directly
    sys.argv = [script, *argv[1:]]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    del sys.path[0]  # bench/ itself: its modules must not shadow the script's imports
    main()
