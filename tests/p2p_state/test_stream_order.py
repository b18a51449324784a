"""What the training thread enqueues on a GPU, checked with stand-in streams and events.

The GPU itself is exercised by ``test_gpu.py`` and ``p2p-bench gpu-check``; here the order of
the calls is checked on the CPU: the snapshot copy is enqueued on a side stream after it waits
for the training stream, an event is recorded after the copy, and the next forward (which
mutates BatchNorm statistics) and the next optimizer step wait for that event first. The
host-resident pieces of a GPU snapshot go through one staging buffer, rewritten only once the
copy out of it has completed.
"""

from __future__ import annotations

import contextlib
import queue
import threading

import torch

from p2p_state.config import ReplicationConfig
from p2p_state.memory import MemoryKind
from p2p_state.replicator import Replicator
from p2p_state.snapshot import DoubleBuffer, HostStaging
from p2p_state.state import TrainingState


class Log(list):
    """One shared record of every call, in order."""


class StandInEvent:
    def __init__(self, log: Log, name: str, on_sync=None) -> None:
        self.log, self.name, self._on_sync = log, name, on_sync

    def record(self, stream=None) -> None:
        self.log.append(("record", self.name, getattr(stream, "name", "current")))

    def synchronize(self) -> None:
        if self._on_sync is not None:
            self._on_sync()
        self.log.append(("synchronize", self.name))


class StandInStream:
    def __init__(self, log: Log, name: str) -> None:
        self.log, self.name = log, name

    def wait_stream(self, other: StandInStream) -> None:
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: StandInEvent) -> None:
        self.log.append(("wait_event", self.name, event.name))


class StandInCuda:
    """The replicator's :class:`CudaStreams`, recording instead of enqueueing."""

    def __init__(self, log: Log) -> None:
        self.log = log
        self.training = StandInStream(log, "training")
        self.active = self.training
        self.events = 0

    def new_stream(self) -> StandInStream:
        return StandInStream(self.log, "side")

    def current(self) -> StandInStream:
        return self.active

    @contextlib.contextmanager
    def use(self, stream: StandInStream):
        before, self.active = self.active, stream
        try:
            yield
        finally:
            self.active = before

    def new_event(self) -> StandInEvent:
        self.events += 1
        return StandInEvent(self.log, f"copy{self.events}")


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _replicator(state: TrainingState, cuda: StandInCuda, post_in_step: bool = True) -> Replicator:
    """Only what replicate() and the fences use; the worker never runs. The round's transfers
    are recorded, not posted (``post_in_step``: replicate() posts them, as over NCCL)."""
    rep = Replicator.__new__(Replicator)
    rep.state, rep.config = state, ReplicationConfig()
    rep.kind, rep.device = MemoryKind.HOST, torch.device("cpu")
    rep._lock = threading.Lock()
    rep._idle = threading.Condition(rep._lock)
    rep._in_flight, rep._failure, rep._queue, rep._snapshots = 0, None, queue.Queue(), 0
    rep.own = DoubleBuffer(state.layout.total_bytes, MemoryKind.HOST, rep.device)
    rep.owners, rep.holders, rep.replicas, rep._post_in_step = (), (), {}, post_in_step
    rep.layout, rep.group = state.layout, None
    rep._use_streams(cuda)
    if cuda is not None:
        rep._post = lambda slot, replicas: cuda.log.append(("post", cuda.current().name))
    return rep


def test_replicate_enqueues_the_copy_on_the_side_stream_and_the_next_forward_waits_for_it():
    model, opt = _model_and_optimizer()
    state = TrainingState(model, opt)
    log = Log()
    cuda = StandInCuda(log)
    rep = _replicator(state, cuda)
    capture = state.capture

    def recorded_capture(*args, **kwargs):
        log.append(("capture on", cuda.current().name))
        return capture(*args, **kwargs)

    state.capture = recorded_capture  # type: ignore[method-assign]
    bn = model[1]
    bn.register_forward_hook(lambda *_: log.append(("forward mutated", "running_mean")))
    opt.register_step_pre_hook(lambda *_: log.append(("optimizer step", "parameters")))

    assert rep.replicate(1)
    assert log == [
        ("wait_stream", "side", "training"),  # the copy starts after the optimizer step
        ("capture on", "side"),
        ("record", "copy1", "side"),  # recorded after the copy, on its stream
        # The round's NCCL transfers, posted here on the training thread (the same point of
        # every rank's step) and from the side stream, so NCCL's stream waits for the copy.
        ("post", "side"),
    ]
    job = rep._queue.get_nowait()
    assert job.copied is rep._last_copy and job.step == 1
    log.clear()

    model(torch.randn(4, 8)).sum().backward()  # BatchNorm updates its running statistics
    opt.step()
    assert log == [
        ("wait_event", "training", "copy1"),  # before the forward mutates a snapshotted buffer
        ("forward mutated", "running_mean"),
        ("wait_event", "training", "copy1"),
        ("optimizer step", "parameters"),
    ]


def test_the_fences_go_with_the_replicator():
    model, opt = _model_and_optimizer()
    log = Log()
    rep = _replicator(TrainingState(model, opt), StandInCuda(log))
    rep._queue, rep._left_behind = queue.Queue(), False
    rep._worker = threading.Thread(target=lambda: None)
    rep._worker.start()
    rep.replicate(1)
    assert rep._stop_worker(5.0)
    log.clear()
    model(torch.randn(4, 8))
    opt.step()
    assert log == []  # no hook of a stopped replicator is left on the model or the optimizer


def test_without_a_gpu_nothing_is_enqueued_and_no_hook_is_installed():
    model, opt = _model_and_optimizer()
    rep = _replicator(TrainingState(model, opt), None)  # type: ignore[arg-type]
    assert rep._fence_handle is None and rep._forward_fence_handle is None
    assert rep.replicate(1) and rep._queue.get_nowait().copied is None


def test_staging_rewrites_its_host_buffer_only_after_the_copy_out_of_it_completed():
    log = Log()
    seen: list[bytes] = []
    staging: HostStaging

    def new_event() -> StandInEvent:
        # What the copy out of the host buffer would read, at the moment it is waited for.
        def check() -> None:
            seen.append(bytes(staging._host[:6].tolist()))

        return StandInEvent(log, f"h2d{len(log)}", on_sync=check)

    staging = HostStaging(torch.device("cpu"), 4, pin=False, new_event=new_event)
    assert staging.capacity == 4
    buffer = torch.zeros(32, dtype=torch.uint8)
    first = [(3, torch.tensor([1, 2], dtype=torch.uint8)), (20, torch.tensor([3, 4, 5, 6]).byte())]
    staging.stage(buffer, first)
    assert staging.capacity >= 6  # grown for six bytes
    assert buffer[3:5].tolist() == [1, 2] and buffer[20:24].tolist() == [3, 4, 5, 6]
    assert [e[0] for e in log] == ["record"]

    staging.stage(buffer, [(0, torch.tensor([9, 9, 9], dtype=torch.uint8))])
    assert [e[0] for e in log] == ["record", "synchronize", "record"]
    assert seen == [bytes([1, 2, 3, 4, 5, 6])]  # still the first snapshot's bytes when waited on
    assert buffer[:5].tolist() == [9, 9, 9, 1, 2]
    staging.stage(buffer, [])  # nothing to stage: nothing enqueued
    assert len(log) == 3


def test_a_staged_capture_writes_the_same_bytes_as_a_direct_one():
    model, opt = _model_and_optimizer()
    state = TrainingState(model, opt)
    direct = torch.zeros(state.layout.total_bytes, dtype=torch.uint8)
    staged = torch.zeros_like(direct)
    state.capture(direct, 7, {"sampler": 3})
    staging = HostStaging(
        torch.device("cpu"),
        state.staging_bytes(),
        pin=False,
        new_event=lambda: StandInEvent(Log(), "h2d"),
    )
    state.capture(staged, 7, {"sampler": 3}, staging)
    assert torch.equal(direct, staged)
    assert state.read_blob(staged)["extras"] == {"sampler": 3}


def test_host_resident_tensors_of_a_device_state_are_staged_not_copied_one_by_one():
    # Parameters on another device than the host (meta stands in for the GPU), AdamW's step
    # counters on the host, as a non-capturable AdamW keeps them.
    model = torch.nn.Linear(4, 4, device="meta")
    opt = torch.optim.AdamW(model.parameters())
    for i, p in enumerate(model.parameters()):
        opt.state[p] = {
            "step": torch.tensor(float(10 + i)),
            "exp_avg": torch.zeros_like(p),
            "exp_avg_sq": torch.zeros_like(p),
        }
    state = TrainingState(model, opt)
    buffer = torch.empty(state.layout.total_bytes, dtype=torch.uint8, device="meta")
    on_device, host = state.split_pairs(buffer)
    assert len(on_device) == 6  # weight, bias and their two moments: one batched copy
    steps = {e.offset: e.name for e in state.layout.entries if e.name.endswith("/step")}
    assert {offset: steps.get(offset) for offset, _ in host} == {
        state.layout.entry("optim/weight/step").offset: "optim/weight/step",
        state.layout.entry("optim/bias/step").offset: "optim/bias/step",
    }
    values = sorted(b.view(torch.float32).item() for _, b in host)
    assert values == [10.0, 11.0]
    # Their room is reserved ahead: every 0-dim entry, the RNG states and the blob region.
    rng = sum(e.nbytes for e in state.layout.entries if e.name.startswith("rng/"))
    assert state.staging_bytes() == state.layout.blob_capacity + rng + 2 * 4


def test_the_staging_reserved_at_start_up_holds_a_snapshot_s_host_pieces():
    # A GPU state (meta stands in) with AdamW's step counters on the host: the staging made
    # with the replicator does not have to grow (no pinning) when snapshots are taken.
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).to("meta")
    opt = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        opt.state[p] = {
            "step": torch.tensor(3.0),
            "exp_avg": torch.zeros_like(p),
            "exp_avg_sq": torch.zeros_like(p),
        }
    state = TrainingState(model, opt)
    log = Log()
    staging = HostStaging(
        torch.device("meta"),
        state.staging_bytes(),
        pin=False,
        new_event=lambda: StandInEvent(log, "h2d"),
    )
    reserved = staging.capacity
    buffer = torch.empty(state.layout.total_bytes, dtype=torch.uint8, device="meta")
    for step in (1, 2):
        state.capture(buffer, step, {"position": list(range(100))}, staging)
    assert staging.capacity == reserved
    assert [e[0] for e in log] == ["record", "synchronize", "record"]  # one staged copy each


def test_gloo_transfers_of_a_side_stream_copy_are_posted_by_the_worker_after_the_copy():
    # Pinned snapshots over gloo: gloo reads host memory unordered with CUDA streams, so the
    # transfers wait for the copy, off the training thread (which only enqueues).
    model, opt = _model_and_optimizer()
    log = Log()
    cuda = StandInCuda(log)
    rep = _replicator(TrainingState(model, opt), cuda, post_in_step=False)
    assert rep.replicate(1)
    assert ("post", "side") not in log
    job = rep._queue.get_nowait()
    assert job.transfer is None
    log.clear()
    stop = RuntimeError("the headers come next")

    def post(slot, replicas):
        log.append(("post", cuda.current().name))
        raise stop

    rep._post = post
    with contextlib.suppress(RuntimeError):
        rep._run_round(job)
    assert log == [("synchronize", "copy1"), ("post", "side")]
