"""The checks of ``p2p-bench gpu-check`` that train: a one-rank FSDP2 model on its own mesh.

Each check is a function of the device: on a GPU it runs over NCCL with the engine's GPU
memory (side stream, pinned staging); on a CPU the same code runs over gloo with host memory,
which is how the test suite checks the parts that do not need a GPU. The checks that only mean
something on a GPU (the stream race, the allocator's peaks) refuse a CPU device.

- :func:`bitwise_restore`: capture, one more step, restore, the same step again: bitwise equal,
  for the default (foreach), fused and capturable AdamW.
- :func:`replicate_blocking`: host time spent in ``Replicator.replicate()`` per step against the
  step, with the host-resident pieces staged (the engine) and copied one by one (before).
- :func:`stream_race`: a forward that mutates BatchNorm statistics right after a snapshot whose
  copy is held back on the side stream: with the fence the snapshot holds the values before the
  forward; without it the check must see them overwritten (else it proves nothing).
- :func:`rebuild_peak`: peak GPU memory of rebuilding after an exception in a step, with the
  failed step's frames released (the engine) and kept.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from bench.models import TinyLM, build_model, lm_loss, shard, synthetic_batch
from p2p_state.config import ReplicationConfig
from p2p_state.memory import MemoryKind, allocate
from p2p_state.placement import Placement
from p2p_state.replicator import Replicator
from p2p_state.snapshot import HostStaging
from p2p_state.state import TrainingState

#: AdamW settings checked: torch's default implementation (foreach, CPU ``step`` counters),
#: the fused kernel, and the capturable one (``step`` on the GPU; GPU only).
ADAMW_VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "fused": {"fused": True},
    "capturable": {"capturable": True},
}

_ALONE = Placement(1, 1, 0, ((),))
"""A one-rank world holds no replica: rounds snapshot, checksum and commit only."""


@contextlib.contextmanager
def one_rank_group(device: torch.device) -> Iterator[None]:
    """A default process group of this process alone (NCCL on a GPU, gloo on a CPU), unless
    one exists; destroyed afterwards if it was made here."""
    if dist.is_initialized():
        yield
        return
    if device.type == "cuda":
        store = dist.HashStore()  # type: ignore[attr-defined]
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=device)
    else:
        store = dist.HashStore()  # type: ignore[attr-defined]
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _build(device: torch.device, variant: str, preset: str) -> tuple[TinyLM, torch.optim.Optimizer]:
    model = shard(build_model(preset, seed=0).to(device))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **ADAMW_VARIANTS[variant])
    return model, opt


def _train(model: TinyLM, opt: torch.optim.Optimizer, step: int, device: torch.device) -> None:
    tokens = synthetic_batch(model.cfg, step=step, rank=0, batch_size=4).to(device)
    lm_loss(model, tokens).backward()  # type: ignore[no-untyped-call]
    opt.step()
    opt.zero_grad(set_to_none=True)


def _capture(state: TrainingState, device: torch.device, step: int) -> torch.Tensor:
    """A snapshot as the replicator takes it on ``device`` (side stream and staging on a GPU),
    with the training stream fenced on its copy."""
    kind = MemoryKind.GPU if device.type == "cuda" else MemoryKind.HOST
    buffer = allocate(state.layout.total_bytes, kind, device)
    if device.type != "cuda":
        state.capture(buffer, step, {})
        return buffer
    staging = HostStaging(device, state.staging_bytes())
    side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        state.capture(buffer, step, {}, staging)
        copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
        copied.record(side)
    torch.cuda.current_stream(device).wait_event(copied)
    return buffer


def bitwise_restore(device: torch.device, variant: str, preset: str = "small") -> dict[str, Any]:
    """Capture after two steps, take step 3, restore the capture, take step 3 again.

    Returns:
        ``variant``; ``restored_equal`` (the restored state's digest is the captured one's),
        ``redone_equal`` (step 3 redone from the restore is bitwise step 3), ``moved`` (step 3
        changed the state: the comparison is not vacuous) and ``passed``; or ``error``.
    """
    try:
        with one_rank_group(device):
            torch.manual_seed(1)
            model, opt = _build(device, variant, preset)
            for step in (1, 2):
                _train(model, opt, step, device)
            state = TrainingState(model, opt)
            buffer = _capture(state, device, 2)
            captured = state.digest()
            _train(model, opt, 3, device)
            after = state.digest()
            state.restore(buffer)
            restored = state.digest()
            _train(model, opt, 3, device)
            redone = state.digest()
    except Exception as e:  # reported per variant; the others still run
        return {"variant": variant, "passed": False, "error": f"{type(e).__name__}: {e}"}
    out = {
        "variant": variant,
        "restored_equal": restored == captured,
        "redone_equal": redone == after,
        "moved": after != captured,
    }
    out["passed"] = all(out[k] for k in ("restored_equal", "redone_equal", "moved"))
    return out


def replicate_blocking(
    device: torch.device, preset: str = "example", steps: int = 10, variant: str = "default"
) -> dict[str, Any]:
    """Host seconds ``replicate()`` takes right after a step's work is enqueued, per step.

    The step's own time runs from its first enqueue to the GPU finishing it. Measured with the
    engine's staging of host-resident pieces and without it (each piece a separate copy from
    pageable memory, which waits for the side stream and so for the optimizer step).
    """
    with one_rank_group(device):
        model, opt = _build(device, variant, preset)
        _train(model, opt, 0, device)
        state = TrainingState(model, opt)
        rep = Replicator(state, ReplicationConfig(timeout_s=300), placement=_ALONE)
        out: dict[str, Any] = {"preset": preset, "variant": variant, "steps": steps}
        try:
            staging = rep._staging
            ways = [("staged", staging), ("unstaged", None)] if staging else [("host", None)]
            for way, (label, use) in enumerate(ways):
                rep._staging = use
                blocked, whole = [], []
                for step in range(way * steps + 1, (way + 1) * steps + 1):
                    rep.flush()
                    t0 = time.perf_counter()
                    _train(model, opt, step, device)
                    t1 = time.perf_counter()
                    rep.replicate(step)
                    t2 = time.perf_counter()
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    whole.append(time.perf_counter() - t0)
                    blocked.append(t2 - t1)
                out[f"{label}_blocked_ms"] = statistics.median(blocked) * 1e3
                out[f"{label}_step_ms"] = statistics.median(whole) * 1e3
                out[f"{label}_vs_step"] = statistics.median(blocked) / statistics.median(whole)
            rep.flush()
        finally:
            rep.close()
    return out


class _Norm(torch.nn.Module):
    """A layer whose forward mutates a snapshotted buffer (BatchNorm's running statistics)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(width, width)
        self.bn = torch.nn.BatchNorm1d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.bn(self.lin(x))
        return out


def stream_race(
    device: torch.device, width: int = 4096, hold_cycles: int = 200_000_000
) -> dict[str, Any]:
    """Hold the side stream back before a snapshot, then run a forward at once.

    Returns:
        ``fenced_equal``: with the engine's forward fence the snapshot holds the running mean
        from before the forward; ``unfenced_differs``: with the fence removed the same sequence
        captured the overwritten values (the check can see a race); ``passed``.
    """
    if device.type != "cuda":
        raise ValueError("the stream race check needs a CUDA device")
    with one_rank_group(device):
        torch.manual_seed(0)
        model = _Norm(width).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(64, width, device=device)
        model(x).sum().backward()
        opt.step()
        state = TrainingState(model, opt)
        rep = Replicator(state, ReplicationConfig(timeout_s=300), placement=_ALONE)
        entry = state.layout.entry("buffer/bn.running_mean")
        out: dict[str, Any] = {"width": width}
        try:
            for step, fenced in ((1, True), (2, False)):
                rep.flush()
                if not fenced and rep._forward_fence_handle is not None:
                    rep._forward_fence_handle.remove()
                    rep._forward_fence_handle = None
                running_mean = model.bn.running_mean
                assert running_mean is not None  # BatchNorm1d tracks running stats by default
                before = running_mean.clone()
                with torch.cuda.stream(rep._stream):
                    torch.cuda._sleep(hold_cycles)  # type: ignore[no-untyped-call]  # the copy starts late
                rep.replicate(step)
                with torch.no_grad():
                    model(x)  # updates running_mean
                torch.cuda.synchronize(device)
                rep.flush()
                held = rep.read(0, step, entry.offset, entry.end).view(torch.float32)
                same = torch.equal(held, before.view(-1))
                out["fenced_equal" if fenced else "unfenced_differs"] = same if fenced else not same
        finally:
            rep.close()
    out["passed"] = bool(out.get("fenced_equal"))
    return out


def rebuild_peak(device: torch.device, preset: str = "example") -> dict[str, Any]:
    """Peak GPU memory of rebuilding the model and taking a step after a step failed.

    The failure comes after the forward, with its activations alive in the failed frame. The
    rebuild follows the engine (``released``): the traceback cut, the old model and optimizer
    dropped and collected (an FSDP2 model sits in reference cycles). Against it: ``kept``, the
    rebuild inside the ``except`` with the failed frames alive, and ``uncollected``, frames cut
    but no collection. GiB, and each against a plain step's peak.
    """
    if device.type != "cuda":
        raise ValueError("the rebuild peak check needs a CUDA device")
    from recovery.faults import without_frames

    def failing_step(model: TinyLM, step: int) -> None:
        tokens = synthetic_batch(model.cfg, step=step, rank=0, batch_size=8).to(device)
        loss = lm_loss(model, tokens)
        raise RuntimeError(f"injected fault after the forward (loss {loss.shape})")

    def rebuild() -> float:
        torch.cuda.reset_peak_memory_stats(device)
        model, opt = _build(device, "default", preset)
        _train(model, opt, 1, device)
        return torch.cuda.max_memory_allocated(device) / 2**30

    out: dict[str, Any] = {"preset": preset}
    with one_rank_group(device):
        gc.collect()
        out["plain_step_gib"] = rebuild()
        for how in ("released", "kept", "uncollected"):
            gc.collect()
            model, opt = _build(device, "default", preset)
            _train(model, opt, 1, device)
            fault: BaseException | None = None
            try:
                failing_step(model, 2)
            except RuntimeError as e:
                if how == "kept":
                    del model, opt
                    gc.collect()
                    out["kept_gib"] = rebuild()
                else:
                    fault = without_frames(e)
            if fault is not None:
                del model, opt
                if how == "released":
                    gc.collect()
                out[f"{how}_gib"] = rebuild()
            fault = None
    for how in ("released", "kept", "uncollected"):
        out[f"{how}_vs_plain"] = out[f"{how}_gib"] / out["plain_step_gib"]
    return out
