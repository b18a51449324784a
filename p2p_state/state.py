"""Bind a live model, optimizer and scheduler to a :class:`StateLayout`.

``TrainingState`` knows which live tensors fill which entries of the flat buffer and how to move
bytes between the two in place: restoring writes into the very tensors FSDP and the optimizer
hold (``DTensor.to_local()`` shares storage with the parameter), so no parameter object is
replaced and no collective is issued. It works on local shards only, never on full state dicts:
FSDP's state-dict helpers run collectives, which must not happen on the recovery path.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import random
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from p2p_state.layout import LayoutMismatchError, StateLayout, dtype_from_name

if TYPE_CHECKING:
    from p2p_state.snapshot import HostStaging

logger = logging.getLogger(__name__)

_BLOB_LEN_BYTES = 4
_TENSOR_EXT = 1  # msgpack ext code of a 0-dim tensor (e.g. a capturable optimizer's lr)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (the tensor itself otherwise), sharing its storage.

    ``_local_tensor`` is what ``to_local()`` returns without the autograd dispatch around it;
    on a snapshot of 200 tensors that dispatch costs about a third as much as the copy itself.
    """
    if isinstance(t, DTensor):
        local = getattr(t, "_local_tensor", None)
        return local if local is not None else t.to_local()
    return t


def _shard_geometry(t: torch.Tensor) -> tuple[tuple[int, ...], int]:
    """Global shape and dim-0 offset of a (possibly sharded) tensor."""
    if not isinstance(t, DTensor):
        return tuple(t.shape), 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(t.shape), int(offsets[0]) if offsets else 0


def _encode_default(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor) and obj.dim() == 0:
        return msgpack.ExtType(
            _TENSOR_EXT, msgpack.packb([str(obj.dtype).removeprefix("torch."), obj.item()])
        )
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(
        f"cannot store a {type(obj).__name__} in the replicated state: the scheduler state, "
        "optimizer hyper-parameters and extras must be numbers, strings, lists, dicts or 0-dim "
        "tensors"
    )


def pack_small(value: Any) -> bytes:
    """``value`` as the non-tensor state stores it (msgpack; 0-dim tensors and NumPy scalars
    kept with their type).

    Raises:
        TypeError: ``value`` holds something else (a tensor of any size, an object).
    """
    data: bytes = msgpack.packb(value, use_bin_type=True, default=_encode_default)
    return data


def _decode_ext(code: int, data: bytes) -> Any:
    if code == _TENSOR_EXT:
        dtype, value = msgpack.unpackb(data)
        return torch.tensor(value, dtype=dtype_from_name(dtype))
    return msgpack.ExtType(code, data)


def unpack_small(data: bytes) -> Any:
    """What :func:`pack_small` packed (tuples come back as lists)."""
    return msgpack.unpackb(data, raw=False, ext_hook=_decode_ext, strict_map_key=False)


def _set_rng(name: str, state: torch.Tensor) -> None:
    if name == "rng/cpu":
        torch.set_rng_state(state)
    else:
        torch.cuda.set_rng_state(state)


def ensure_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create an optimizer's lazily-built state without changing any parameter.

    A fresh optimizer (a spare's, or one rebuilt after a resize) has no state until its first
    ``step()``, so its layout would differ from its peers'. The state is allocated (zeros) from
    what one step of the same optimizer does to a small stand-in parameter; an optimizer whose
    state is not shaped like its parameter (plus 0-dim scalars) gets one real step instead, with
    zero gradients and a zero learning rate. Either way a restore overwrites the values next.
    """
    if optimizer.state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if any(p.grad is not None for p in params):
        raise ValueError(
            "optimizer has gradients but no state; call ensure_optimizer_state() before backward"
        )
    if not _allocate_from_stand_ins(optimizer):
        _dry_step(optimizer, params)


def _dry_step(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """One ``step()`` with zero gradients and a zero learning rate (parameters unchanged)."""
    saved_lrs = [_zero_lr(group) for group in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    try:
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, saved_lrs):
            if lr is not None:
                group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)


def _zero_lr(group: dict[str, Any]) -> Any:
    """Set a parameter group's learning rate to zero (of its type); returns the old one."""
    lr = group.get("lr")
    if lr is not None:
        group["lr"] = torch.zeros_like(lr) if isinstance(lr, torch.Tensor) else 0.0
    return lr


def _allocate_from_stand_ins(optimizer: torch.optim.Optimizer) -> bool:
    """Allocate every parameter's state like a stand-in's after one step; False: cannot tell.

    The stand-in is a small plain tensor of the parameter's dtype, device and number of
    dimensions, in an optimizer of the same class and group settings. Each entry of its state
    must be either shaped like it (allocated like ``zeros_like(param)``, a DTensor for a DTensor
    parameter, as the optimizer itself would) or a 0-dim tensor or a number (copied). Costs a
    few allocations, where a real step on a sharded model costs a full optimizer pass.
    """
    try:
        signature = inspect.signature(type(optimizer).__init__).parameters
    except (TypeError, ValueError):
        return False
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.values())
    recipes: dict[tuple[int, torch.dtype, torch.device, int], dict[str, Any]] = {}
    plan: list[tuple[torch.Tensor, dict[str, Any]]] = []
    for group in optimizer.param_groups:
        settings = {
            k: v for k, v in group.items() if k != "params" and (takes_any or k in signature)
        }
        for p in group["params"]:
            if not p.requires_grad:
                continue
            local = _local(p)
            if local.dim() == 0:
                return False  # a 0-dim parameter's state cannot be told from a scalar
            key = (id(group), local.dtype, local.device, local.dim())
            if key not in recipes:
                recipe = _stand_in_state(type(optimizer), settings, local)
                if recipe is None:
                    return False
                recipes[key] = recipe
            plan.append((p, recipes[key]))
    with torch.no_grad():
        for p, recipe in plan:
            optimizer.state[p] = {
                k: _zeros_like(p) if v is _LIKE_PARAM else _copy_scalar(v)
                for k, v in recipe.items()
            }
    return True


def _zeros_like(p: torch.Tensor) -> torch.Tensor:
    """``torch.zeros_like(p)``; for a DTensor, its local zeros wrapped with ``p``'s layout.

    The same DTensor ``zeros_like`` would make, without dispatching it: in a process that has
    not run ops on this mesh yet (a spare) DTensor would first decide each shape's sharding,
    ~10 ms apiece.
    """
    if not isinstance(p, DTensor):
        return torch.zeros_like(p)
    return DTensor.from_local(
        torch.zeros_like(_local(p)),
        p.device_mesh,
        p.placements,
        run_check=False,
        shape=p.shape,
        stride=p.stride(),
    )


_LIKE_PARAM = object()
_STAND_IN_SIZES = (2, 3, 5, 7, 11, 13)


def _stand_in_state(
    cls: type, settings: dict[str, Any], like: torch.Tensor
) -> dict[str, Any] | None:
    """{state key: _LIKE_PARAM or the scalar value} after one step on a stand-in of ``like``."""
    if like.dim() > len(_STAND_IN_SIZES):
        return None
    shape = _STAND_IN_SIZES[: like.dim()]
    stand_in = torch.zeros(shape, dtype=like.dtype, device=like.device, requires_grad=True)
    try:
        opt = cls([stand_in], **settings)
        for group in opt.param_groups:
            _zero_lr(group)
        stand_in.grad = torch.zeros_like(stand_in)
        opt.step()
    except Exception:  # any optimizer we cannot mimic gets a real step
        return None
    recipe: dict[str, Any] = {}
    for k, v in opt.state.get(stand_in, {}).items():
        if not isinstance(v, torch.Tensor):
            recipe[k] = v
        elif v.shape == stand_in.shape and v.dtype == like.dtype and v.device == like.device:
            recipe[k] = _LIKE_PARAM
        elif v.dim() == 0:
            recipe[k] = v
        else:
            return None
    return recipe or None


def _copy_scalar(v: Any) -> Any:
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


def _reshard(modules: Sequence[FSDPModule]) -> None:
    """Register the sharded parameters of FSDP2 ``modules`` (no collective).

    A forward pass without a backward (an evaluation under ``no_grad()``) leaves the modules that
    do not reshard after forward (the root, by FSDP2's default, or every module with
    ``reshard_after_forward=False``) unsharded until their next forward: ``named_parameters()``
    then yields full, plain tensors in place of the local shards. FSDP2's own ``state_dict()``
    reshards first for the same reason; resharding an already sharded module does nothing.
    """
    for module in modules:
        module.reshard()


class TrainingState:
    """The live objects whose bytes make up one rank's snapshot.

    Args:
        model: The (FSDP2-sharded, DDP or plain) module. Its parameters and persistent buffers
            are captured; for a ``DTensor`` parameter only the local shard.
        optimizer: Any ``torch.optim`` optimizer whose per-parameter state is tensors (AdamW, SGD
            with momentum, ...). An empty state is created to learn its layout (see
            :func:`ensure_optimizer_state`) and dropped again, so training starts as it would
            without the engine, unless ``keep_optimizer_state`` (a restore overwrites it next).
        scheduler: An LR scheduler, or ``None``.
        blob_capacity: Bytes reserved for the non-tensor state (scheduler, hyper-parameters,
            step, RNG of ``random``/``numpy``, extras).
        keep_optimizer_state: Keep the state created to learn the layout (saves creating it
            again when a restore follows).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        *,
        blob_capacity: int = 256 * 1024,
        keep_optimizer_state: bool = False,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self._fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        self._cuda_rng = torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        fresh = optimizer is not None and not optimizer.state
        if fresh:
            assert optimizer is not None  # fresh implies it
            # The layout needs the shapes of the lazily-built optimizer state; build it with a
            # dry run, then drop it so training starts exactly as it would without the engine.
            ensure_optimizer_state(optimizer)
        try:
            self.layout = StateLayout.build(self._specs(), blob_capacity)
        finally:
            if fresh and not keep_optimizer_state:
                assert optimizer is not None  # fresh implies it
                optimizer.state.clear()
        self._num_tensor_entries = sum(not e.name.startswith("rng/") for e in self.layout.entries)
        # id(buffer) -> (weak reference to that buffer, its views); see views().
        self._views: dict[int, tuple[weakref.ref[torch.Tensor], list[torch.Tensor]]] = {}

    # -- which tensors -------------------------------------------------------------------------

    def _named_live(self) -> list[tuple[str, torch.Tensor]]:
        """(entry name, live tensor) in layout order, RNG entries excluded."""
        _reshard(self._fsdp_modules)
        out: list[tuple[str, torch.Tensor]] = []
        names = {id(p): n for n, p in self.model.named_parameters(remove_duplicate=False)}
        for name, p in self.model.named_parameters():
            out.append((f"param/{name}", p))
        for name, b in self.model.named_buffers():
            if b is not None and self._is_persistent(name):
                out.append((f"buffer/{name}", b))
        if self.optimizer is not None:
            for gi, group in enumerate(self.optimizer.param_groups):
                for pi, p in enumerate(group["params"]):
                    pname = names.get(id(p), f"group{gi}.{pi}")
                    for key, value in sorted(self.optimizer.state.get(p, {}).items()):
                        if isinstance(value, torch.Tensor):
                            out.append((f"optim/{pname}/{key}", value))
        return out

    def _is_persistent(self, fqn: str) -> bool:
        module_name, _, buf_name = fqn.rpartition(".")
        module = self.model.get_submodule(module_name) if module_name else self.model
        return buf_name not in module._non_persistent_buffers_set

    def _rng_entries(self) -> list[tuple[str, torch.Tensor]]:
        out = [("rng/cpu", torch.get_rng_state())]
        if self._cuda_rng:
            out.append(("rng/cuda", torch.cuda.get_rng_state()))
        return out

    def _specs(self) -> Iterator[tuple[str, torch.dtype, tuple[int, ...], tuple[int, ...], int]]:
        for name, t in self._named_live():
            global_shape, dim0 = _shard_geometry(t)
            local = _local(t)
            yield name, local.dtype, tuple(local.shape), global_shape, dim0
        for name, t in self._rng_entries():
            yield name, t.dtype, tuple(t.shape), tuple(t.shape), 0

    @property
    def optimizer_fresh(self) -> bool:
        """The optimizer has not built its state yet (no step taken since it was created)."""
        return self.optimizer is not None and not self.optimizer.state

    def live_tensors(self) -> list[torch.Tensor]:
        """Local tensors in layout order (RNG entries excluded); copies of these are snapshots.

        Raises:
            RuntimeError: the optimizer has not built its state yet (no step taken).
        """
        live = [_local(t) for _, t in self._named_live()]
        if len(live) != self._num_tensor_entries:
            raise RuntimeError(
                "the optimizer has no state yet: take snapshots after the first optimizer step "
                "(a restore creates the state itself)"
            )
        return live

    def _snapshot_pairs(self, buffer: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(view of ``buffer``, live tensor) for every non-empty entry that exists right now.

        Before the optimizer's first step its state entries do not exist yet: only parameters
        and buffers are paired (they come first in the layout), and the snapshot records that
        the optimizer was fresh.
        """
        return [(v, t) for _, v, t in self._snapshot_triples(buffer)]

    def _snapshot_triples(
        self, buffer: torch.Tensor
    ) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """:meth:`_snapshot_pairs` with each entry's byte offset in front."""
        live = [_local(t) for _, t in self._named_live()]
        if len(live) != self._num_tensor_entries and not self.optimizer_fresh:
            raise RuntimeError(
                "the optimizer state does not match the layout it was described with; "
                "parameters or optimizer state were added after the engine was set up"
            )
        entries = [e for e in self.layout.entries if not e.name.startswith("rng/")]
        views = self.views(buffer)
        for e, v, t in zip(entries, views, live):
            if v.shape != t.shape or v.dtype != t.dtype:
                raise LayoutMismatchError(
                    f"{e.name} is now {t.dtype} {tuple(t.shape)} but the engine was set up with "
                    f"{v.dtype} {tuple(v.shape)}: it changed shape or type after protect() began "
                    "(a resized embedding, a cast model); make that change in the factory "
                    "instead (it is called again after every recovery)"
                )
        return [(e.offset, v, t) for e, v, t in zip(entries, views, live) if v.numel()]

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Typed views of ``buffer`` for every non-RNG entry, in layout order.

        Cached per buffer object: snapshot slots live as long as the engine, and building 100s
        of views per snapshot costs as much as a fifth of the copy itself. The weak reference
        makes sure a recycled ``id`` of a dead buffer never returns stale views.
        """
        cached = self._views.get(id(buffer))
        if cached is not None and cached[0]() is buffer:
            return cached[1]
        out = []
        for e in self.layout.entries:
            if e.name.startswith("rng/"):
                continue
            out.append(
                buffer[e.offset : e.end].view(dtype_from_name(e.dtype)).view(e.shape)
                if e.nbytes
                else torch.empty(e.shape, dtype=dtype_from_name(e.dtype), device=buffer.device)
            )
        self._views = {k: v for k, v in self._views.items() if v[0]() is not None}
        if len(self._views) < 64:
            self._views[id(buffer)] = (weakref.ref(buffer), out)
        return out

    def digest(self) -> str:
        """SHA-256 of this rank's live state: every tensor's bytes, the RNG states, the
        scheduler, optimizer hyper-parameters and step counters (hex).

        Two ranks of two runs have the same digest exactly when their states are bitwise equal:
        what the correctness checks compare.
        """
        h = hashlib.sha256()
        for name, t in self._named_live():
            local = _local(t).detach().reshape(-1).contiguous().cpu()
            h.update(name.encode())
            h.update(local.view(torch.uint8).numpy().tobytes())
        for name, t in self._rng_entries():
            h.update(name.encode())
            h.update(t.cpu().numpy().tobytes())
        blob = msgpack.unpackb(self._blob(0, {}), raw=False, strict_map_key=False)
        for key in ("scheduler", "groups", "optim_scalars", "optimizer_fresh"):
            h.update(pack_small(blob[key]))
        return h.hexdigest()

    # -- the non-tensor state ------------------------------------------------------------------

    def _blob(self, step: int, extras: Mapping[str, Any]) -> bytes:
        np_state = np.random.get_state(legacy=True)  # the default, named for the typed overload
        assert isinstance(np_state, tuple)  # MT19937's: indexed below
        py_state = random.getstate()
        state = {
            "step": int(step),
            "extras": dict(extras),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "groups": [
                {k: v for k, v in g.items() if k != "params"}
                for g in (self.optimizer.param_groups if self.optimizer else [])
            ],
            "optim_scalars": self._optimizer_scalars(),
            "py_random": [py_state[0], list(py_state[1]), py_state[2]],
            # Before the first optimizer step there is no optimizer state to store: a restore
            # then leaves the optimizer fresh, so its first step is exactly a first step.
            "optimizer_fresh": self.optimizer_fresh,
            "np_random": [np_state[0], np_state[1].tobytes(), *np_state[2:]],
        }
        data = pack_small(state)
        if len(data) + _BLOB_LEN_BYTES > self.layout.blob_capacity:
            raise ValueError(
                f"the non-tensor state needs {len(data) + _BLOB_LEN_BYTES} bytes but "
                f"ReplicationConfig.blob_capacity_bytes is {self.layout.blob_capacity}; raise it "
                "or keep the extras small"
            )
        return data

    def _optimizer_scalars(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.optimizer is None:
            return out
        for gi, group in enumerate(self.optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                for key, value in self.optimizer.state.get(p, {}).items():
                    if not isinstance(value, torch.Tensor):
                        out[f"{gi}.{pi}/{key}"] = value
        return out

    # -- capture and restore -------------------------------------------------------------------

    def capture_small(self, buffer: torch.Tensor, step: int, extras: Mapping[str, Any]) -> None:
        """Write the RNG states and the non-tensor state (step, extras, ...) into ``buffer``.

        Cheap on a host ``buffer``; call it at the moment the snapshot stands for (RNG advances
        with every forward). A GPU ``buffer`` goes through :meth:`capture` with a staging.
        """
        for offset, data in self.small_pieces(step, extras):
            buffer[offset : offset + data.numel()].copy_(data)

    def copy_tensors_into(self, buffer: torch.Tensor) -> None:
        """Copy every live tensor into its range of ``buffer`` (one batched copy)."""
        pairs = self._snapshot_pairs(buffer)
        if pairs:
            with torch.no_grad():
                torch._foreach_copy_(
                    [d for d, _ in pairs], [s for _, s in pairs], non_blocking=True
                )

    def capture(
        self,
        buffer: torch.Tensor,
        step: int,
        extras: Mapping[str, Any] | None = None,
        staging: HostStaging | None = None,
    ) -> None:
        """Write the whole state (tensors, RNG, non-tensor state) into ``buffer``.

        With ``staging`` (for a GPU ``buffer``) nothing here waits for the GPU: the tensors on
        the buffer's device are one batched device-side copy, and every host-resident piece
        (CPU tensors such as a non-capturable AdamW's ``step``, the RNG states, the blob) goes
        through the staging buffers in one host-to-device copy, all enqueued on the current
        stream. The bytes written are the same either way.
        """
        if staging is None:
            self.copy_tensors_into(buffer)
            self.capture_small(buffer, step, extras or {})
            return
        device_pairs, host = self.split_pairs(buffer)
        if device_pairs:
            with torch.no_grad():
                torch._foreach_copy_(
                    [d for d, _ in device_pairs], [s for _, s in device_pairs], non_blocking=True
                )
        staging.stage(buffer, host + self.small_pieces(step, extras or {}))

    def split_pairs(
        self, buffer: torch.Tensor
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[tuple[int, torch.Tensor]]]:
        """The snapshot's tensors by where they live: ``(view, live)`` pairs of tensors on
        ``buffer``'s device, and ``(byte offset, bytes)`` of the others (host tensors of a GPU
        state, e.g. AdamW's ``step``), whose copies must not be issued one by one."""
        on_device: list[tuple[torch.Tensor, torch.Tensor]] = []
        elsewhere: list[tuple[int, torch.Tensor]] = []
        for offset, view, live in self._snapshot_triples(buffer):
            if live.device == buffer.device:
                on_device.append((view, live))
            else:
                elsewhere.append((offset, live.detach().reshape(-1).view(torch.uint8).cpu()))
        return on_device, elsewhere

    def small_pieces(self, step: int, extras: Mapping[str, Any]) -> list[tuple[int, torch.Tensor]]:
        """What :meth:`capture_small` writes, as ``(byte offset, host bytes)`` pieces."""
        pieces = []
        for name, t in self._rng_entries():
            e = self.layout.entry(name)
            pieces.append((e.offset, t.view(torch.uint8).flatten()))
        data = self._blob(step, extras)
        framed = len(data).to_bytes(_BLOB_LEN_BYTES, "little") + data
        pieces.append(
            (self.layout.blob_offset, torch.frombuffer(bytearray(framed), dtype=torch.uint8))
        )
        return pieces

    def staging_bytes(self) -> int:
        """Bytes :meth:`capture` stages through a :class:`HostStaging` for a GPU state: the RNG
        states, the whole blob region and every 0-dim entry (the CPU ``step`` counters; the
        optimizer may not have built them yet, so where they live is not known). A state with
        larger host tensors makes the staging grow at its first snapshot."""
        return self.layout.blob_capacity + sum(
            e.nbytes for e in self.layout.entries if e.name.startswith("rng/") or not e.shape
        )

    def read_blob(self, buffer: torch.Tensor) -> dict[str, Any]:
        """Decode the non-tensor state stored in ``buffer``."""
        region = buffer[
            self.layout.blob_offset : self.layout.blob_offset + self.layout.blob_capacity
        ].cpu()
        n = int.from_bytes(bytes(region[:_BLOB_LEN_BYTES].tolist()), "little")
        if not 0 < n <= self.layout.blob_capacity - _BLOB_LEN_BYTES:
            raise ValueError(f"corrupt snapshot: blob length {n}")
        raw = region[_BLOB_LEN_BYTES : _BLOB_LEN_BYTES + n].numpy().tobytes()
        blob: dict[str, Any] = unpack_small(raw)
        return blob

    def restore(self, buffer: torch.Tensor) -> tuple[int, dict[str, Any]]:
        """Put the state stored in ``buffer`` back into the live objects, in place.

        Returns:
            ``(step, extras)`` as given to :meth:`capture`.
        """
        blob = self.read_blob(buffer)
        fresh = bool(blob.get("optimizer_fresh"))
        if self.optimizer is not None:
            if fresh:
                self.optimizer.state.clear()
            else:
                ensure_optimizer_state(self.optimizer)
        with torch.no_grad():
            pairs = self._snapshot_pairs(buffer)
            if pairs:
                torch._foreach_copy_([t for _, t in pairs], [v for v, _ in pairs])
        for name, _ in self._rng_entries():
            e = self.layout.entry(name)
            _set_rng(name, buffer[e.offset : e.end].cpu().clone())
        self._restore_blob(blob)
        return blob["step"], blob["extras"]

    def small_state(self, step: int, extras: Mapping[str, Any] | None = None) -> bytes:
        """The RNG states and the non-tensor state as one msgpack document.

        What a checkpoint stores per rank beside the tensors (which DCP handles): the same
        content as a snapshot's RNG entries and blob region.
        """
        rng = {name: t.cpu().numpy().tobytes() for name, t in self._rng_entries()}
        packed: bytes = msgpack.packb({"rng": rng, "blob": self._blob(step, extras or {})})
        return packed

    @staticmethod
    def small_state_of(layout: StateLayout, buffer: torch.Tensor) -> bytes:
        """:meth:`small_state` of the rank whose snapshot (of ``layout``) ``buffer`` holds.

        How a survivor checkpoints the RNG, schedule and extras of a rank it holds a copy of.
        """
        rng = {
            e.name: buffer[e.offset : e.end].cpu().numpy().tobytes()
            for e in layout.entries
            if e.name.startswith("rng/")
        }
        region = buffer[layout.blob_offset : layout.blob_offset + layout.blob_capacity].cpu()
        n = int.from_bytes(bytes(region[:_BLOB_LEN_BYTES].tolist()), "little")
        if not 0 < n <= layout.blob_capacity - _BLOB_LEN_BYTES:
            raise ValueError(f"corrupt snapshot: blob length {n}")
        blob = region[_BLOB_LEN_BYTES : _BLOB_LEN_BYTES + n].numpy().tobytes()
        packed: bytes = msgpack.packb({"rng": rng, "blob": blob})
        return packed

    def load_small_state(self, data: bytes) -> tuple[int, dict[str, Any]]:
        """Apply :meth:`small_state`; returns ``(step, extras)``."""
        doc = msgpack.unpackb(data, raw=False)
        blob = unpack_small(doc["blob"])
        for name, raw in doc["rng"].items():
            if name == "rng/cpu" or self._cuda_rng:
                _set_rng(name, torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        self._restore_blob(blob)
        return blob["step"], blob["extras"]

    def _restore_blob(self, blob: dict[str, Any]) -> None:
        if self.scheduler is not None and blob["scheduler"] is not None:
            self.scheduler.load_state_dict(blob["scheduler"])
        if self.optimizer is not None:
            for group, saved in zip(self.optimizer.param_groups, blob["groups"]):
                for key, value in saved.items():
                    group[key] = tuple(value) if isinstance(group.get(key), tuple) else value
            for gi, group in enumerate(self.optimizer.param_groups):
                for pi, p in enumerate(group["params"]):
                    state = self.optimizer.state.get(p, {})
                    for key in state:
                        if not isinstance(state[key], torch.Tensor):
                            state[key] = blob["optim_scalars"][f"{gi}.{pi}/{key}"]
        version, internal, gauss = blob["py_random"]
        random.setstate((version, tuple(internal), gauss))
        kind, keys, *rest = blob["np_random"]
        np.random.set_state((kind, np.frombuffer(keys, dtype=np.uint32).copy(), *rest))
