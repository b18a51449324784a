"""Settings declared once: p2p-run's flags and the coordinator's configuration derive from them."""

from __future__ import annotations

import dataclasses
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from launcher import config
from launcher.agent import AgentConfig
from launcher.cli import _resolve, _validate, build_parser, coordinator_config
from launcher.coordinator import CoordinatorConfig
from launcher.membership import MembershipConfig
from launcher.policy import ElasticConfig

REPO = Path(__file__).resolve().parents[2]


def _default(cls: type, name: str) -> object:
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def _config(argv: list[str]) -> CoordinatorConfig:
    args = build_parser().parse_args(argv)
    _resolve(args, {})
    _validate(args, script=False)
    return coordinator_config(args, Path("/run"), "/run/secret", "127.0.0.1", 0)


def test_unset_flags_give_the_dataclass_defaults():
    got = _config(["--nnodes", "2", "--nproc-per-node", "2"])
    assert got.membership == MembershipConfig(world_size=4, ranks_per_node=2, join_timeout_s=300.0)
    assert got.takeover_timeout_s == _default(CoordinatorConfig, "takeover_timeout_s") == 2.0
    assert got.env_store is False and got.standby_of is None
    args = build_parser().parse_args([])
    assert args.heartbeat_interval_s == _default(AgentConfig, "heartbeat_interval_s") == 0.5
    assert args.coordinator_timeout_s == _default(AgentConfig, "coordinator_timeout_s") == 30.0


def test_flags_reach_the_coordinator():
    got = _config(
        [
            "--nnodes=2",
            "--nproc-per-node=2",
            "--heartbeat-timeout=7.5",
            "--ack-timeout=4",
            "--spare-wait=9",
            "--max_restarts=5",
            "--replicas=2",
            "--join-timeout=11",
            "--takeover-timeout=3",
            "--env-store",
            "--min-ranks=3",
            "--max-ranks=8",
            "--allowed-sizes=3,4,8",
            "--scale-up-delay=12",
            "--graceful-timeout=13",
        ]
    )
    assert got.membership == MembershipConfig(
        world_size=4,
        ranks_per_node=2,
        heartbeat_timeout_s=7.5,
        ack_timeout_s=4.0,
        spare_wait_s=9.0,
        max_restarts=5,
        replicas=2,
        join_timeout_s=11.0,
        elastic=ElasticConfig(
            min_ranks=3,
            max_ranks=8,
            allowed_sizes=(3, 4, 8),
            scale_up_delay_s=12.0,
            scale_down_wait_s=9.0,
            graceful_timeout_s=13.0,
        ),
    )
    assert got.takeover_timeout_s == 3.0 and got.env_store


def test_the_document_round_trips_and_refuses_what_it_does_not_know():
    settings = dataclasses.replace(
        _config(["--nnodes=2", "--nproc-per-node=2", "--max-ranks=6", "--allowed-sizes=4,6"]),
        standby_of="10.0.0.1:29500",
        node="head",
        advertise="h",
    )
    assert config.load(CoordinatorConfig, config.dump(settings)) == settings
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['bogus'\]"):
        config.load(CoordinatorConfig, config.dump(settings)[:-1] + ', "bogus": 1}')
    with pytest.raises(ValueError, match="node 'a/b'"):
        config.load(
            CoordinatorConfig,
            config.dump(dataclasses.replace(settings, node="0")).replace(
                '"node": "0"', '"node": "a/b"'
            ),
        )


def test_the_coordinator_refuses_a_bad_configuration_in_one_line(tmp_path):
    path = tmp_path / "c.json"
    config.write_private(path, '{"membership": {}}')
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    proc = subprocess.run(
        [sys.executable, "-m", "launcher.coordinator", "--config", str(path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("p2p-coordinator: error: --config ") and "missing" in last
    assert "Traceback" not in proc.stderr


def test_a_refused_value_is_named_by_its_flag_not_by_its_field():
    args = build_parser().parse_args(["--max-ranks", "8", "--graceful-timeout", "-1"])
    with pytest.raises(ValueError, match=r"^--graceful-timeout -1.0 must be > 0$"):
        config.from_args(ElasticConfig, args, min_ranks=4)


def test_a_setting_without_a_flag_is_not_a_flag():
    with pytest.raises(TypeError, match="not declared with setting"):
        config.add_flags(build_parser(), MembershipConfig, "stop_timeout_s")


def test_an_event_tail_reads_only_what_was_appended_and_waits_for_a_line_to_end(tmp_path):
    from launcher.events import EVENTS_FILE, EventLog, EventTail

    tail = EventTail(tmp_path)
    assert tail.read() == []  # no log yet
    log = EventLog(tmp_path, "coordinator")
    log.write("hello", identity="agent/0")
    assert [e["event"] for e in tail.read()] == ["hello"]
    line = b'{"t": 1.0, "event": "generation_started", "generation": 1}\n'
    with open(tmp_path / EVENTS_FILE, "ab") as f:
        f.write(line[:20])  # a writer in the middle of its line
        f.flush()
        assert [e["event"] for e in tail.read()] == ["hello"]
        f.write(line[20:] + b"not json\n")
    assert [e["event"] for e in tail.read()] == ["hello", "generation_started"]
    log.close()


def test_gloo_pairs_connect_on_first_use_from_a_size_unless_a_flag_decides_for_every_size():
    from launcher.cli import UsageError, _engine_env
    from launcher.protocol import ENV_LAZY_GLOO
    from recovery.gloo_pairs import LAZY_FROM_RANKS, pairs_on_first_use

    def env(*flags: str) -> str | None:
        args = build_parser().parse_args(["--nnodes", "2", "--nproc-per-node", "2", *flags])
        _resolve(args, {})
        _validate(args, script=False)
        return _engine_env(args).get(ENV_LAZY_GLOO)

    # The ranks read the variable as the choice (recovery.api) and decide by size without it.
    assert (env(), env("--lazy-gloo"), env("--eager-gloo")) == (None, "1", "0")
    with pytest.raises(UsageError, match="--lazy-gloo and --eager-gloo contradict"):
        env("--lazy-gloo", "--eager-gloo")
    assert [pairs_on_first_use(n) for n in (2, LAZY_FROM_RANKS - 1, LAZY_FROM_RANKS)] == [
        False,
        False,
        True,
    ]
    assert pairs_on_first_use(2, True) and not pairs_on_first_use(16384, False)


def test_a_gloo_pairs_setting_neither_1_nor_0_is_ignored_with_a_warning(caplog):
    import logging

    from recovery.api import _gloo_pairs_choice

    assert [_gloo_pairs_choice(v) for v in ("1", "0", "")] == [True, False, None]
    with caplog.at_level(logging.WARNING, logger="recovery.api"):
        assert _gloo_pairs_choice("yes") is None
    assert "P2P_LAZY_GLOO='yes' is neither 1" in caplog.text and "from 512 ranks" in caplog.text


@pytest.mark.parametrize("address", ["10.0.0.7:29500", "", "node 7", "[::1]"])
def test_a_local_address_with_a_port_or_spaces_is_refused_with_the_fix(address):
    from launcher.cli import UsageError

    args = build_parser().parse_args(["--nnodes", "2", "--local-addr", address])
    _resolve(args, {})
    with pytest.raises(UsageError, match="must be a host name or an IPv4 address"):
        _validate(args, script=False)
    ok = build_parser().parse_args(["--nnodes", "2", "--local_addr", "node-7.cluster"])
    _resolve(ok, {})
    _validate(ok, script=False)
    assert ok.local_addr == "node-7.cluster"


def test_a_virtual_local_rank_maps_each_slot_to_one_visible_device(monkeypatch):
    from launcher.agent import slot_device

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert [slot_device(slot) for slot in range(3)] == ["0", "1", "2"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-5f1a, GPU-77c0")  # UUIDs, as Slurm may give
    assert [slot_device(slot) for slot in range(2)] == ["GPU-5f1a", "GPU-77c0"]
