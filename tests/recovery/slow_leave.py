"""A survivor held up leaving its generation: ``P2P_JOB_HOOKS=tests.recovery.slow_leave:attach``.

With ``P2P_SLOW_LEAVE=<rank>:<seconds>``, that rank of the first generation, the first time it
leaves a generation's groups, stays in destroying them that long: as survivors did on an H100,
where destroying an aborted NCCL group joined a watchdog asleep for a flight-recorder dump. Its
heartbeats go on (another thread sends them), so only the generation it holds up can tell.
"""

from __future__ import annotations

import os
import time
from typing import Any

from launcher.protocol import ENV_ROLE

ENV_SLOW_LEAVE = "P2P_SLOW_LEAVE"


def attach(job: Any) -> None:
    """Slow down the first :meth:`recovery.comms.Comms.destroy` of the rank named."""
    import torch.distributed as dist

    from recovery import comms

    spec = os.environ.get(ENV_SLOW_LEAVE, "")
    if not spec or os.environ.get(ENV_ROLE) == "spare":
        return
    rank, seconds = spec.split(":")
    if dist.get_rank() != int(rank):
        return
    destroy = comms.Comms.destroy
    held: list[float] = []

    def slow_destroy(self: Any) -> None:
        if not held:
            held.append(float(seconds))
            print(f"rank {rank}: held up leaving the generation for {seconds}s", flush=True)
            time.sleep(float(seconds))  # the fault itself: a leave that takes this long
        destroy(self)

    comms.Comms.destroy = slow_destroy  # type: ignore[method-assign]
