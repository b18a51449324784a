"""Types of the benches' numeric flags: a value out of range is refused by argparse, naming the
flag, before anything starts (``p2p-bench inject: error: argument --steps: 0 is below 1``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

#: The example model's presets (``bench.models.PRESETS``, which needs torch to import).
MODEL_PRESETS = ("tiny", "small", "example")


def count(minimum: int = 1) -> Callable[[str], int]:
    """A whole number of at least ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}, the least it takes")
        return value

    return parse


def positive(text: str) -> float:
    """A number above 0 (seconds, MiB, GB/s)."""
    value = _number(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not above 0")
    return value


def non_negative(text: str) -> float:
    """A number of 0 or more."""
    value = _number(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text} is below 0")
    return value


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def heartbeats(interval_s: float, timeout_s: float) -> None:
    """Refuse heartbeat settings ``p2p-run`` would refuse once its job started.

    Raises:
        bench.errors.UsageError: the timeout does not exceed the interval.
    """
    from bench.errors import UsageError

    if timeout_s <= interval_s:
        raise UsageError(
            f"--heartbeat-timeout {timeout_s:g} must be longer than --heartbeat-interval "
            f"{interval_s:g}: a process is declared hung after missing heartbeats for that long"
        )
