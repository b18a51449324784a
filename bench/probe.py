"""What ``p2p-bench`` attaches to a protected job it runs, through the engine's ``P2P_JOB_HOOKS``.

Every rank of a job started with ``P2P_JOB_HOOKS=bench.probe:attach`` gets

- the fault injector (:class:`bench.faults.Injector`) armed with the faults of ``P2P_INJECT``;
- with ``P2P_PROBE_DIR`` set, a record of its run for the bitwise check: a fingerprint of every
  step's batch (a redone step overwrites its first attempt) and, when the loop ends cleanly, the
  digest of its final state (parameters, optimizer state, RNG, scheduler, and what the loop
  carries beside them: ``job.user_state``, the loader's position, the stateful objects), written to
  ``<dir>/rank<r>.json`` in the format :func:`bench.runner.bitwise_differences` compares.

This is how ``p2p-bench inject --script`` measures a training script it knows nothing about:
the script only has to be protected (``p2p_state.protect``); no line of it changes.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bench.faults import Injector, from_env
from launcher.protocol import ENV_PROBE_DIR, ENV_RUN_DIR

#: The value of ``P2P_JOB_HOOKS`` that attaches this module.
HOOK = "bench.probe:attach"


def attach(job: Any) -> None:
    """Arm the faults of ``P2P_INJECT`` and the record of ``P2P_PROBE_DIR`` on ``job``."""
    import recovery.api

    faults = from_env()
    if faults:
        session = recovery.api.current_session()
        assert session is not None  # the job calls its hooks inside its session
        Injector(faults, os.environ.get(ENV_RUN_DIR, "."), session.event).arm(job)
    out = os.environ.get(ENV_PROBE_DIR)
    if out:
        job.add_hook(Recorder(Path(out)))


def fingerprint(batch: Any) -> str | None:
    """A short hash of a batch: its tensors' bytes, dtypes and shapes, whatever nests them."""
    if batch is None:
        return None
    h = hashlib.sha256()
    _feed(h, batch)
    return h.hexdigest()[:16]


def _feed(h: Any, value: Any) -> None:
    import torch

    if isinstance(value, torch.Tensor):
        local = getattr(value, "_local_tensor", value).detach().cpu().contiguous()
        h.update(f"{local.dtype}{tuple(local.shape)}".encode())
        h.update(local.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, Mapping):
        for key in sorted(value, key=str):
            h.update(str(key).encode())
            _feed(h, value[key])
    elif isinstance(value, (list, tuple)):
        for item in value:
            _feed(h, item)
    else:
        h.update(repr(value).encode())


class Recorder:
    """A job hook writing this rank's batches and final digest to ``<out>/rank<r>.json``."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.steps: dict[int, dict[str, Any]] = {}

    def __call__(self, point: str, **info: Any) -> None:
        if point == "step_begin":
            self.steps[info["step"]] = {"batch": fingerprint(info.get("batch"))}
        elif point == "finished":
            self._write(info["step"], final_digest(info["state"], info["extras"]))

    def _write(self, step: int, digest: str) -> None:
        import torch.distributed as dist

        write_results(
            self.out,
            dist.get_rank(),
            dist.get_world_size(),
            self.steps,
            step=step,
            digest=digest,
        )


def final_digest(state: Any, extras: Mapping[str, Any]) -> str:
    """The digest of a rank's final state (:meth:`p2p_state.state.TrainingState.digest`) and of
    the extras its snapshots carry (``user_state``, the loader's state, the stateful objects')."""
    from p2p_state.state import pack_small

    h = hashlib.sha256(state.digest().encode())
    h.update(pack_small(dict(extras)))
    return h.hexdigest()


def write_results(
    out: Path, rank: int, world_size: int, steps: Mapping[int, Any], **fields: Any
) -> None:
    """``<out>/rank<r>.json``, atomically: what :func:`bench.runner.bitwise_differences` reads
    (``steps``: a record per step; ``fields``: at least the final state's ``digest``)."""
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "rank": rank,
        "world_size": world_size,
        "steps": {str(k): v for k, v in sorted(steps.items())},
        **fields,
    }
    tmp = out / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(doc))
    tmp.replace(out / f"rank{rank}.json")
