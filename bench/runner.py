"""Run a protected training job to its end with faults injected, and compare it with another.

Jobs are :class:`launcher.testing.LocalJob`: one ``p2p-run`` process per emulated node on this
machine. :func:`run_script` runs a script with the faults armed through the engine's hooks and
collects what its ranks wrote; :func:`run_example` runs the example training job;
:func:`bitwise_differences` compares two runs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import probe
from bench.faults import Fault, to_env
from bench.workdir import fresh_run_dir
from launcher.protocol import ENV_INJECT, ENV_JOB_HOOKS, ENV_PROBE_DIR
from launcher.testing import LocalJob

#: The example training job (a checkout's ``examples/``; see README).
EXAMPLE = str(Path(__file__).resolve().parents[1] / "examples" / "train.py")
#: Runs a script as a host of its own to NCCL, so emulated nodes can share GPUs.
SHARED_GPU = str(Path(__file__).resolve().parent / "shared_gpu.py")
#: The environment of a run kept off the GPUs (on a GPU machine, emulated nodes would put two
#: ranks of one communicator on one GPU, which NCCL refuses).
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}


@dataclass
class JobOutcome:
    """A finished job: exit codes, each rank's ``rank<r>.json``, the event log."""

    job: LocalJob | None
    """The job's files (``None``: a fault-free reference reused from ``--reference-cache``)."""
    codes: list[int]
    results: dict[int, dict[str, Any]]
    wall_s: float

    def events(self, name: str | None = None, **match: Any) -> list[dict[str, Any]]:
        """Events of the job's log."""
        assert self.job is not None, "a kept reference has no event log"
        return self.job.events(name, **match)


def example_args(model: str, steps: int, cache_dir: str, out: Path) -> list[str]:
    """The flags both example scripts take for a run of ``steps`` steps writing to ``out``."""
    return ["--model", model, "--steps", str(steps), "--cache-dir", cache_dir, "--out", str(out)]


def run_example(
    run_dir: Path,
    *,
    model: str = "tiny",
    steps: int = 8,
    cache_dir: str | None = None,
    script_args: Sequence[str] = (),
    **kwargs: Any,
) -> JobOutcome:
    """Run the example training job to its end (see :func:`run_script` for the rest).

    Its ranks write their results themselves (``examples/train.py --out``): every step's loss
    besides its batch, and the final state's digest.
    """
    run_dir = Path(run_dir)
    out = run_dir / "out"
    args = [*example_args(model, steps, cache_dir or str(run_dir / "cache"), out), *script_args]
    return run_script(run_dir, script=EXAMPLE, script_args=args, results_dir=out, **kwargs)


def run_script(
    run_dir: Path,
    *,
    script: str,
    script_args: Sequence[str] = (),
    faults: Sequence[Fault] = (),
    nnodes: int = 2,
    nproc_per_node: int = 2,
    spares: Sequence[int] = (1, 0),
    results_dir: Path | None = None,
    launcher_args: Sequence[str] = (),
    timeout_s: float = 600.0,
    on_poll: Callable[[list[dict[str, Any]]], None] | None = None,
    env: Mapping[str, str] | None = None,
    device: str | None = None,
    **job_kwargs: Any,
) -> JobOutcome:
    """Run a protected training script under p2p-run to its end with ``faults`` injected.

    The faults are armed in every rank through the engine's ``P2P_JOB_HOOKS``
    (:mod:`bench.probe`), so the script needs no line for them. Each rank's results
    (``rank<r>.json``) are read from ``results_dir`` when the script writes them itself, or
    else recorded by the probe: every step's batch and the final state's digest. ``env`` is
    more environment for every process; hooks in its ``P2P_JOB_HOOKS`` follow the probe.
    ``device``: ``cpu`` hides the GPUs; ``cuda`` runs every process as a host of its own to
    NCCL (:mod:`bench.shared_gpu`) so the emulated nodes share this machine's GPUs; ``None``
    leaves the environment as it is.
    """
    run_dir = fresh_run_dir(run_dir)
    if device == "cuda":
        script, script_args = SHARED_GPU, [script, *script_args]
    extra, env = dict(env or {}), {ENV_JOB_HOOKS: probe.HOOK}
    if device == "cpu":
        env.update(CPU_ONLY)
    if extra.get(ENV_JOB_HOOKS):
        env[ENV_JOB_HOOKS] += f",{extra.pop(ENV_JOB_HOOKS)}"
    env.update(extra)
    if faults:
        env[ENV_INJECT] = to_env(list(faults))
    if results_dir is None:
        results_dir = run_dir / "probe"
        env[ENV_PROBE_DIR] = str(results_dir)
    t0 = time.monotonic()
    job = LocalJob(
        run_dir,
        nnodes=nnodes,
        nproc_per_node=nproc_per_node,
        spares=spares,
        script=script,
        script_args=script_args,
        launcher_args=launcher_args,
        env=env,
        **job_kwargs,
    )
    try:
        codes = job.wait(timeout_s, on_poll)
    finally:
        job.kill_everything()
    results = {
        int(p.stem.removeprefix("rank")): json.loads(p.read_text())
        for p in Path(results_dir).glob("rank*.json")
    }
    return JobOutcome(job, codes, results, time.monotonic() - t0)


def bitwise_differences(got: JobOutcome, want: JobOutcome) -> list[str]:
    """Where ``got`` differs from the fault-free ``want`` (empty: bitwise equal).

    Compares every rank's final state digest and, for every step a rank ran (redone steps
    included), its batch and loss.
    """
    problems = []
    if sorted(got.results) != sorted(want.results):
        problems.append(f"ranks {sorted(got.results)} finished, expected {sorted(want.results)}")
    for rank in sorted(set(got.results) & set(want.results)):
        a, b = got.results[rank], want.results[rank]
        if a.get("digest") != b.get("digest"):
            problems.append(f"rank {rank}'s final state differs")
        for step, record in a["steps"].items():
            if record != b["steps"].get(step):
                problems.append(f"rank {rank}, step {step} differs")
    return problems
