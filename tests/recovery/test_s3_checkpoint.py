"""The cold checkpoints against an S3-compatible endpoint (moto's server, through s3fs).

The endpoint is handed to every process through the environment (``AWS_ENDPOINT_URL_S3``,
honoured by botocore and so by s3fs), the way a real job points at MinIO or a private S3.
"""

from __future__ import annotations

import logging
import os
import urllib.request

import pytest

from bench.baseline import run_baseline
from bench.faults import parse_fault
from bench.phases import restart_faults
from launcher.local import WorkerGroupConfig, run_local
from recovery.checkpoint import complete_steps
from tests.recovery import _workers

moto_server = pytest.importorskip("moto.server")
s3fs = pytest.importorskip("s3fs")

pytestmark = pytest.mark.slow

BUCKET = "checkpoints"
#: Deadline for a whole multi-process run (start-up, training, uploads, restarts).
RUN_DEADLINE_S = 240.0
#: Deadline for one request to the server's own control API.
CONTROL_TIMEOUT_S = 10.0


def _reset(endpoint: str) -> None:
    """Forget every bucket: moto keeps its state per process, not per server."""
    request = urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST")
    with urllib.request.urlopen(request, timeout=CONTROL_TIMEOUT_S) as response:
        assert response.status == 200


@pytest.fixture
def s3_bucket(monkeypatch, tmp_path, caplog):
    """An empty bucket on a local S3-compatible server; ``s3://`` URLs reach it in children too.

    Yields:
        The bucket's URL (``s3://checkpoints``).
    """
    caplog.set_level(logging.WARNING, logger="werkzeug")  # not a line per request
    # Port 0: the server binds a free port itself, so there is no race for it.
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        # Only this server's credentials and endpoint: no profile or config file of the machine.
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)
        no_proxy = ",".join(filter(None, [os.environ.get("NO_PROXY"), host]))
        monkeypatch.setenv("NO_PROXY", no_proxy)
        monkeypatch.setenv("no_proxy", no_proxy)
        _reset(endpoint)
        fs = s3fs.S3FileSystem(skip_instance_cache=True)
        fs.mkdir(BUCKET)
        # The environment, not an argument, must be what routes s3fs here.
        assert fs.s3.meta.endpoint_url == endpoint
        yield f"s3://{BUCKET}"
        _reset(endpoint)
    finally:
        server.stop()


def _keys(url: str) -> list[str]:
    """Every object under ``url``, relative to it (a fresh client: nothing cached)."""
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    root = url.removeprefix("s3://").rstrip("/")
    return sorted(key.removeprefix(root + "/") for key in fs.find(root))


def test_cold_checkpoints_round_trip_through_s3(s3_bucket):
    """Asynchronous DCP saves land in the bucket, load back bitwise, and a fresh job resumes."""
    root = f"{s3_bucket}/cold"
    cfg = WorkerGroupConfig(world_size=2, ranks_per_node=1, timeout_s=RUN_DEADLINE_S)
    first = run_local(_workers.checkpoint_round_trip, cfg, (root,))
    keys = _keys(root)
    assert complete_steps(root) == [2, 4], keys
    for step in (2, 4):
        assert f"step-{step:09d}/.metadata" in keys
        assert sum(k.startswith(f"step-{step:09d}/") and k.endswith(".distcp") for k in keys) == 2
    for r in first:
        assert r["loaded_step"] == 2 and r["extras"] == {"offset": 20}
        assert r["load_equals_step2"], "the state loaded from S3 must be the one saved at step 2"
        assert r["replay_equals_step4"], "RNG, schedule and data position come back from S3 too"
        assert "no complete checkpoint" in r["missing"]
    # A later save cut short (its shards written, not its metadata) must not count.
    s3fs.S3FileSystem(skip_instance_cache=True).pipe(
        f"{root}/step-{6:09d}/__0_0.distcp", b"cut short"
    )
    assert complete_steps(root) == [2, 4], "a checkpoint without .metadata is not complete"
    resumed = run_local(_workers.resume_in_fresh_job, cfg, (root,))
    for a, b in zip(first, resumed):
        assert b["resumed_from"] == 4, "the latest complete checkpoint in the bucket is step 4"
        assert b["extras"] == {"offset": 40}
        assert b["step4"] == a["step4"]


def test_the_plain_baseline_resumes_from_its_s3_checkpoint(s3_bucket, tmp_path):
    """torchrun restarts the killed plain job, which loads its last checkpoint from the bucket
    and loses exactly the steps since it (step 4 was reached, the last checkpoint is step 3)."""
    root = f"{s3_bucket}/baseline"
    run = run_baseline(
        tmp_path / "restart",
        model="tiny",
        steps=6,
        world_size=2,
        ranks_per_node=1,
        checkpoint_every=3,
        checkpoint_dir=root,
        faults=[parse_fault("kill:rank=1@step=5")],
        cache_dir=str(tmp_path / "cache"),
        timeout_s=RUN_DEADLINE_S,
    )
    assert run.code == 0, run.output[-3000:]
    assert not (tmp_path / "restart" / "checkpoints").exists(), "nothing may go to local disk"
    keys = _keys(root)
    for step in (3, 6):
        assert f"step-{step}/.metadata" in keys, keys
    (fault,) = restart_faults(run.marks, run.kills)
    assert fault.step_reached == 4 and fault.step_restored == 3, fault
    assert fault.steps_lost == 1
    loaded = [m["step"] for m in run.marks if m["event"] == "checkpoint_loaded"]
    assert loaded[:2] == [0, 0] and set(loaded[2:]) == {3}, loaded
    assert sorted(run.results) == [0, 1]
    for rank, result in run.results.items():
        assert result["started_at"] == 3, f"rank {rank} did not resume from step 3"
        assert sorted(map(int, result["steps"])) == [4, 5, 6]
