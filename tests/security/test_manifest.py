"""A cold checkpoint is read only when a manifest signed with the job's secret matches it."""

from __future__ import annotations

import fsspec
import pytest

from recovery import manifest

SECRET = b"0123456789abcdef0123456789abcdef"


@pytest.fixture
def checkpoint(tmp_path):
    d = tmp_path / "step-000000010"
    d.mkdir()
    (d / ".metadata").write_bytes(b"metadata bytes")
    (d / "__0_0.distcp").write_bytes(b"x" * 1000)
    fs = fsspec.filesystem("file")
    manifest.sign(fs, str(d), SECRET)
    manifest.verify(fs, str(d), SECRET)  # the untouched checkpoint passes
    return fs, d


def test_a_crafted_metadata_file_is_refused_before_it_is_read(checkpoint):
    fs, d = checkpoint
    (d / ".metadata").write_bytes(b"cos\nsystem\n(S'touch /tmp/pwned'\ntR.")
    with pytest.raises(manifest.CheckpointRefused, match=r"\.metadata does not match"):
        manifest.verify(fs, str(d), SECRET)


@pytest.mark.parametrize(
    ("tamper", "reason"),
    [
        (lambda d: (d / "extra.distcp").write_bytes(b"y"), "not in its signed manifest"),
        (lambda d: (d / "__0_0.distcp").unlink(), "is missing"),
        (lambda d: (d / "manifest.json").unlink(), "no signed manifest.json"),
        (lambda d: (d / "manifest.json").write_text("{"), "unreadable"),
        (lambda d: (d / "manifest.json").write_text("[]"), "malformed"),
    ],
)
def test_every_mismatch_is_refused_with_its_reason(checkpoint, tamper, reason):
    fs, d = checkpoint
    tamper(d)
    with pytest.raises(manifest.CheckpointRefused, match=reason):
        manifest.verify(fs, str(d), SECRET)


def test_a_manifest_signed_with_another_secret_is_refused(checkpoint):
    fs, d = checkpoint
    manifest.sign(fs, str(d), b"another job's secret")
    with pytest.raises(manifest.CheckpointRefused, match="not signed with this job's secret"):
        manifest.verify(fs, str(d), SECRET)


def test_the_newest_vouched_checkpoint_is_chosen(tmp_path, monkeypatch):
    from launcher import protocol

    secret_file = tmp_path / "secret"
    secret = protocol.write_secret(str(secret_file))
    monkeypatch.setenv(protocol.ENV_SECRET_FILE, str(secret_file))
    fs = fsspec.filesystem("file")
    dirs = {}
    for step in (10, 20):
        d = tmp_path / f"step-{step}"
        d.mkdir()
        (d / ".metadata").write_bytes(b"m%d" % step)
        dirs[step] = str(d)
    manifest.sign(fs, dirs[10], secret)  # step 20 was abandoned before it was signed
    assert manifest.latest_vouched([10, 20], lambda s: (fs, dirs[s])) == 10
    manifest.sign(fs, dirs[20], secret)
    assert manifest.latest_vouched([10, 20], lambda s: (fs, dirs[s])) == 20
    (tmp_path / "step-10" / ".metadata").write_bytes(b"evil")
    (tmp_path / "step-20" / ".metadata").write_bytes(b"evil")
    with pytest.raises(manifest.CheckpointRefused, match="step-20"):
        manifest.latest_vouched([10, 20], lambda s: (fs, dirs[s]))
