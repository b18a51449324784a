"""Run the example training job under p2p-run with faults, and compare it with a fault-free run;
a gloo world of one in this process for the engine's pieces that need a real group."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from bench.faults import parse_fault
from bench.runner import JobOutcome, bitwise_differences, run_example

NUM_STEPS = 8
JOB_DEADLINE_S = 240.0


def run(
    run_dir: Path,
    cache_dir: Path,
    *,
    faults: tuple[str, ...] = (),
    spares: tuple[int, int] = (1, 0),
    launcher_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> JobOutcome:
    """The example job (tiny model) on 2 emulated nodes x 2 ranks, with ``faults`` injected."""
    return run_example(
        run_dir,
        steps=NUM_STEPS,
        faults=[parse_fault(f) for f in faults],
        spares=spares,
        cache_dir=str(cache_dir),
        launcher_args=launcher_args,
        env=env,
        timeout_s=JOB_DEADLINE_S,
        heartbeat_interval_s=0.1,
        heartbeat_timeout_s=3.0,
    )


def assert_bitwise(
    outcome: JobOutcome, reference: JobOutcome, *, killed_nodes: tuple[int, ...] = ()
) -> None:
    """Every rank ends with the reference's exact state, every step it ran (redone ones
    included) saw the reference's batch and loss, and every place ran to the last step. The
    launchers of ``killed_nodes`` died with a SIGKILL; every other one ended cleanly."""
    expected = [-9 if n in killed_nodes else 0 for n in range(2)]
    assert outcome.codes == expected, outcome.job.output(0)[-3000:]
    assert sorted(outcome.results) == [0, 1, 2, 3]
    problems = bitwise_differences(outcome, reference)
    assert not problems, "; ".join(problems[:5])
    for rank, result in outcome.results.items():
        assert result["steps"], f"rank {rank} recorded no step"
        assert max(map(int, result["steps"])) == NUM_STEPS


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def reference(tmp_path_factory, data_cache) -> JobOutcome:
    """The same job with no fault."""
    outcome = run(tmp_path_factory.mktemp("reference"), data_cache, spares=(0, 0))
    assert outcome.codes == [0, 0], outcome.job.output(0)[-3000:]
    assert all(len(r["steps"]) == NUM_STEPS for r in outcome.results.values())
    return outcome


@pytest.fixture
def world_of_one(tmp_path, leave_no_group) -> dist.ProcessGroup:
    """This process as the one rank of a gloo world (destroyed after the test)."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    return dist.distributed_c10d._get_default_group()
