"""The cold fallback: rare DCP checkpoints, read only when no in-memory copy can serve.

Checkpoints go through ``torch.distributed.checkpoint`` (DCP), so they reshard on load and
write to a local directory or to any fsspec URL (``s3://...`` with s3fs installed). Each lands
in ``<root>/step-<step>/``; a checkpoint counts only once DCP has written its metadata file,
which DCP does last, so a save cut short is never mistaken for a complete one.

Beside the model and optimizer state (which DCP shards and reshards), every rank stores its
RNG states, the LR scheduler and its extras (e.g. the data position) as one small msgpack
document, in a tensor keyed by its rank, so loading a checkpoint puts the data position back
with the weights. The per-rank document is msgpack bytes in a ``uint8`` tensor. DCP itself
reads its ``.metadata`` with pickle, so no pickle is read back from a checkpoint that a signed
manifest (:mod:`recovery.manifest`) does not vouch for: the manifest is checked first.

State-dict helpers run collectives: every call here is collective over the process group and
belongs on the training thread, never on a background thread during recovery.
"""

from __future__ import annotations

import errno
import logging
import os
import re
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import state_dict_loader as dcp_loader
from torch.distributed.checkpoint import state_dict_saver as dcp_saver
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from p2p_state.state import TrainingState
from recovery import manifest
from recovery.errors import ConfigurationError

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem  # untyped: the name documents what is returned

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d+)$")
#: Capacity of the per-rank msgpack document (length-prefixed in a fixed-size uint8 tensor).
_SMALL_STATE_BYTES = 512 * 1024


class CheckpointNotFoundError(FileNotFoundError):
    """No complete checkpoint where one was asked for."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointConfig:
    """Where and how often the cold fallback checkpoint is written."""

    root: str
    """Directory or fsspec URL under which ``step-<n>/`` checkpoints are written."""
    every_steps: int = 1000
    """Save every N steps (rare: this is the fallback when a shard and all its copies are lost)."""
    async_save: bool = True
    """Stage to memory and write in the background (``dcp.async_save``)."""
    timeout_s: float = 600.0
    """Deadline for a previous asynchronous save to finish before the next one starts."""

    def __post_init__(self) -> None:
        if not self.root:
            raise ValueError("CheckpointConfig.root must name a directory or an fsspec URL")
        if self.every_steps < 1:
            raise ValueError(f"CheckpointConfig.every_steps must be >= 1, got {self.every_steps}")
        if self.timeout_s <= 0:
            raise ValueError(f"CheckpointConfig.timeout_s must be > 0, got {self.timeout_s}")


def _fs(root: str) -> tuple[AbstractFileSystem, str]:
    import fsspec  # an install requirement of torch's DCP fsspec support; local paths too

    fs, path = fsspec.core.url_to_fs(root)
    return fs, path


def check_root(root: str) -> None:
    """Make sure checkpoints can be written under a local ``root``, creating it if missing (a
    remote one, ``s3://...``, is tried by its first save).

    Raises:
        ConfigurationError: a file is in its way, or it cannot be created or written.
    """
    fs, path = _fs(root)
    if "file" not in fs.protocol:
        return
    try:
        fs.makedirs(path, exist_ok=True)
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
    except OSError as e:
        raise ConfigurationError(
            f"the checkpoint directory {root} cannot be used ({e.strerror or e}): give one "
            "this job can create and write (p2p-run --checkpoint-dir)"
        ) from None


def complete_steps(root: str) -> list[int]:
    """Steps of the complete checkpoints under ``root``, ascending (empty if there are none)."""
    try:
        fs, path = _fs(root)
        entries = fs.ls(path, detail=False)
    except (FileNotFoundError, ImportError):
        return []
    steps = []
    for entry in entries:
        m = _STEP_DIR.match(entry.rstrip("/").rsplit("/", 1)[-1])
        if m and fs.exists(f"{entry.rstrip('/')}/.metadata"):
            steps.append(int(m.group(1)))
    return sorted(steps)


class ColdCheckpointer:
    """Writes DCP checkpoints every ``every_steps`` steps and loads the latest on demand.

    Construction is collective: by default it creates a gloo process group of its own, because
    an asynchronous save finishes with collectives on a background thread, which must never
    interleave with the training thread's collectives on the same group.

    Args:
        config: Where and how often.
        state: The training state (its model, optimizer and scheduler are checkpointed).
        group: Process group for DCP's collectives (default: a new gloo group).
    """

    def __init__(
        self,
        config: CheckpointConfig,
        state: TrainingState,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.config = config
        self.state = state
        self.group = group if group is not None else dist.new_group(backend="gloo")
        self._rank = dist.get_rank(self.group)
        self._pending: Future[int] | None = None
        self._pending_step = -1

    def _path(self, step: int) -> str:
        return f"{self.config.root.rstrip('/')}/step-{step:09d}"

    def _state_dict(
        self,
        step: int | None = None,
        extras: Any = None,
        rank_states: dict[int, bytes] | None = None,
        world_size: int | None = None,
    ) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(
            self.state.model,
            [self.state.optimizer] if self.state.optimizer is not None else [],
            options=StateDictOptions(),
        )
        rank = dist.get_rank(self.group)
        if rank_states is None:
            rank_states = {rank: self.state.small_state(step, extras) if step is not None else b""}
        world = torch.tensor([world_size or dist.get_world_size(self.group)], dtype=torch.int64)
        sd = {"model": model_sd, "optim": optim_sd, "meta/world_size": world}
        for r, data in rank_states.items():
            sd[f"rank_state/{r}"] = _pack_small(data)
        return sd

    def catch_up(self, step: int, extras: Any = None) -> bool:
        """After a recovery restored ``step``: save it now if the checkpoint last due is missing.

        A save in progress when a fault hits never completes (its collectives ran on the
        aborted groups, and a lost rank's part of it died with the rank), so with faults more
        frequent than a save takes, no periodic checkpoint would ever complete. The restored
        state stands in for the lost one: it is written now, by the new generation. When no
        complete checkpoint exists at all the save is synchronous, so the cold fallback exists
        before training goes on; otherwise it runs in the background like every other.
        Complete checkpoints are never deleted, so the previous one stays the fallback until
        this one is complete. Collective (every member decides alike from the same listing).

        Returns:
            Whether a save was started.
        """
        due = step - step % self.config.every_steps
        complete = complete_steps(self.config.root)
        if due <= 0 or (complete and complete[-1] >= due):
            return False
        logger.info(
            "the checkpoint due at step %d is missing (complete: %s); writing step %d now",
            due,
            complete or "none",
            step,
        )
        self.save(step, extras, blocking=not complete)
        return True

    def due(self, step: int) -> bool:
        """Whether :meth:`maybe_save` saves ``step`` (a multiple of ``every_steps``)."""
        return step % self.config.every_steps == 0

    def maybe_save(self, step: int, extras: Any = None) -> bool:
        """Save if ``step`` is a multiple of ``every_steps``; returns whether it did."""
        if not self.due(step):
            return False
        self.save(step, extras)
        return True

    def save(
        self,
        step: int,
        extras: Any = None,
        *,
        rank_states: dict[int, bytes] | None = None,
        world_size: int | None = None,
        blocking: bool = False,
    ) -> None:
        """Checkpoint the current state as ``step`` (collective).

        Args:
            step: The step the state stands for.
            extras: This rank's extras (stored with its RNG and schedule).
            rank_states: Per-rank documents (:meth:`TrainingState.small_state`) by the rank
                they belong to, when this rank writes others' too (a smaller world saving
                the state of a larger one); default: its own.
            world_size: The world the per-rank documents belong to (default: this group's).
            blocking: Write before returning even when ``async_save`` is set.
        """
        self.wait()
        sd = self._state_dict(step, extras, rank_states, world_size)
        if self.config.async_save and not blocking:
            result = dcp_saver.async_save(
                sd, checkpoint_id=self._path(step), process_group=self.group
            )
            # An AsyncSaveResponse's upload future, or the future itself where torch returns one.
            written = cast("Future[object]", getattr(result, "upload_completion", result))
            self._pending = self._signed_when_written(written, step)
            self._pending_step = step
        else:
            dcp_saver.save(sd, checkpoint_id=self._path(step), process_group=self.group)
            self._sign(step)
        logger.info("checkpoint of step %d %s", step, "started" if self._pending else "written")

    def wait(self) -> None:
        """Wait (up to ``timeout_s``) for an asynchronous save in progress to finish."""
        if self._pending is None:
            return
        try:
            self._pending.result(timeout=self.config.timeout_s)
        except TimeoutError as e:
            raise TimeoutError(
                f"the checkpoint of step {self._pending_step} did not finish writing within "
                f"{self.config.timeout_s:.0f}s (CheckpointConfig.timeout_s)"
            ) from e
        finally:
            self._pending = None

    def _sign(self, step: int) -> None:
        if self._rank == 0:
            fs, path = _fs(self._path(step))
            manifest.sign_if_secret(fs, path)

    def _signed_when_written(self, written: Future[object], step: int) -> Future[int]:
        """A future that completes once ``written`` has and its checkpoint is signed.

        The signature is written by the save's own completion, not by whoever waits for it: a
        save that completes after the training thread abandoned it (a fault came first) is a
        good checkpoint, and an unsigned one would be refused as the cold fallback.
        """
        signed: Future[int] = Future()

        def sign_then_complete(done: Future[object]) -> None:
            try:
                done.result()
                self._sign(step)
            except Exception as e:  # reported to whoever waits; never raised on DCP's thread
                signed.set_exception(e)
            else:
                signed.set_result(step)

        written.add_done_callback(sign_then_complete)
        return signed

    def abandon(self) -> Future[int] | None:
        """Stop waiting for a save in progress (after a fault: its group is being torn down).

        A save cut short never counts: DCP writes its metadata file last. One that still
        completes is signed and counts like any other.

        Returns:
            The abandoned save's future (done once it is written and signed), or None.
        """
        pending = self._pending
        if pending is not None:
            logger.warning("abandoning the checkpoint of step %d in progress", self._pending_step)
        self._pending = None
        return pending

    def load(self, step: int | None = None) -> tuple[int, dict[str, Any]]:
        """Load a checkpoint (the latest complete one by default) into the live state.

        Collective. The model and optimizer are resharded by DCP if the world size changed; a
        rank beyond the saved world size takes the RNG and extras of rank ``rank % saved``.

        Returns:
            ``(step, extras)`` as saved.

        Raises:
            CheckpointNotFoundError: there is no complete checkpoint (of that step) under root.
        """
        self.wait()
        steps = complete_steps(self.config.root)
        if step is None:
            if not steps:
                raise CheckpointNotFoundError(
                    f"no complete checkpoint under {self.config.root!r}: nothing to resume from; "
                    "check the path (CheckpointConfig.root / --resume) or start without resuming"
                )
            # The newest checkpoint the job's secret vouches for (a save abandoned after a fault
            # may be complete but unsigned); refused ones are logged with their reason.
            step = manifest.latest_vouched(steps, lambda s: _fs(self._path(s)))
        elif step not in steps:
            raise CheckpointNotFoundError(
                f"no complete checkpoint of step {step} under {self.config.root!r}; "
                f"complete ones: {steps or 'none'}"
            )
        path = self._path(step)
        manifest.verify_if_secret(*_fs(path), cached=True)  # before DCP unpickles .metadata
        meta = {"meta/world_size": torch.zeros(1, dtype=torch.int64)}
        dcp_loader.load(meta, checkpoint_id=path, process_group=self.group)
        saved_world = int(meta["meta/world_size"].item())
        rank = dist.get_rank(self.group)
        sd = self._state_dict(rank_states={})
        source_rank = rank % saved_world
        sd[f"rank_state/{source_rank}"] = torch.zeros(_SMALL_STATE_BYTES, dtype=torch.uint8)
        sd.pop("meta/world_size")
        dcp_loader.load(sd, checkpoint_id=path, process_group=self.group)
        set_state_dict(
            self.state.model,
            [self.state.optimizer] if self.state.optimizer is not None else [],
            model_state_dict=sd["model"],
            optim_state_dict=sd["optim"],
        )
        small = sd[f"rank_state/{source_rank}"]
        n = int.from_bytes(bytes(small[:4].tolist()), "little")
        loaded_step, extras = self.state.load_small_state(small[4 : 4 + n].numpy().tobytes())
        logger.info("loaded checkpoint of step %d from %s", loaded_step, path)
        return loaded_step, extras


def _pack_small(data: bytes) -> torch.Tensor:
    """A per-rank document, length-prefixed in a fixed-size ``uint8`` tensor."""
    if len(data) + 4 > _SMALL_STATE_BYTES:
        raise ValueError(
            f"the per-rank checkpoint document needs {len(data)} bytes, more than "
            f"{_SMALL_STATE_BYTES}; keep the extras small"
        )
    small = torch.zeros(_SMALL_STATE_BYTES, dtype=torch.uint8)
    small[:4] = torch.tensor(list(len(data).to_bytes(4, "little")), dtype=torch.uint8)
    if data:
        small[4 : 4 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return small
