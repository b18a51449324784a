"""Fixtures shared by every test package."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.jobs import WORKER, Job


@pytest.fixture
def start_job(tmp_path):
    """Start p2p-run jobs (one p2p-run per emulated node); everything is killed at teardown."""
    jobs: list[Job] = []

    def start(
        nnodes=2, nproc=2, spares=(1, 0), extra=(), launcher_args=(), script=WORKER, env=None
    ):
        run_dir = tmp_path / f"job{len(jobs)}"
        run_dir.mkdir(parents=True)
        job = Job(
            run_dir, nnodes, nproc, list(spares), list(extra), list(launcher_args), script, env
        )
        jobs.append(job)
        return job

    yield start
    for job in jobs:
        job.kill_everything()


@pytest.fixture
def leave_no_group():
    """For tests that make this process a rank of a fake world (torch's ``fake`` backend)."""
    yield
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    from recovery import comms

    if dist.is_initialized():
        dist.destroy_process_group()
    # Later tests in this process must not meet the fake worlds' meshes in DTensor's caches.
    _clear_sharding_prop_cache()
    comms._cached_places.clear()


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """``p2p-bench``'s ``--reference-cache``: a module's runs of one job share its fault-free
    run (the cache is keyed by the job: script, its arguments, steps, shape)."""
    return ["--reference-cache", str(tmp_path_factory.mktemp("references"))]
