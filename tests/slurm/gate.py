"""Gates in a protected job for the Slurm tests: ``P2P_JOB_HOOKS=tests.slurm.gate:attach``.

With ``P2P_GATES=2,4,6`` every rank, before steps 2, 4 and 6, writes
``<run-dir>/gates/at<k>.r<rank>``
and waits until the test creates ``<run-dir>/gates/go<k>`` (or a new generation interrupts it,
or ``P2P_GATE_TIMEOUT`` seconds pass). The test so injects each fault while the training is
known to be running, at a known step, whatever the machine's speed. A rank that rolls back past
a gate passes it at once (its ``go`` file is there).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

ENV_GATES = "P2P_GATES"
ENV_GATE_TIMEOUT = "P2P_GATE_TIMEOUT"
_POLL_S = 0.05


def attach(job: Any) -> None:
    """Add the gate hook to a protected job."""
    import torch.distributed as dist

    import recovery.api

    gates = {int(k) for k in os.environ.get(ENV_GATES, "").split(",") if k}
    folder = Path(os.environ.get("P2P_RUN_DIR", ".")) / "gates"
    folder.mkdir(parents=True, exist_ok=True)
    timeout_s = float(os.environ.get(ENV_GATE_TIMEOUT, "120"))
    session = recovery.api.current_session()

    def hook(point: str, **info: Any) -> None:
        if point != "step_begin" or info["step"] not in gates:
            return
        step = info["step"]
        go = folder / f"go{step}"
        if go.exists():
            return
        (folder / f"at{step}.r{dist.get_rank()}").touch()  # a promoted spare's rank too
        deadline = time.monotonic() + timeout_s
        while not go.exists() and not session.interrupted and time.monotonic() < deadline:
            time.sleep(_POLL_S)

    job.add_hook(hook)
