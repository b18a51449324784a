"""Run the example training job under p2p-run with faults, and compare it with a fault-free run."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.faults import parse_fault, to_env
from tests.jobs import EXAMPLE, Job

NUM_STEPS = 8
JOB_DEADLINE_S = 240.0


@dataclass
class Outcome:
    """A finished example job: exit codes of its p2p-run processes and each rank's results."""

    job: Job
    codes: list[int]
    results: dict[int, dict]

    def events(self, name: str | None = None, **match):
        return self.job.events(name, **match)


def run_example(
    run_dir: Path,
    cache_dir: Path,
    *,
    faults: tuple[str, ...] = (),
    spares: tuple[int, int] = (1, 0),
    launcher_args: tuple[str, ...] = (),
    steps: int = NUM_STEPS,
) -> Outcome:
    """The example job on 2 emulated nodes x 2 ranks, with ``faults`` injected."""
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / "out"
    job = Job(
        run_dir,
        2,
        2,
        list(spares),
        ["--steps", str(steps), "--cache-dir", str(cache_dir), "--out", str(out)],
        list(launcher_args),
        EXAMPLE,
        {"P2P_INJECT": to_env([parse_fault(f) for f in faults])} if faults else {},
    )
    try:
        codes = job.wait(JOB_DEADLINE_S)
    finally:
        job.kill_everything()
    results = {
        int(p.stem.removeprefix("rank")): json.loads(p.read_text()) for p in out.glob("rank*.json")
    }
    return Outcome(job, codes, results)


def assert_bitwise(outcome: Outcome, reference: Outcome, num_steps: int = NUM_STEPS) -> None:
    """Every rank ends with the reference's exact state, and every step it ran (the redone ones
    included) saw the reference's batch and loss; the last rank of each place ran to the end."""
    assert outcome.codes == [0, 0], outcome.job.output(0)[-3000:]
    assert sorted(outcome.results) == sorted(reference.results) == [0, 1, 2, 3]
    for rank, got in outcome.results.items():
        want = reference.results[rank]
        assert got["digest"] == want["digest"], f"rank {rank}'s final state differs"
        assert got["steps"], f"rank {rank} recorded no step"
        for step, record in got["steps"].items():
            assert record == want["steps"][step], f"rank {rank}, step {step} differs"
        assert max(map(int, got["steps"])) == num_steps


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def reference(tmp_path_factory, data_cache) -> Outcome:
    """The same job with no fault."""
    outcome = run_example(tmp_path_factory.mktemp("reference"), data_cache, spares=(0, 0))
    assert outcome.codes == [0, 0], outcome.job.output(0)[-3000:]
    assert all(len(r["steps"]) == NUM_STEPS for r in outcome.results.values())
    return outcome
