"""Pure: what a protected job does about an exception (recover, leave, end, or let it stand).

A *fault* is a failure of the job's processes or links, not of the training code: a lost peer, a
broken or aborted generation, a failed replication round. It is told apart by the exception's
type and by whether this generation's groups were aborted (an abort makes whatever the training
thread was doing fail, with whatever error the backend raises), never by the wording of a
message, which changes between torch versions.

One backend needs more: gloo raises a plain ``RuntimeError`` when a peer's connection closes or
an operation times out (torch 2.13: ``[.../gloo/transport/tcp/pair.cc:553] Connection closed by
peer``, ``[.../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv``), and
a peer that dies can fail a collective here before the coordinator's word arrives. Such an error
is recognised by the origin gloo stamps on every error it raises (its source file under
``gloo/``), the one part of the text gloo does not word.
"""

from __future__ import annotations

import enum

import torch.distributed as dist

from p2p_state.replicator import ReplicationError
from p2p_state.transfer import TransferError
from recovery.comms import Interrupted
from recovery.errors import ConfigurationError, GivenBack, JobStopped, RecoveryFailed
from recovery.restore import NoSurvivingCopy
from recovery.session import JobEnded, NotAMember

#: Exceptions that are a fault whatever their message: the engine's own and torch's typed
#: distributed errors (``DistBackendError`` for NCCL, ``DistNetworkError``, ``DistStoreError``).
FAULT_TYPES: tuple[type[BaseException], ...] = (
    Interrupted,
    ReplicationError,
    TransferError,
    dist.DistError,
)

#: How the job ends, whatever else holds: they leave the job as they are.
ENDINGS: tuple[type[BaseException], ...] = (
    JobEnded,
    RecoveryFailed,
    ConfigurationError,
    GivenBack,
    JobStopped,
)


class Action(enum.Enum):
    """What to do about an exception."""

    RECOVER = "recover"
    """A fault: wait for the coordinator's next generation and restore into it."""
    LEAVE = "leave"
    """The new generation has no place for this process: it is given back."""
    END = "end"
    """The job is over for this process (ended, stopped, failed, misconfigured): propagate."""
    RAISE = "raise"
    """Not a fault: the user's error stands (the job shuts down and re-raises it)."""


def is_gloo_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a ``RuntimeError`` raised by gloo (see the module docstring)."""
    if type(exc) is not RuntimeError:
        return False
    origin = str(exc).partition("]")[0]
    return origin.startswith("[") and "gloo/" in origin


def decide(
    exc: BaseException,
    *,
    standalone: bool,
    aborted: bool,
    recovering: bool = False,
) -> Action:
    """What a protected job does about ``exc``.

    Args:
        exc: The exception that left the step, the start, or a recovery.
        standalone: No coordinator (torchrun): nothing to recover with, every error stands.
        aborted: This generation's groups were aborted (a new generation is on its way), so
            any error the training thread met is the abort's.
        recovering: ``exc`` came out of the restore protocol of a new generation, where a
            missing copy (a member died meanwhile) means waiting for the next generation.

    Returns:
        The :class:`Action`.
    """
    if isinstance(exc, NotAMember):
        return Action.LEAVE
    if isinstance(exc, ENDINGS):
        return Action.END
    if not isinstance(exc, Exception) or standalone:
        return Action.RAISE
    if aborted or isinstance(exc, FAULT_TYPES) or is_gloo_error(exc):
        return Action.RECOVER
    if recovering and isinstance(exc, NoSurvivingCopy):
        return Action.RECOVER
    return Action.RAISE


def short(exc: BaseException) -> str:
    """``Type: first line`` of ``exc`` (at most 200 characters of it), for logs and events."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return f"{type(exc).__name__}: {text[:200]}"


def without_frames(exc: BaseException) -> BaseException:
    """``exc`` with the tracebacks of it and its causes cut, so their frames can be freed.

    The links are cut, not only dropped: the interpreter and ``contextlib`` still hold the
    outermost traceback entries while a ``with`` block's exception is being handled.
    """
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        tb = e.__traceback__
        while tb is not None:
            tb.tb_next, tb = None, tb.tb_next
        e.__traceback__ = None
        e = e.__cause__ or e.__context__
    return exc
