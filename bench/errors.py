"""The two ways a bench command fails that the CLI reports as one line (``bench/cli.py``)."""

from __future__ import annotations


class UsageError(ValueError):
    """A bad flag value: reported as one line, exit code 2."""


class BenchFailed(RuntimeError):
    """A measurement could not be made (a job or coordinator did not get where the bench
    waits for it): reported as one line, exit code 1."""
