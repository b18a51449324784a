"""One ``[rank<r>]:`` prefix on the traceback of an uncaught exception, with the current rank,
and the exception recorded where torchrun's ``@record`` would record it.

torch's ``init_process_group`` wraps ``sys.excepthook`` so that each line of a traceback reads
``[rank<r>]: ...``, ``r`` being the rank of that call. The engine creates the default group again
in every generation, and a hot spare creates a group of its own for its warm-up before it has a
rank: every call would add a layer, and a spare that became rank 1 would print
``[rank1]: [rank0]: Traceback ...``. :func:`rank_prefix` keeps a single layer with the rank the
process has now; a hook the user installed before stays underneath it.

The same layer writes the exception to ``TORCHELASTIC_ERROR_FILE`` (set by p2p-run, as by
torchrun) in the format of torch's ``@record``, unless the script's own ``@record`` wrote it
first: p2p-run then names the error when a rank fails, and in its last line when the job does,
with no decorator in the script.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time
import traceback
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
        sys.excepthook = _prefixed(base, "" if rank is None else f"[rank{rank}]: ")


def _record(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    """Write the exception where ``TORCHELASTIC_ERROR_FILE`` says, as ``@record`` does, unless
    something is there already (the script's own ``@record``)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path) or issubclass(exc_type, KeyboardInterrupt):
        return
    doc = {
        "message": {
            "message": f"{exc_type.__name__}: {exc}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(exc_type, exc, tb)),
                "timestamp": str(int(time.time())),
            },
        }
    }
    try:
        with open(f"{path}.{os.getpid()}.tmp", "w") as f:
            json.dump(doc, f)
        os.replace(f"{path}.{os.getpid()}.tmp", path)
    except OSError as e:  # the traceback still goes to stderr
        print(f"could not record the error in {path}: {e}", file=sys.stderr)


def _prefixed(base: Hook, prefix: str) -> Hook:
    def hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        _record(exc_type, exc, tb)
        if not prefix:
            base(exc_type, exc, tb)
            return
        stderr, sys.stderr = sys.stderr, io.StringIO()
        try:
            base(exc_type, exc, tb)
        finally:
            text, sys.stderr = sys.stderr.getvalue(), stderr
        stderr.write("\n".join(prefix + line if line else "" for line in text.split("\n")))
        stderr.flush()

    setattr(hook, _WRAPPED, base)
    return hook
