"""One ``[rank<r>]:`` prefix on the traceback of an uncaught exception, with the current rank.

torch's ``init_process_group`` wraps ``sys.excepthook`` so that each line of a traceback reads
``[rank<r>]: ...``, ``r`` being the rank of that call. The engine creates the default group again
in every generation, and a hot spare creates a group of its own for its warm-up before it has a
rank: every call would add a layer, and a spare that became rank 1 would print
``[rank1]: [rank0]: Traceback ...``. :func:`rank_prefix` keeps a single layer with the rank the
process has now; a hook the user installed before stays underneath it.
"""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

Hook = Callable[[type[BaseException], BaseException, TracebackType | None], Any]

#: The attribute of a hook made here that names the hook it wraps.
_WRAPPED = "_p2p_wrapped_excepthook"


@contextlib.contextmanager
def rank_prefix(rank: int | None) -> Iterator[None]:
    """Around an ``init_process_group`` call: afterwards a traceback's lines carry one
    ``[rank<rank>]: `` prefix, whatever that call and the earlier ones installed (no prefix for
    ``None``: a spare warming up, which is no rank yet)."""
    base: Hook = getattr(sys.excepthook, _WRAPPED, sys.excepthook)
    try:
        yield
    finally:
        sys.excepthook = base if rank is None else _prefixed(base, f"[rank{rank}]: ")


def _prefixed(base: Hook, prefix: str) -> Hook:
    def hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        stderr, sys.stderr = sys.stderr, io.StringIO()
        try:
            base(exc_type, exc, tb)
        finally:
            text, sys.stderr = sys.stderr.getvalue(), stderr
        stderr.write("\n".join(prefix + line if line else "" for line in text.split("\n")))
        stderr.flush()

    setattr(hook, _WRAPPED, base)
    return hook
