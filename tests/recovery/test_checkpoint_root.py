"""A checkpoint directory the job cannot write is a configuration error, found at the start."""

from __future__ import annotations

import pytest

from recovery.checkpoint import check_root
from recovery.errors import ConfigurationError


def test_a_missing_directory_is_made(tmp_path):
    check_root(str(tmp_path / "a" / "b"))
    assert (tmp_path / "a" / "b").is_dir()


@pytest.mark.parametrize("under", ["", "sub"])
def test_a_file_in_the_way_is_refused_naming_the_fix(tmp_path, under):
    (tmp_path / "file").write_text("")
    root = str(tmp_path / "file" / under) if under else str(tmp_path / "file")
    with pytest.raises(ConfigurationError) as e:
        check_root(root)
    assert str(e.value).startswith(f"the checkpoint directory {root} cannot be used (")
    assert str(e.value).endswith(
        "give one this job can create and write (p2p-run --checkpoint-dir)"
    )


def test_a_remote_directory_is_left_to_the_first_save():
    check_root("memory://bucket/ckpt")  # nothing is made or checked there
    import fsspec

    assert not fsspec.filesystem("memory").exists("/bucket/ckpt")


def _rebuilder(root: str, resume: bool):
    from unittest import mock

    from recovery.checkpoint import CheckpointConfig
    from recovery.config import RecoveryConfig
    from recovery.rebuild import Rebuilder

    config = RecoveryConfig(checkpoint=CheckpointConfig(root=root), resume=resume)
    return Rebuilder(mock.Mock(), config, lambda: None, mock.Mock(), mock.Mock())


def test_a_fresh_start_checks_the_root_then_refuses_another_runs_checkpoints(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigurationError, match="cannot be used"):
        _rebuilder(str(tmp_path / "file" / "ckpt"), resume=False).check_fresh_start()
    root = tmp_path / "ckpt"
    _rebuilder(str(root), resume=False).check_fresh_start()  # made, and empty
    (root / "step-4").mkdir()
    (root / "step-4" / ".metadata").write_bytes(b"")
    with pytest.raises(ConfigurationError, match=r"already holds checkpoints of steps \[4\]"):
        _rebuilder(str(root), resume=False).check_fresh_start()
    _rebuilder(str(root), resume=True).check_fresh_start()  # what a resumed job starts from
