"""How a protected job ends when it does not finish its steps, and the exit code of each ending.

The engine never ends the process itself: it raises one of these, and the entry point
(``p2p_state.protect()``, ``p2p_state.init_process_group()``) turns it into the process's exit
code with :func:`exit_code_of`, the one place those codes are chosen. p2p-run reads them: 0 is a
process that left cleanly (a spare not needed, a rank given back), 1 a job that failed or
stopped, 2 a job set up wrongly (the coordinator ends the whole job with its one-line reason).
"""

from __future__ import annotations

from recovery.session import JobEnded

#: Exit code of a process that left cleanly.
EXIT_OK = 0
#: Exit code of a rank whose job failed or stopped (the coordinator has the reason).
EXIT_FAILED = 1
#: Exit code of a job set up in a way it cannot run (the message names the fix).
EXIT_CONFIGURATION = 2


class RecoveryFailed(RuntimeError):
    """The job cannot go on: no copy of some state survives and there is no checkpoint, or this
    rank's own collective failed and no new generation came (the coordinator replaces it)."""


class ConfigurationError(ValueError):
    """The job is set up in a way it cannot run; the message names the fix."""


class GivenBack(Exception):
    """The new generation has no place for this process (a resize gave it back): it leaves."""


class JobStopped(Exception):
    """The coordinator stopped the job after this rank wrote its part of the stop checkpoint."""


def exit_code_of(exc: BaseException) -> int | None:
    """The exit code a process ends with when ``exc`` ends its protected job.

    Args:
        exc: What left the job.

    Returns:
        The code, or ``None`` when ``exc`` is not one of the job's endings (the user's own
        error, which ends the process as Python's do).
    """
    if isinstance(exc, GivenBack):
        return EXIT_OK
    if isinstance(exc, ConfigurationError):
        return EXIT_CONFIGURATION
    if isinstance(exc, (JobStopped, RecoveryFailed)):
        return EXIT_FAILED
    if isinstance(exc, JobEnded):
        return exc.code or EXIT_FAILED
    return None
