"""A traceback carries one ``[rank<r>]:`` prefix with the process's rank now, however many times
the engine created the default group (a spare's warm-up, each generation), and the exception is
recorded where torchrun's ``@record`` would put it."""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import pytest
import torch.distributed as dist

from launcher.output import read_error_file
from recovery import comms
from recovery.tracebacks import rank_prefix


@pytest.fixture
def hook_kept():
    """The interpreter's own hook to start from (groups other tests made in this process
    wrapped it already), and the hook as it was afterwards."""
    before = sys.excepthook
    sys.excepthook = sys.__excepthook__
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.excepthook = before


def _printed(capsys) -> str:
    try:
        raise KeyError("label")
    except KeyError as e:
        sys.excepthook(type(e), e, None)
    return capsys.readouterr().err


def test_generations_of_the_default_group_leave_one_prefix(hook_kept, capsys):
    for _ in range(3):  # three generations of a world of one, as a recovery makes them
        comms._init_default(dist.HashStore(), "gloo", 0, 1, timedelta(seconds=30))
    lines = _printed(capsys).splitlines()  # the traceback, then the error
    assert lines[-1] == "[rank0]: KeyError: 'label'" and len(lines) > 1
    assert all(line.startswith("[rank0]: ") and line.count("[rank") == 1 for line in lines)


def _torch_like_init(rank: int) -> None:
    """What init_process_group does to the hook (a stand-in: a world of one is always rank 0)."""
    inner = sys.excepthook

    def hook(*args):
        inner(*args)

    hook.prefix = f"[rank{rank}]"  # type: ignore[attr-defined]
    sys.excepthook = hook


def test_a_spare_given_rank_1_says_rank_1_and_a_users_hook_stays_underneath(hook_kept, capsys):
    def users_hook(exc_type, exc, tb):
        sys.stderr.write(f"user: {exc!r}\n")

    sys.excepthook = users_hook
    with rank_prefix(None):  # the spare's warm-up group: rank 0 of a world of one
        _torch_like_init(0)
    assert _printed(capsys) == "user: KeyError('label')\n"  # no rank yet: no prefix
    with rank_prefix(1):
        _torch_like_init(1)
    assert _printed(capsys) == "[rank1]: user: KeyError('label')\n"
    with rank_prefix(3):  # a later generation gave it another rank
        _torch_like_init(3)
    assert _printed(capsys) == "[rank3]: user: KeyError('label')\n"


def test_the_uncaught_exception_is_recorded_as_torchruns_record_would(
    hook_kept, capsys, tmp_path, monkeypatch
):
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    with rank_prefix(2):
        pass
    printed = _printed(capsys)
    assert printed.splitlines()[-1] == "[rank2]: KeyError: 'label'"
    assert read_error_file(path, 500) == "KeyError: 'label'"  # what p2p-run reports
    callstack = json.loads(path.read_text())["message"]["extraInfo"]["py_callstack"]
    assert callstack.endswith("KeyError: 'label'\n")
    # What the script's own @record wrote first stays; so does a Ctrl-C's absence of one.
    path.write_text('{"message": "from @record"}')
    _printed(capsys)
    assert read_error_file(path, 500) == "from @record"
    path.unlink()
    sys.excepthook(KeyboardInterrupt, KeyboardInterrupt(), None)
    assert not path.exists()
