"""``p2p-bench gpu-check``: check the GPU path on this machine's GPUs, with ratios.

What it runs, each against a reference measured in the same run: the GPU unit tests
(``pytest -m gpu``); pinned device-to-host and host-to-device copies against a plain
device-to-device ``copy_`` of the same size; the snapshot checksum on the GPU (the cupy kernel,
or torch ops where cupy is missing) and on the host against the copy bandwidth, and whether both
give the same value; pinned-memory allocation time against size; and, on a one-rank FSDP2 mesh
over NCCL (:mod:`bench.gpu_state_checks`), bitwise capture and restore with the default, fused
and capturable AdamW, the host time ``replicate()`` takes against a step, the stream race with
a forward that mutates buffers, and the peak memory of a rebuild after an exception. On a
machine without CUDA it says so in one line and exits 0.

    p2p-bench gpu-check --mib 1024 --out-dir reports/gpu-check
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.bench_reports import CheckError, CheckResult, GpuCheckReport, ReplicateReport
from bench.errors import UsageError
from bench.fault_runs import machine
from bench.flags import MODEL_PRESETS, count
from bench.report_dir import command_line, finish_with_table, report_dir

#: The project's root: the sub-runs are started from it.
ROOT = Path(__file__).resolve().parent.parent


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``p2p-bench gpu-check``."""
    p.add_argument("--mib", type=count(1), default=1024, help="bytes per copy and checksum, MiB")
    p.add_argument("--repeats", type=count(1), default=5, help="timed repetitions (median)")
    p.add_argument("--skip-tests", action="store_true", help="do not run the GPU unit tests")
    p.add_argument(
        "--only",
        metavar="CHECK[,CHECK...]",
        help="run only these checks (to rerun one that failed): " + ", ".join(CHECKS),
    )
    p.add_argument(
        "--model",
        default="example",
        choices=MODEL_PRESETS,
        help="example model preset for the replicate() and rebuild checks",
    )
    p.add_argument(
        "--out-dir",
        "--out",
        dest="out_dir",
        default=None,
        help="report folder (default reports/gpu-check-<time>; --out: its earlier name)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    """Run the checks; 0 also where there is no GPU (nothing to check)."""
    only = _only(args.only)
    if not torch.cuda.is_available():
        line = "gpu-check: no CUDA device on this machine; nothing to check"
        print(json.dumps({"benchmark": "gpu-check", "cuda": False}) if args.json else line)
        return 0
    report = GpuCheckReport(
        device=torch.cuda.get_device_name(),
        num_gpus=torch.cuda.device_count(),
        machine=machine(),
        command=command_line(args),
    )
    folder = report_dir(args, "gpu-check")
    device = torch.device("cuda", torch.cuda.current_device())
    checks: dict[str, Callable[[], CheckResult]] = {
        "copies": lambda: _copies(args.mib << 20, args.repeats),
        "checksum": lambda: _checksums(args.mib << 20, args.repeats),
        "pinned_alloc": _pinned_alloc,
        **_state_checks(device, args.model),
    }
    checks["replication"] = lambda: _replication(folder, args.model)
    checks["kill_and_recover"] = lambda: _kill_and_recover(folder, args.model)
    if not args.skip_tests:  # last: the longest, and the measurements need not wait for it
        checks["unit_tests"] = lambda: _unit_tests(folder)
    left_out = [name for name in CHECKS if name not in checks or (only and name not in only)]
    for name, check in checks.items():
        if name not in left_out:
            report.checks[name] = _guarded(check)
            _write_json(report, folder)  # a run cut short still leaves what it measured
    report.not_measured = ["replication and recovery across machines (one machine here)"]
    if left_out:
        report.not_measured.append("left out: " + ", ".join(left_out))
    finish_with_table(args, report.to_json(), _table(report), folder=folder)
    return 0 if report.passed else 1


def _only(value: str | None) -> list[str]:
    """The checks ``--only`` names (empty: all)."""
    names = [n.strip() for n in (value or "").split(",") if n.strip()]
    unknown = [n for n in names if n not in CHECKS]
    if unknown or (value is not None and not names):
        raise UsageError(
            f"--only: no check named {', '.join(unknown) or repr(value)}; "
            f"name one or more of {', '.join(CHECKS)}, separated by commas"
        )
    return names


def _guarded(check: Callable[[], CheckResult]) -> CheckResult | CheckError:
    """The check's result, or its error if it raised: one broken check (a first run on a new
    machine) must not lose the others' figures."""
    try:
        return check()
    except Exception as e:
        return CheckError(f"{type(e).__name__}: {e}", traceback.format_exc())


def _state_checks(device: torch.device, preset: str) -> dict[str, Callable[[], Any]]:
    from bench import gpu_state_checks as checks

    return {
        "bitwise_restore": lambda: [
            checks.bitwise_restore(device, v) for v in checks.ADAMW_VARIANTS
        ],
        "replicate_blocking": lambda: checks.replicate_blocking(device, preset),
        "stream_race": lambda: checks.stream_race(device),
        "rebuild_peak": lambda: checks.rebuild_peak(device, preset),
    }


def _unit_tests(folder: Path) -> dict[str, Any]:
    """Run ``pytest -m gpu``; its whole output goes to ``unit-tests.log`` in the report folder."""
    proc = subprocess.run(
        # The project's addopts already ask for -q: a second one would drop the summary line.
        [sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "tests"],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=_python_path()),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=1800,
    )
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "unit-tests.log").write_text(proc.stdout)
    lines = proc.stdout.strip().splitlines()
    counts = [line for line in lines if _PYTEST_SUMMARY.search(line)]
    return {
        "passed": proc.returncode == 0,
        "summary": (counts or lines or [""])[-1].strip("= "),
        "failures": [line for line in lines if line.startswith(("FAILED", "ERROR"))],
    }


#: pytest's closing line: ``8 passed, 3 skipped in 12.01s`` (between ``=`` rules without -q).
_PYTEST_SUMMARY = re.compile(r"\d+ (passed|failed|skipped|errors?|deselected)\b.* in [\d.]+s")

#: The fault of the kill-and-recover check: a rank of the second node, mid-run.
KILL = "kill:rank=3@step=6"


def _kill_and_recover(folder: Path, preset: str, steps: int = 12) -> dict[str, Any]:
    """The example job on this machine's GPUs, 2 nodes of 2 ranks and a spare, rank 3 killed:
    the survivors abort their NCCL groups, the spare takes the rank, the state comes back from
    peers over NCCL; bitwise against the fault-free run (``p2p-bench inject``).

    Every process is a host of its own to NCCL (:mod:`bench.shared_gpu`), so this runs on any
    number of GPUs; with fewer GPUs than ranks NCCL moves the bytes over its socket transport.
    """
    out = folder / "kill-and-recover"
    with tempfile.TemporaryDirectory(prefix="p2p-gpu-check-") as work:
        inject = ["inject", "--json", "--quiet", "--steps", str(steps), "--fault", KILL]
        inject += ["--model", preset, "--device", "auto"]  # cuda here; gloo where tested
        inject += ["--checkpoint-every", "4", "--out-dir", str(out), "--work-dir", work]
        inject += ["--timeout", str(RUN_TIMEOUT_S)]
        try:  # two runs (fault-free and faulty) and the report: within three run deadlines
            lines = _bench(inject, folder / "kill-and-recover.log", 3 * RUN_TIMEOUT_S, ok=(0, 1))
        finally:  # the processes' own logs, what a failed recovery is read from
            _keep_logs(Path(work), out / "logs")
    report = json.loads(lines[-1])
    run = report["modes"]["checkpointless"]
    fault = (run["faults"] or [{}])[0]
    return {
        "fault": KILL,
        # Bitwise alone is not enough: a job that restarted every process from its initial
        # state (survivors lost) also ends bitwise equal, with no recovery from peers at all.
        "passed": bool(run["bitwise_equal"])
        and not run["not_fired"]
        and fault.get("restored_from") == "peers",
        "bitwise_equal": run["bitwise_equal"],
        "differences": run["differences"],
        "restored_from": fault.get("restored_from"),
        "downtime_s": fault.get("downtime_s"),
        "steps_lost": fault.get("steps_lost"),
        "phases_ms": {k: v * 1e3 for k, v in fault.get("phases", {}).items()},
        "report": str(out / "report.json"),
    }


def _keep_logs(work: Path, into: Path) -> None:
    """Copy every log under ``work`` into ``into``, named by its path under ``work``."""
    for log in sorted(work.rglob("*.log")):
        into.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(log, into / "-".join(log.relative_to(work).parts))


def _replication(folder: Path, preset: str, nproc: int = 2) -> dict[str, Any]:
    """``p2p-bench replicate --device cuda`` on two ranks: the replicator's transfer over NCCL
    from GPU memory against a plain ``isend``/``irecv`` of the same bytes on the same group,
    and the step time with replication on against off."""
    args = ["replicate", "--json", "--device", "cuda", "--model", preset]
    args += ["--nproc", str(nproc), "--ranks-per-node", "1", "--timeout", str(RUN_TIMEOUT_S)]
    args += ["--out-dir", str(folder / "replication")]
    lines = _bench(args, folder / "replication.log", RUN_TIMEOUT_S)
    r = ReplicateReport.from_json(json.loads(lines[-1]))
    keep = [
        *("replication_backend", "replica_memory", "snapshot_mib_per_rank", "round_gbps"),
        *("replication_gbps", "raw_sendrecv_gbps", "replication_vs_raw", "overhead_pct"),
        *("step_time_ms_off", "step_time_ms_on", "snapshot_vs_memcpy"),
    ]
    out = {k: getattr(r, k) for k in keep}
    # What the training thread pays per round: enqueueing the copy and posting the transfers.
    out["copy_ms"] = r.round_ms_in_training.copy
    out["post_ms"] = r.round_ms_in_training.post
    out["transport"] = (
        "NCCL's socket transport (the ranks share a GPU)"
        if torch.cuda.device_count() < nproc
        else "NCCL between GPUs of this machine"
    )
    return out


#: Deadline of one multi-process run inside a check, seconds.
RUN_TIMEOUT_S = 240


def _bench(args: list[str], log: Path, timeout_s: float, ok: tuple[int, ...] = (0,)) -> list[str]:
    """Run ``p2p-bench ARGS`` within ``timeout_s``; its whole output goes to ``log``.

    Returns its standard output's lines (the last one its ``--json`` report).

    Raises:
        RuntimeError: it exited with a code not in ``ok``, printed nothing, or ran out of time;
            the message ends with its last line of errors and names the log.
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "bench.cli", *args],
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=_python_path()),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired as e:
        log.write_text(_text(e.stdout) + _text(e.stderr))
        raise RuntimeError(f"p2p-bench {args[0]} ran past {timeout_s:.0f} s (see {log})") from None
    log.write_text(proc.stdout + proc.stderr)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode not in ok or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"p2p-bench {args[0]} exited {proc.returncode}: {tail} (see {log})")
    return lines


def _text(data: str | bytes | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""


def _python_path() -> str:
    """The project first, for the child processes (also where it is not installed)."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)


def _timed(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``fn`` on the GPU (CUDA events), after one warm-up call."""
    fn()
    times: list[float] = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def _copies(nbytes: int, repeats: int) -> dict[str, Any]:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    d2d = _timed(lambda: dst.copy_(src), repeats)
    d2h = _timed(lambda: pinned.copy_(src, non_blocking=True), repeats)
    h2d = _timed(lambda: dst.copy_(pinned, non_blocking=True), repeats)
    return {
        "bytes": nbytes,
        "d2d_gbps": nbytes / d2d / 1e9,
        "pinned_d2h_gbps": nbytes / d2h / 1e9,
        "pinned_h2d_gbps": nbytes / h2d / 1e9,
        "d2h_vs_d2d": d2d / d2h,
        "h2d_vs_d2d": d2d / h2d,
    }


def _checksums(nbytes: int, repeats: int) -> dict[str, Any]:
    from p2p_state import checksum as ck

    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_s = _timed(lambda: dst.copy_(src), repeats)
    full = src[: nbytes // ck.BLOCK_BYTES * ck.BLOCK_BYTES]
    gpu_s = _timed(lambda: ck._block_digests_gpu(full), repeats)
    host = src.cpu()
    t0 = time.perf_counter()
    host_value = ck.checksum(host)
    host_s = time.perf_counter() - t0
    return {
        "kernel": "cupy" if ck._cupy_kernel() is not None else "torch ops (cupy missing)",
        "gpu_gbps": nbytes / gpu_s / 1e9,
        "gpu_vs_d2d_copy": copy_s / gpu_s,
        "host_gbps": nbytes / host_s / 1e9,
        "gpu_equals_host": ck.checksum(src) == host_value,
    }


def _pinned_alloc() -> list[dict[str, Any]]:
    """Time to pin fresh host memory (what a buffer first allocated on a spare's critical path
    costs), and what the caching host allocator really takes for it (rounded up to a power of
    two) against :func:`~p2p_state.memory.pinned_footprint`."""
    from p2p_state.memory import pinned_footprint

    empty_cache = getattr(torch._C, "_host_emptyCache", None)  # else cached blocks are reused
    out = []
    for mib in (96, 256, 1024):
        if empty_cache is not None:
            empty_cache()
        before = _pinned_bytes()
        t0 = time.perf_counter()
        buf = torch.empty(mib << 20, dtype=torch.uint8, pin_memory=True)
        alloc_ms = (time.perf_counter() - t0) * 1e3
        out.append(
            {
                "mib": mib,
                "alloc_ms": alloc_ms,
                "taken_mib": (_pinned_bytes() - before) / 2**20,
                "expected_mib": pinned_footprint(mib << 20) / 2**20,
                "fresh": empty_cache is not None,
            }
        )
        del buf
    if empty_cache is not None:
        empty_cache()
    return out


def _pinned_bytes() -> int:
    """Pinned bytes the caching host allocator holds (its blocks, rounded, cached or not)."""
    stats = torch.cuda.memory.host_memory_stats()
    return int(stats.get("allocated_bytes.current", 0))


def _table(report: GpuCheckReport) -> str:
    lines = [f"gpu-check on {report.device} x{report.num_gpus}"]
    if "unit_tests" not in report.checks:
        lines.append("  unit tests       not run")
    for name, render in _SECTIONS.items():
        value = report.checks.get(name)
        if isinstance(value, CheckError):
            lines.append(f"  {name:<16} ERROR {value.error}")
        elif value is not None:
            lines += render(value)
    lines.append("  not measured yet: " + "; ".join(report.not_measured or []))
    return "\n".join(lines)


def _unit_test_lines(t: dict[str, Any]) -> list[str]:
    return [f"  unit tests       {t['summary']}", *(f"    {f}" for f in t.get("failures", []))]


def _copy_lines(c: dict[str, Any]) -> list[str]:
    return [
        f"  d2d copy_        {c['d2d_gbps']:.1f} GB/s (reference)",
        f"  pinned d2h       {c['pinned_d2h_gbps']:.1f} GB/s ({c['d2h_vs_d2d']:.2f}x d2d)",
        f"  pinned h2d       {c['pinned_h2d_gbps']:.1f} GB/s ({c['h2d_vs_d2d']:.2f}x d2d)",
    ]


def _checksum_lines(k: dict[str, Any]) -> list[str]:
    return [
        f"  checksum on GPU  {k['gpu_gbps']:.1f} GB/s ({k['gpu_vs_d2d_copy']:.2f}x d2d), "
        f"{k['kernel']}; equals host: {k['gpu_equals_host']}",
        f"  checksum on host {k['host_gbps']:.1f} GB/s",
    ]


def _pin_lines(allocs: list[dict[str, Any]]) -> list[str]:
    return [
        f"  pin {a['mib']:>4} MiB     {a['alloc_ms']:.1f} ms, takes {a['taken_mib']:.0f} MiB "
        f"(expected {a['expected_mib']:.0f})" + ("" if a["fresh"] else " (may reuse the cache)")
        for a in allocs
    ]


def _restore_lines(results: list[dict[str, Any]]) -> list[str]:
    return [
        f"  restore AdamW {r['variant']:<10} "
        + ("bitwise" if r["passed"] else f"FAILED {r.get('error') or r}")
        for r in results
    ]


def _blocking_lines(b: dict[str, Any]) -> list[str]:
    return [
        f"  replicate() host {b['staged_blocked_ms']:.2f} ms per {b['staged_step_ms']:.1f} ms "
        f"step ({b['staged_vs_step']:.3f}x); copying host pieces one by one: "
        f"{b['unstaged_blocked_ms']:.2f} ms ({b['unstaged_vs_step']:.3f}x)"
    ]


def _race_lines(race: dict[str, Any]) -> list[str]:
    return [
        f"  stream race      fenced snapshot intact: {race['fenced_equal']}; "
        f"without the fence it is overwritten: {race.get('unfenced_differs')}"
    ]


def _peak_lines(peak: dict[str, Any]) -> list[str]:
    return [
        f"  rebuild peak     {peak['released_gib']:.2f} GiB as the engine does it "
        f"({peak['released_vs_plain']:.2f}x a plain step); failed frames kept "
        f"{peak['kept_gib']:.2f} GiB ({peak['kept_vs_plain']:.2f}x); old model not "
        f"collected {peak['uncollected_gib']:.2f} GiB ({peak['uncollected_vs_plain']:.2f}x)"
    ]


def _replication_lines(r: dict[str, Any]) -> list[str]:
    return [
        f"  replication      {r['replication_gbps']:.2f} GB/s over {r['replication_backend']} "
        f"from {r['replica_memory']} memory ({r['replication_vs_raw']:.2f}x raw send/recv "
        f"{r['raw_sendrecv_gbps']:.2f} GB/s; whole round {r['round_gbps']:.2f} GB/s), "
        f"{r['snapshot_mib_per_rank']:.0f} MiB per rank; {r['transport']}",
        f"  step with it     {r['step_time_ms_on']:.1f} ms against {r['step_time_ms_off']:.1f} "
        f"ms without ({r['overhead_pct']:+.1f} %); the training thread enqueues the copy in "
        f"{r['copy_ms']:.2f} ms and posts the transfers in {r['post_ms']:.2f} ms",
    ]


def _kill_lines(k: dict[str, Any]) -> list[str]:
    verdict = "bitwise" if k["passed"] else f"FAILED {'; '.join(k['differences']) or k}"
    phases = ", ".join(f"{name} {ms:.0f}" for name, ms in k["phases_ms"].items())
    return [
        f"  kill + recover   {k['fault']}: {verdict}; downtime {k['downtime_s']:.2f} s, "
        f"{k['steps_lost']} step(s) lost, restored from {k['restored_from']} ({phases} ms)"
    ]


_SECTIONS: dict[str, Callable[[Any], list[str]]] = {
    "unit_tests": _unit_test_lines,
    "copies": _copy_lines,
    "checksum": _checksum_lines,
    "pinned_alloc": _pin_lines,
    "bitwise_restore": _restore_lines,
    "replicate_blocking": _blocking_lines,
    "stream_race": _race_lines,
    "rebuild_peak": _peak_lines,
    "replication": _replication_lines,
    "kill_and_recover": _kill_lines,
}
"""How each section of the report is printed, in order."""


def _write_json(report: GpuCheckReport, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.json").write_text(json.dumps(report.to_json(), indent=2, default=str) + "\n")


#: Every check's name, in the order run.
CHECKS = (*(name for name in _SECTIONS if name != "unit_tests"), "unit_tests")
