"""Files the job writes are private; secrets and caches are never read or written through a
planted link, another user's file or a world-open directory."""

from __future__ import annotations

import os
import stat

import pytest

from dataload.cache import CacheConfig, open_or_build
from launcher import protocol
from launcher.events import EventLog


def test_write_secret_is_private_and_never_follows_a_planted_link(tmp_path):
    path = tmp_path / "secret"
    secret = protocol.write_secret(str(path))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert protocol.read_secret(str(path)) == secret
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    link = tmp_path / "planted"
    link.symlink_to(victim)
    with pytest.raises(FileExistsError):
        protocol.write_secret(str(link))
    assert victim.read_text() == "keep me"


def test_read_secret_refuses_links_open_modes_and_empty_files(tmp_path):
    good = tmp_path / "good"
    protocol.write_secret(str(good))
    link = tmp_path / "link"
    link.symlink_to(good)
    with pytest.raises(ValueError, match="symlink"):
        protocol.read_secret(str(link))
    good.chmod(0o640)
    with pytest.raises(ValueError, match="chmod 600"):
        protocol.read_secret(str(good))
    empty = tmp_path / "empty"
    empty.touch(mode=0o600)
    with pytest.raises(ValueError, match="empty"):
        protocol.read_secret(str(empty))
    with pytest.raises(ValueError, match="does not exist"):
        protocol.read_secret(str(tmp_path / "missing"))


def test_read_secret_refuses_another_users_file(tmp_path):
    path = tmp_path / "theirs"
    protocol.write_secret(str(path))
    try:
        os.chown(path, os.getuid() + 1, -1)
    except PermissionError:
        pytest.skip("cannot give a file to another user here (not root)")
    with pytest.raises(ValueError, match="owned by uid"):
        protocol.read_secret(str(path))


def test_the_run_dir_and_event_log_are_private(tmp_path):
    run_dir = tmp_path / "run"
    log = EventLog(run_dir, "coordinator")
    log.write("x")
    log.close()
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((run_dir / "events.jsonl").stat().st_mode) == 0o600


def _make():
    def fill(out):
        out[:] = 3

    return "uint8", (8,), 10, fill


def test_the_cache_never_writes_through_a_planted_symlink(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    directory = tmp_path / "cache"
    directory.mkdir(mode=0o755)
    config = CacheConfig(directory=str(directory), segment_samples=4)
    config.path.symlink_to(victim)  # the final name
    (directory / "dataset.p2pcache.lock").symlink_to(tmp_path / "victim-lock")
    with pytest.raises(OSError):
        open_or_build(config, "fp", _make)  # the lock is never opened through a link
    (directory / "dataset.p2pcache.lock").unlink()
    cache = open_or_build(config, "fp", _make)  # the planted cache link is replaced, not followed
    assert victim.read_text() == "keep me"
    assert not config.path.is_symlink() and len(cache) == 10
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700, "an open directory of ours is closed"
    assert not (tmp_path / "victim-lock").exists()


def test_a_cache_directory_that_is_a_link_is_refused(tmp_path):
    real = tmp_path / "elsewhere"
    real.mkdir()
    link = tmp_path / "cache"
    link.symlink_to(real)
    with pytest.raises(ValueError, match="symlink"):
        open_or_build(CacheConfig(directory=str(link)), "fp", _make)
