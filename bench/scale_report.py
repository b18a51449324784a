"""``p2p-bench scale-report``: recovery time, goodput and memory of a job at scale, modelled.

Offline: the phase model of ``bench/scale_model.py`` fed with this project's measured figures
(``bench/data/measured.json``) and published ones (``bench/data/cited.json``), first checked
against this machine's own ``recover``, ``compare`` and ``resize`` results, then run at the
requested job size. Writes ``report.md``, ``report.json`` and PNG plots.

    p2p-bench scale-report --gpus 2048 --model llama3-70b --replicas 1,2
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from bench import scale_goodput as gp
from bench import scale_model as sm
from bench.bench_reports import (
    ScaleHeadline,
    ScaleJob,
    ScaleReport,
    ScaleSize,
    Scenario,
    ValidationRow,
    WorstHeldOut,
)
from bench.errors import UsageError
from bench.flags import count, positive
from bench.report_dir import add_out_dir, command_line, report_dir
from bench.scale_model import Input, Inputs, Job
from recovery.gloo_pairs import LAZY_FROM_RANKS, pairs_on_first_use

SIZES = (256, 512, 1024, 2048, 4096, 8192, 16384)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``p2p-bench scale-report``."""
    p.add_argument("--gpus", type=int, default=2048, help="GPUs of the job (default 2048)")
    p.add_argument("--gpus-per-node", type=count(1), default=8, help="GPUs per node (default 8)")
    p.add_argument("--model", default="llama3-70b", help="preset (llama3-8b, -70b, -405b)")
    p.add_argument("--params", type=float, default=None, help="parameter count (own model)")
    p.add_argument("--step-s", type=float, default=None, help="seconds per step (own model)")
    p.add_argument("--hardware", default="h100-ib400", help="preset (h100-ib400, ...)")
    p.add_argument("--ib-gbps", type=positive, default=None, help="GB/s per GPU across nodes")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override any input of the report by name (repeatable), e.g. nccl_abort_s=2",
    )
    p.add_argument("--replicas", default="1,2", help="values of k to model (default 1,2)")
    p.add_argument("--checkpoint-every-min", type=float, default=30.0, help="minutes")
    p.add_argument(
        "--fallback-checkpoint-every-min",
        type=float,
        default=180.0,
        help="minutes between the engine's own checkpoints for its cold fallback (default 180)",
    )
    p.add_argument("--storage", choices=("parallel-fs", "s3"), default="parallel-fs")
    p.add_argument("--replica-memory", choices=("gpu", "host"), default="gpu")
    p.add_argument("--placement", choices=("ring", "same-node"), default="ring")
    gloo = p.add_mutually_exclusive_group()
    gloo.add_argument(
        "--lazy-gloo",
        dest="lazy_gloo",
        action="store_const",
        const=True,
        help="the job runs with p2p-run --lazy-gloo: its gloo groups connect pairs on first use "
        f"at every size (without either flag: from {LAZY_FROM_RANKS} ranks, as p2p-run does)",
    )
    gloo.add_argument(
        "--eager-gloo",
        dest="lazy_gloo",
        action="store_const",
        const=False,
        help="the job runs with p2p-run --eager-gloo: its gloo groups connect every pair when "
        "they are made, at every size",
    )
    p.add_argument("--trials", type=int, default=2000, help="Monte Carlo months (default 2000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-plots", action="store_true", help="report.md and report.json only")
    add_out_dir(p, "scale")
    p.add_argument("--json", action="store_true", help="print the report object")


def _replicas(text: str) -> list[int]:
    try:
        ks = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise UsageError(f"--replicas {text!r}: give numbers such as 1,2") from None
    if not ks or min(ks) < 1:
        raise UsageError(f"--replicas {text!r}: every k must be at least 1")
    return ks


def scale_inputs(args: argparse.Namespace, measured: dict[str, Any]) -> Inputs:
    """The labelled inputs of the requested job."""
    models, hardware = sm.load("models"), sm.load("hardware")
    if args.hardware not in hardware:
        raise UsageError(f"--hardware {args.hardware}: presets are {', '.join(hardware)}")
    hw = dict(hardware[args.hardware])
    if args.ib_gbps is not None:
        hw["ib_gbps"] = args.ib_gbps
        hw["source"] += "; --ib-gbps given on the command line"
    if args.params is not None:
        if args.params <= 0:
            raise UsageError("--params must be positive")
        preset = {"params": args.params, "tokens_per_step": 4194304, "source": "--params"}
    elif args.model in models:
        preset = models[args.model]
    else:
        raise UsageError(f"--model {args.model}: presets are {', '.join(models)} (or --params)")
    if args.step_s is not None and args.step_s <= 0:
        raise UsageError("--step-s must be positive")
    inp = sm.job_inputs(
        params=preset["params"],
        tokens_per_step=preset["tokens_per_step"],
        model_source=preset["source"],
        hardware=hw,
        step_s=args.step_s,
    )
    inp.update(sm.control_plane_inputs(measured, args.gpus))
    inp.update(sm.rendezvous_inputs(measured, args.gpus))
    rec = measured["recover"]
    src = f"{rec['command']} ({rec['date']}); CPU-side code, same at any scale"
    plan = max(0.0, rec["phases_s"]["plan"] - measured["control_plane_small_generation_s"])
    inp["plan_fixed_s"] = Input(plan, "s", "measured", src, plan * 0.5, plan * 3)
    inp["data_s"] = Input(rec["phases_s"]["data"], "s", "measured", src, 0.0, 1.0)
    for item in args.set:
        name, _, text = item.partition("=")
        if name not in inp:
            raise UsageError(
                f"--set {item}: no input {name!r}; inputs are {', '.join(sorted(inp))}"
            )
        try:
            value = float(text)
        except ValueError:
            raise UsageError(f"--set {item}: {text!r} is not a number") from None
        old = inp[name]
        inp[name] = Input(
            value, old.unit, "cited", f"given on the command line (--set); was: {old.source}"
        )
    return inp


def machine_inputs(measured: dict[str, Any]) -> tuple[Inputs, float]:
    """This machine's inputs (2 CPU cores, gloo over loopback), from its own benches: the
    ``recover`` run calibrates the fixed costs; returns them and the state bytes per rank."""
    rec, cmp_ = measured["recover"], measured["compare"]
    ph = rec["phases_s"]
    src = f"{rec['command']} ({rec['date']})"
    csrc = f"{cmp_['command']} ({cmp_['date']})"
    s = rec["num_params"] * 12 / rec["world_size"]
    gen = measured["control_plane_small_generation_s"]
    gsrc = f"{measured['control_plane']['command']} ({measured['control_plane']['date']})"
    link = rec["bytes_received"] / max(ph["transfer"], 1e-6) / sm.GB
    mem = 2 * s / max(ph["restore"], 1e-6) / sm.GB
    rph = cmp_["restart_phases_s"]
    steps_lost = max(1, cmp_["restart_steps_lost"])
    # The new communicators: what the survivors took to form them (the critical rank of a
    # recovery is often the spare, whose `communicators` runs from the generation's arrival and
    # so includes waiting for the survivors to leave the step), at most what the critical rank
    # spent after the generation's broadcast. The abort keeps the rest of `interrupt` and
    # `communicators`, so the phases still add up to what the critical rank measured.
    after_broadcast = max(0.0, ph["interrupt"] + ph["communicators"] - gen)
    comm = min(rec.get("communicators_ranks_s", ph["communicators"]), after_broadcast)
    abort = after_broadcast - comm

    def m(v: float, source: str, unit: str = "s") -> Input:
        return Input(v, unit, "measured", source, v * 0.8, v * 1.25)

    inp: Inputs = {
        "params": m(rec["num_params"], src, "parameters"),
        "state_bytes_per_param": Input(12, "B", "measured", f"{src}: fp32 weights + Adam"),
        "exit_detect_s": m(ph["detect"], src),
        "hang_detect_s": m(ph["detect"], src),
        "generation_s": m(gen, gsrc),
        "nccl_abort_s": m(abort, src),
        "nccl_connect_s": m(comm, f"{src}: median over the ranks that record it"),
        "nccl_lazy_init_s_per_1k_ranks": m(0.0, src),
        "plan_fixed_s": m(max(0.0, ph["plan"] - gen), src),
        "build_fixed_s": m(max(0.0, ph["build"] - s / (mem * sm.GB)), src),
        "ib_gbps": m(link, f"{src}: bytes_received / transfer", "GB/s"),
        "pcie_gbps": m(link, f"{src}: bytes_received / transfer", "GB/s"),
        "hbm_gbps": m(mem, f"{src}: 2 x state / restore", "GB/s"),
        "nics_per_node": Input(1, "NICs", "measured", f"{src}: one loopback interface"),
        "data_s": m(ph["data"], src),
        "step_s": m(rec["step_s"], f"{src}: median step interval"),
        "scheduler_restart_s": m(rph["terminate"], csrc),
        "process_start_s": m(rph["restart processes"], csrc),
        "cold_build_s": m(rph["build model"], csrc),
        "nccl_eager_init_s_at_4096": m(rph["init communicators"] * 4096 / 4, csrc),
        "storage_read_gbps_total": m(
            rec["num_params"] * 12 / max(rph["load checkpoint"], 1e-6) / sm.GB, csrc, "GB/s"
        ),
        "restart_step_s": m(rph["recompute"] / steps_lost, f"{csrc}: recompute / steps lost"),
        "restart_ranks": Input(
            cmp_.get("world_size", 4), "ranks", "measured", f"{csrc}: ranks restarted"
        ),
        "cpu_cores": Input(
            measured["cpu_cores"], "cores", "measured", measured["cpu_cores_source"]
        ),
    }
    return inp, s


def cpu_share(inp: Inputs, ranks: int) -> float:
    """How much longer CPU-bound start-up work (interpreter and imports, building the model)
    takes on this host when ``ranks`` processes do it at once, against the run it was measured
    in: the processes share ``cpu_cores`` cores, so the time goes as ``max(ranks, cores)``."""
    cores = inp["cpu_cores"].value
    return max(ranks, cores) / max(inp["restart_ranks"].value, cores)


def _err(pred: float, meas: float) -> float:
    return round(100.0 * (pred - meas) / meas, 1) if meas else float("nan")


def validation(measured: dict[str, Any]) -> list[ValidationRow]:
    """Predicted against measured phase sums on this machine. ``calibration`` rows are the
    run the fixed costs come from; ``held-out`` rows are runs the model never saw."""
    inp, _ = machine_inputs(measured)
    rec, cmp_, rsz = measured["recover"], measured["compare"], measured["resize"]
    job = Job(gpus=rec["world_size"], gpus_per_node=2, replicas=1)
    ph = sm.recovery_phases(inp, job)
    downtime = sum(v for k, v in ph.items() if k != "redone step")
    rows = [
        ("recover: downtime (detect..replicate)", "calibration", downtime, rec["downtime_s"]),
        ("recover: fault -> first step", "held-out", sum(ph.values()), rec["recovery_s"]),
        ("compare: checkpointless downtime", "held-out", downtime, cmp_["downtime_s"]),
        (
            "compare: checkpointless fault -> first step",
            "held-out",
            sum(ph.values()),
            cmp_["recovery_s"],
        ),
    ]
    rinp = sm.with_value(inp, "step_s", inp["restart_step_s"].value)
    rjob = Job(gpus=rec["world_size"], gpus_per_node=2, checkpoint_every_min=0.0)
    rph = sm.restart_phases(rinp, rjob)
    rph["lost work"] = cmp_["restart_steps_lost"] * inp["restart_step_s"].value
    rows.append(
        (
            "compare: checkpoint-restart downtime",
            "calibration",
            sum(rph.values()),
            cmp_["restart_downtime_s"],
        )
    )
    for label in ("grow", "shrink"):
        r = rsz[label]
        # Every rank runs on this one host and shares its loopback (one "node", one link); the
        # placement and the ranks given back follow the bench's emulated nodes.
        rj = Job(gpus=r["from"], gpus_per_node=max(r["from"], r["to"]), replicas=1)
        pred = sum(sm.resize_phases(inp, rj, r["to"], nodes=r["nodes"]).values())
        rows.append(
            (f"resize {label} {r['from']}->{r['to']}: in place", "held-out", pred, r["resize_s"])
        )
        d = rsz["dcp_" + label]
        dj = Job(gpus=d["to"], gpus_per_node=1)
        dph = sm.restart_phases(inp, dj)
        # A DCP resize launches a new job: nothing to terminate; the launcher (torchrun, one
        # interpreter importing torch, alone on the host) starts, then the new world's workers
        # start and build their model all at once, sharing the host's cores; the bench's clock
        # runs from the launch.
        launcher = dph["process start"] * cpu_share(inp, 1)
        workers = (dph["process start"] + inp["cold_build_s"].value) * cpu_share(inp, d["to"])
        keys = ("init communicators", "load checkpoint", "data")
        build_mem = dph["build"] - inp["cold_build_s"].value
        pred = launcher + workers + build_mem + sum(dph[k] for k in keys)
        rows.append(
            (
                f"resize {label} through DCP: restart and load",
                "held-out",
                pred,
                d["restart_and_load_s"],
            )
        )
    return [ValidationRow(n, k, round(p, 4), round(m, 4), _err(p, m)) for n, k, p, m in rows]


def _recovery(inp: Inputs, job: Job) -> dict[str, dict[str, float]]:
    """One ``k``: the phases of a GPU fault and of a node fault, and their mix."""
    s = inp["node_level_fraction"].value
    gpu = sm.recovery_phases(inp, job)
    node = sm.recovery_phases(inp, job, node_fault=True)
    mix = {k: (1 - s) * gpu[k] + s * node[k] for k in gpu}
    return {"gpu_fault": gpu, "node_fault": node, "expected": mix}


def _expected_recovery_s(inp: Inputs, job: Job) -> float:
    return sum(_recovery(inp, job)["expected"].values())


def _restart_downtime_s(inp: Inputs, job: Job) -> float:
    return sum(sm.restart_phases(inp, job).values())


def _overheads(inp: Inputs, job: Job) -> tuple[float, float]:
    """Steady overheads (share of time): replication per step for the engine, and the stall of
    the checkpoints both modes take (the engine keeps them for its cold fallback)."""
    step = sm.step_time_s(inp, job.gpus)
    s = sm.state_bytes_per_gpu(inp, job.gpus, job.shard_degree)
    send = job.replicas * s / (inp["ib_gbps"].value * sm.GB)
    repl = send * (1 - inp["replication_overlap"].value) / step
    ckpt = inp["checkpoint_write_stall_s"].value / (job.checkpoint_every_min * 60.0)
    return repl, ckpt


def _analytic_goodput(inp: Inputs, job: Job, engine: bool) -> float:
    """Goodput with the mean fault count (no Monte Carlo): for the sensitivity analysis."""
    faults = gp.fault_rate_per_s(inp, job.gpus) * gp.MONTH_S
    repl, ckpt = _overheads(inp, job)
    if engine:
        return gp.goodput(faults * _expected_recovery_s(inp, job), repl + ckpt)
    return gp.goodput(faults * _restart_downtime_s(inp, job), ckpt)


def build_report(args: argparse.Namespace, measured: dict[str, Any]) -> ScaleReport:
    """The whole report (its document's schema is in ``docs/scale-model.md``)."""
    ks = _replicas(args.replicas)
    if args.gpus < 2 * args.gpus_per_node or args.gpus % args.gpus_per_node:
        raise UsageError(
            f"--gpus {args.gpus}: use a multiple of --gpus-per-node ({args.gpus_per_node}) "
            "with at least two nodes"
        )
    if min(args.checkpoint_every_min, args.fallback_checkpoint_every_min, args.trials) <= 0:
        raise UsageError("--checkpoint-every-min, --fallback-... and --trials must be positive")
    inp = scale_inputs(args, measured)
    base = Job(
        gpus=args.gpus,
        gpus_per_node=args.gpus_per_node,
        checkpoint_every_min=args.checkpoint_every_min,
        storage=args.storage,
        replica_memory=args.replica_memory,
        placement=args.placement,
        lazy_gloo=args.lazy_gloo,
    )
    restart = sm.restart_phases(inp, base)
    restart_s = sum(restart.values())
    scenarios = {
        "checkpoint-restart": Scenario(
            recovery_s=restart_s - restart["lost work"], downtime_s=restart_s, phases_s=restart
        )
    }
    goodput: dict[str, Any] = {}
    memory = []
    fallback = Job(**{**base.__dict__, "checkpoint_every_min": args.fallback_checkpoint_every_min})
    cold_s = sum(sm.restart_phases(inp, fallback).values())
    for k in ks:
        job = Job(**{**fallback.__dict__, "replicas": k})
        rec = _recovery(inp, job)
        rec_s = sum(rec["expected"].values())
        window = sum(rec["node_fault"].values())
        mc = gp.simulate(
            inp,
            job,
            recovery_gpu_s=sum(rec["gpu_fault"].values()),
            recovery_node_s=window,
            cold_s=cold_s,
            window_s=window,
            placement=args.placement,
            trials=args.trials,
            seed=args.seed,
        )
        p_lost = gp.copies_lost_fraction_analytic(inp, job, window, args.placement)
        downtime = (1 - p_lost) * rec_s + p_lost * cold_s
        repl, ckpt = _overheads(inp, job)
        name = f"checkpointless k={k}"
        scenarios[name] = Scenario(
            recovery_s=rec_s,
            downtime_s=downtime,
            recovery_gpu_fault_s=sum(rec["gpu_fault"].values()),
            recovery_node_fault_s=window,
            phases_s=rec["expected"],
            downtime_reduction_pct=100.0 * (1 - downtime / restart_s),
        )
        mc["copies_lost_fraction_analytic"] = p_lost
        mc["replication_overhead"] = repl
        mc["checkpoint_overhead"] = ckpt
        mc["goodput"] = gp.goodput(mc["downtime_per_period_s"], repl + ckpt)
        goodput[name] = mc
        memory.append(sm.memory(inp, job))
    gpn = args.gpus_per_node
    rz = Job(**{**fallback.__dict__, "replicas": ks[0]})
    for label, job, to in (
        ("resize in place: shrink by a node", rz, args.gpus - gpn),
        (
            "resize in place: grow by a node",
            Job(**{**rz.__dict__, "gpus": args.gpus - gpn}),
            args.gpus,
        ),
    ):
        phases = sm.resize_phases(inp, job, to)
        scenarios[label] = Scenario(
            recovery_s=sum(phases.values()), downtime_s=sum(phases.values()), phases_s=phases
        )
    mean_faults = goodput[f"checkpointless k={ks[0]}"]["faults_per_period"]
    ckpt = _overheads(inp, base)[1]
    goodput["checkpoint-restart"] = {
        "faults_per_period": mean_faults,
        "downtime_per_period_s": mean_faults * restart_s,
        "downtime_per_day_s": mean_faults * restart_s / 30.0,
        "checkpoint_overhead": ckpt,
        "goodput": gp.goodput(mean_faults * restart_s, ckpt),
    }
    heal = sm.torchft_heal_s(inp)
    groups = max(1, args.gpus // max(1, base.gpus_per_node * 8))
    scenarios["torchft replica-group heal"] = Scenario(
        recovery_s=heal,
        downtime_s=heal / groups + sm.step_time_s(inp, args.gpus),
        note=f"{groups} replica groups of {args.gpus // groups} GPUs: one group drops out "
        "for the heal while the others train; downtime counts the group's share and the "
        "lost step",
    )
    k1 = Job(**{**fallback.__dict__, "replicas": ks[0]})
    tornado = sm.sensitivity(inp, lambda i: _expected_recovery_s(i, k1))
    rec_base = _expected_recovery_s(inp, k1)

    def red(i: Inputs) -> float:
        return 100.0 * (1 - _expected_recovery_s(i, k1) / _restart_downtime_s(i, base))

    red_rows = sm.sensitivity(inp, red)
    g_rows = sm.sensitivity(inp, lambda i: 100 * _analytic_goodput(i, k1, True))
    gr_rows = sm.sensitivity(inp, lambda i: 100 * _analytic_goodput(i, base, False))
    sizes = []
    for n in SIZES:
        ni = dict(inp)
        ni.update(sm.control_plane_inputs(measured, n))
        ni.update(sm.rendezvous_inputs(measured, n))
        nj = Job(**{**k1.__dict__, "gpus": n})
        sizes.append(
            ScaleSize(
                gpus=n,
                recovery_s=_expected_recovery_s(ni, nj),
                restart_downtime_s=_restart_downtime_s(ni, Job(**{**base.__dict__, "gpus": n})),
                control_plane=ni["generation_s"].source.split(", ")[-1],
            )
        )
    m_inp, _ = machine_inputs(measured)
    rows = validation(measured)
    held = [r for r in rows if r.kind == "held-out"]
    worst = max(held, key=lambda r: abs(r.error_pct))
    headline = ScaleHeadline(
        replicas=ks[0],
        recovery_s=rec_base,
        recovery_range_s=sm.uncertainty(rec_base, tornado),
        downtime_reduction_pct=red(inp),
        downtime_reduction_range_pct=sm.uncertainty(red(inp), red_rows),
        goodput_pct=100 * goodput[f"checkpointless k={ks[0]}"]["goodput"],
        goodput_range_pct=sm.uncertainty(100 * _analytic_goodput(inp, k1, True), g_rows),
        goodput_restart_pct=100 * goodput["checkpoint-restart"]["goodput"],
        goodput_restart_range_pct=sm.uncertainty(
            100 * _analytic_goodput(inp, base, False), gr_rows
        ),
        validation_worst_held_out=WorstHeldOut(worst.name, worst.error_pct),
        validation_within_25_pct=sum(abs(r.error_pct) <= 25 for r in rows),
        validation_rows=len(rows),
    )
    return ScaleReport(
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        command=command_line(args),
        job=ScaleJob(
            gpus=args.gpus,
            gpus_per_node=args.gpus_per_node,
            model=args.model if args.params is None else "custom",
            hardware=args.hardware,
            replicas=ks,
            checkpoint_every_min=args.checkpoint_every_min,
            fallback_checkpoint_every_min=args.fallback_checkpoint_every_min,
            storage=args.storage,
            replica_memory=args.replica_memory,
            placement=args.placement,
            step_s=sm.step_time_s(inp, args.gpus),
            state_gib_per_gpu=sm.state_bytes_per_gpu(inp, args.gpus) / 2**30,
            lazy_gloo=pairs_on_first_use(args.gpus, args.lazy_gloo),
        ),
        headline=headline,
        inputs=dict(sorted(inp.items())),
        validation_inputs=dict(sorted(m_inp.items())),
        validation=rows,
        scenarios=scenarios,
        goodput=goodput,
        memory=memory,
        sensitivity={"recovery_s": tornado, "downtime_reduction_pct": red_rows},
        sizes=sizes,
    )


def run(args: argparse.Namespace) -> int:
    """Entry point of ``p2p-bench scale-report``."""
    from bench import scale_render

    report = build_report(args, sm.load("measured"))
    out = report_dir(args, "scale")
    written = scale_render.write(report.to_json(), out, plots=not args.no_plots)
    if args.json:
        print(json.dumps(report.to_json(), default=str))
        return 0
    h = report.headline
    lo, hi = h.recovery_range_s
    print(
        f"p2p-bench scale-report: {args.gpus} GPUs, {report.job.model}, k={h.replicas}:"
        f" recovery {h.recovery_s:.1f} s ({lo:.1f}-{hi:.1f}),"
        f" {h.downtime_reduction_pct:.1f} % less downtime per fault than checkpoint-restart,"
        f" goodput {h.goodput_pct:.2f} % vs {h.goodput_restart_pct:.2f} %"
    )
    print(f"  wrote {', '.join(str(p) for p in written)}")
    return 0
