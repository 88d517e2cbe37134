"""Scaling model validation: `conveyor predict`'s model against published results and against conveyor's own runs.

    python benchmarks/scaling_model.py                       # both parts (published: instant; measured: ~8 min)
    python benchmarks/scaling_model.py --part published      # the papers only (the tests' run)
    python benchmarks/scaling_model.py --quick               # measured part: 1 round of 10 steps
    python benchmarks/scaling_model.py --repeats 5 --steps 40 --out /tmp/bench-results

Part "published": every case of ``benchmarks/scaling_published.json`` (Horovod at 128 and 512 P100s,
Goyal et al. at 256), its inputs taken from the papers' own figures and the sources named there (each
number carries its source; what no source gives is marked assumed and is the same for every case). The
model (``conveyor.scaling``, default options) predicts the efficiency at the published worker count
relative to the published baseline count. Goal per case: within 10 points of the published efficiency.

Part "measured": the CIFAR-10 example (``examples/cifar10/train.py --synthetic``, ResNet-20, batch
``--batch-size`` per worker, ``--steps`` steps, one intra-op thread per process) run by ``conveyor run``
as 1 worker, as 2 workers under ``allreduce`` and as 2 workers + 1 ps task under ``ps-sync``, in
interleaved rounds. This machine is described as the cluster: one node, 2 workers of 1 core each (the
compute shares the cores with the input pipeline), the intra-node link a 2-process gloo all-reduce
over loopback measured here before the rounds (bus bandwidth at 4 MiB, latency from a 4-byte one). Each
round's 1-worker summary.json predicts that round's 2-worker runs; measured = 2 x batch / the chief's
median step (``step_breakdown.total``), the steady rate the model predicts (the summary's
``samples_per_second`` over the whole wall, with the final evaluation and checkpoint, is shown too).
Goal: |predicted / measured - 1| <= 0.15 (median over the quiet rounds: CPU pressure <= 0.25 when
probed) per strategy; with no quiet round the goal is "not measured". The 1-worker run uses one
thread so that the measured device is one core, the core each worker of the 2-worker runs gets. Two
cores of a shared or virtual machine are not always two cores' worth of compute: before each round a
probe (a one-thread matmul, not the workload) times one process alone and two at once, and the ratio
is the cluster's ``compute_speed`` for that round (1.0 on an idle machine with two real cores); the
prediction for two idle cores (``compute_speed`` 1) is shown next to it, and the CPU pressure (Linux
PSI, the share of time some task waited for a core) says how busy the machine was.

Designed for a later ``--hosts K``: `local_cluster` describes where the jobs ran and `job_command`
starts them; namespace hosts with capped links (``conveyor.testing.hosts``) would replace both.
Output: tables and PASS/FAIL lines on stdout; JSON in ``<out>/scaling_model-<timestamp>.json`` and
``<out>/scaling_model-latest.json`` (default ``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by file path
import harness as h  # noqa: E402

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
DATA = HERE.parent / "scaling_published.json"
EXAMPLE = ROOT / "examples" / "cifar10" / "train.py"
PARTS = ("published", "measured")
CONTENDERS = ("1-worker", "allreduce", "ps-sync")  # odd rounds reversed
PREDICTED = ("allreduce", "ps-sync")
WORKERS = 2
PROBE_BYTES = 4 * 2**20
PUBLISHED_GAP = 0.10
MEASURED_ERROR = 0.15
BUSY = 0.25  # CPU pressure (share of time some task waited for a core) above which a round does not count


# ==================================================================================================
# Part "published": the model against the papers' figures.
# ==================================================================================================


def _value(entry: Any) -> Any:
    return entry["value"] if isinstance(entry, dict) else entry


def published_inputs(case: dict[str, Any], data: dict[str, Any]):
    """(Measured, Cluster, Options) of one published case, from its cited numbers."""
    from conveyor.scaling import Measured, Options, cluster_from_mapping

    batch = float(_value(case["batch_size"]))
    if "compute_seconds" in case:
        compute = _value(case["compute_seconds"])
    else:  # a throughput of one GPU: its whole step is forward + backward
        compute = batch / _value(case["images_per_second"])
    grad_bytes = 4.0 * _value(case["parameters"])  # fp32
    measured = Measured(batch_size=batch, compute=float(compute), optimizer=0.0,
                        overhead=float(_value(case.get("overhead_seconds", 0.0))), gradient_bytes=grad_bytes,
                        parameter_bytes=grad_bytes, source=case["name"])
    cluster_fields = {k: v for k, v in data["clusters"][case["cluster"]].items() if k != "sources"}
    cluster = cluster_from_mapping(cluster_fields, f"{DATA.name}: cluster {case['cluster']}")
    a = data["assumptions"]
    options = Options(overlap=_value(a["overlap"]), backward_fraction=_value(a["backward_fraction"]),
                      bucket_bytes=float(_value(case["bucket_bytes"])))
    return measured, cluster, options


def run_published(data: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per case: published and predicted efficiency (relative to the baseline count), gap, bound."""
    from conveyor.scaling import predict

    rows = []
    for case in data["cases"]:
        pub = case["published"]
        measured, cluster, options = published_inputs(case, data)
        base, n = pub["baseline_workers"], pub["workers"]
        points = {p.workers: p for p in predict(measured, cluster, options, workers=[base, n],
                                                strategies=[case["strategy"]])}
        efficiency = points[n].efficiency / points[base].efficiency
        iteration = pub.get("iteration_seconds")
        rows.append({
            "case": case["name"], "strategy": case["strategy"], "workers": n, "baseline_workers": base,
            "published_efficiency": pub["efficiency"], "predicted_efficiency": efficiency,
            "gap_points": 100 * (efficiency - pub["efficiency"]), "bound": points[n].bound,
            "step_seconds": points[n].step_seconds, "compute_seconds": measured.compute,
            "exposed_communication_seconds": points[n].parts["communication"],
            "communication_seconds": points[n].parts["communication_total"],
            "published_iteration_seconds": _value(iteration) if iteration else None,
            "source": data["sources"][pub["source"]][:120] + "...",
        })
    return rows


def format_published(rows: list[dict[str, Any]]) -> str:
    table = [("case", "N", "vs N", "published", "predicted", "gap (points)", "bound", "compute ms", "comm ms",
              "exposed ms", "step ms")]
    for r in rows:
        table.append((r["case"], str(r["workers"]), str(r["baseline_workers"]), f"{r['published_efficiency']:.0%}",
                      f"{r['predicted_efficiency']:.1%}", f"{r['gap_points']:+.1f}", r["bound"],
                      h.fmt(r["compute_seconds"], ".0f", 1e3), h.fmt(r["communication_seconds"], ".0f", 1e3),
                      h.fmt(r["exposed_communication_seconds"], ".0f", 1e3), h.fmt(r["step_seconds"], ".0f", 1e3)))
    lines = ["published results: scaling efficiency at N relative to the baseline count (inputs and sources: "
             f"benchmarks/{DATA.name})", "", h.format_rows(table, left=(0, 6))]
    for r in rows:
        if r["published_iteration_seconds"]:
            lines.append(f"{r['case']}: predicted iteration {r['step_seconds']:.3f} s at N = {r['workers']} "
                         f"(published {r['published_iteration_seconds']:.2f} s)")
    return "\n".join(lines)


# ==================================================================================================
# Part "measured": the model against conveyor's own runs on this machine.
# ==================================================================================================


def probe(rank: int, port: int, nbytes: int, reps: int, out: str) -> None:
    """One of the 2 processes of the loopback probe: timed gloo all-reduces of `nbytes` and of 4 bytes."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORKERS)
    big, small = torch.zeros(nbytes // 4), torch.zeros(1)

    def timed(tensor: torch.Tensor) -> float:
        times = []
        for i in range(reps + 3):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(tensor)
            if i >= 3:  # the first ones set up the connections
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    result = {"big_seconds": timed(big), "small_seconds": timed(small), "nbytes": nbytes}
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(result))


def measure_loopback(timeout: float, reps: int = 20) -> dict[str, float]:
    """Bus bandwidth and per-message latency of a 2-process gloo all-reduce over loopback."""
    from conveyor.launch.ports import free_ports

    with tempfile.TemporaryDirectory(prefix="conveyor-bench-probe-") as tmp:
        out = Path(tmp) / "probe.json"
        port = free_ports(1)[0]
        procs = [subprocess.Popen([sys.executable, str(HERE), "--probe", json.dumps([r, port, PROBE_BYTES, reps,
                                                                                   str(out)])], cwd=ROOT)
                 for r in range(WORKERS)]
        try:
            for p in procs:
                p.wait(timeout=timeout)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        if any(p.returncode for p in procs) or not out.exists():
            raise RuntimeError("the loopback probe failed (see its output above)")
        r = json.loads(out.read_text())
    latency = r["small_seconds"] / (2 * (WORKERS - 1))  # a ring's 2(N-1) steps
    wire = max(r["big_seconds"] - 2 * (WORKERS - 1) * latency, 1e-9)
    return {"bus_bandwidth": 2 * (WORKERS - 1) / WORKERS * r["nbytes"] / wire, "latency": latency, **r}


def compute_probe(seconds: float, out: str) -> None:
    """One process of the compute probe: milliseconds per 512 x 512 matmul on one thread, over `seconds`."""
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    for _ in range(5):
        a @ b
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        a @ b
        n += 1
    Path(out).write_text(json.dumps({"ms": (time.perf_counter() - t0) / n * 1e3}))


def measure_compute_share(timeout: float, seconds: float = 4.0) -> dict[str, float]:
    """Each process's compute speed when WORKERS compute at once, relative to one alone (a matmul, not the
    workload): 1.0 with WORKERS idle cores of their own, less when they share execution units or other
    work holds the cores. It is the cluster's `compute_speed` for this machine at this moment."""
    with tempfile.TemporaryDirectory(prefix="conveyor-bench-cpu-") as tmp:
        def run(count: int) -> list[float]:
            outs = [str(Path(tmp) / f"{count}-{i}.json") for i in range(count)]
            procs = [subprocess.Popen([sys.executable, str(HERE), "--compute-probe", json.dumps([seconds, o])],
                                      cwd=ROOT) for o in outs]
            for proc in procs:
                proc.wait(timeout=timeout)
            if any(proc.returncode for proc in procs):
                raise RuntimeError("the compute probe failed (see its output above)")
            return [json.loads(Path(o).read_text())["ms"] for o in outs]

        alone, together = run(1)[0], statistics.mean(run(WORKERS))
    return {"alone_ms": alone, "together_ms": together, "speed": min(1.0, alone / together)}


def cpu_pressure() -> float | None:
    """The share of the last 10 s in which some runnable task waited for a CPU (Linux PSI), or None."""
    try:
        first = Path("/proc/pressure/cpu").read_text().splitlines()[0]
        return float(dict(kv.split("=") for kv in first.split()[1:])["avg10"]) / 100
    except (OSError, IndexError, KeyError, ValueError):
        return None


def local_cluster(loopback: dict[str, float], cores: int):
    """This machine as the scaling model's cluster: one node of WORKERS workers sharing its cores."""
    from conveyor.scaling import Cluster

    return Cluster(intra_node_bandwidth=loopback["bus_bandwidth"], intra_node_latency=loopback["latency"],
                   inter_node_bandwidth=loopback["bus_bandwidth"], inter_node_latency=loopback["latency"],
                   gpus_per_node=WORKERS, cores_per_gpu=max(1, cores // WORKERS), ps_count=1,
                   compute_shares_cores=True, name=f"this machine: {cores} cores, loopback")


def job_command(contender: str, settings: dict[str, Any], out_dir: Path) -> list[str]:
    if contender == "1-worker":
        shape = ["-n", "1"]
    else:
        shape = ["-n", str(WORKERS), "--strategy", contender] + (["--ps", "1"] if contender.startswith("ps") else [])
    size = max(4096, settings["steps"] * settings["batch_size"] * WORKERS)  # no epoch ends inside the run
    return [sys.executable, "-m", "conveyor.cli.main", "run", *shape, "--max-restarts", "0", "--output-dir",
            str(out_dir), str(EXAMPLE), "--synthetic", "--synthetic-size", str(size), "--max-steps",
            str(settings["steps"]), "--batch-size", str(settings["batch_size"]), "--log-every", "5",
            "--checkpoint-every", str(10 * settings["steps"])]


def run_job(contender: str, settings: dict[str, Any], out_dir: Path, timeout: float) -> dict[str, Any]:
    """One `conveyor run` job; its summary.json (``{"error": ...}`` on failure)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    # Its own session, so that a timeout can stop the launcher and every task it started, and nothing else.
    proc = subprocess.Popen(job_command(contender, settings, out_dir), env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return {"error": f"timed out after {timeout:.0f} s: {output.strip()[-600:]}"}
    path = out_dir / "summary.json"
    if proc.returncode or not path.exists():
        return {"error": f"conveyor run exited {proc.returncode}: {output.strip()[-800:]}"}
    summary = json.loads(path.read_text())
    summary["path"] = str(path)
    return summary


def step_rate(summary: dict[str, Any]) -> float:
    """The job's steady samples/s: its workers x batch / the chief's median step."""
    return summary["world_size"] * summary["scaling"]["batch_size"] / summary["step_breakdown"]["total"]


def predict_two(summary: dict[str, Any], cluster) -> dict[str, float]:
    """Predicted samples/s of WORKERS workers, per strategy, from a 1-worker summary."""
    from conveyor.scaling import measured_from_summary, predict

    measured = measured_from_summary(summary, source=summary.get("path", "summary.json"))
    return {p.strategy: p.samples_per_second
            for p in predict(measured, cluster, workers=[WORKERS], strategies=list(PREDICTED))}


def run_rounds(settings: dict[str, Any], repeats: int, timeout: float, cluster) -> dict[str, Any]:
    """Interleaved rounds of CONTENDERS; before each round, the compute probe (the machine changes speed as
    other work comes and goes); each round's 1-worker run then predicts that round's 2-worker runs."""
    import dataclasses

    probes: dict[int, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="conveyor-bench-scaling-") as tmp:
        jobs = iter(range(1, 1 << 30))

        def measure(c: str, rnd: int) -> tuple[float, dict[str, Any]]:
            if rnd not in probes:
                probes[rnd] = {**measure_compute_share(timeout), "cpu_pressure": cpu_pressure()}
                print(f"  round {rnd + 1}: compute speed of 2 at once {probes[rnd]['speed']:.2f} of one alone, "
                      f"CPU pressure {h.fmt(probes[rnd]['cpu_pressure'], '.0%')}")
            pressure = cpu_pressure()
            summary = run_job(c, settings, Path(tmp) / f"out-{next(jobs)}-{c}", timeout)
            summary["cpu_pressure_before"] = pressure
            if "error" in summary:
                raise h.ContenderFailed(summary["error"], summary)
            return step_rate(summary), summary

        def describe(value: float, summary: dict[str, Any]) -> str:
            b = summary["step_breakdown"]
            return (f"{value:.1f} samples/s at the median step ({b['total'] * 1e3:.0f} ms: compute "
                    f"{b['forward_backward'] * 1e3:.0f}, comm {b['communication'] * 1e3:.1f}), "
                    f"{summary['samples_per_second']:.1f} over the wall")

        res = h.interleaved_rounds(CONTENDERS, repeats, measure, describe=describe)
    res["probes"] = [probes.get(r) for r in range(repeats)]
    ok = [one if isinstance(one, dict) and "error" not in one else None for one in res["runs"]["1-worker"]]
    res["predicted_nominal"] = [predict_two(one, cluster) if one else None for one in ok]
    res["predicted"] = [predict_two(one, dataclasses.replace(cluster, compute_speed=probe["speed"]))
                        if one and probe else None for one, probe in zip(ok, res["probes"], strict=True)]
    return res


def derive_measured(res: dict[str, Any]) -> dict[str, Any]:
    d: dict[str, Any] = {"median_step_rate": {c: h.median(res["samples"][c]) for c in CONTENDERS},
                         "median_wall_rate": {c: h.median(_wall_rates(res["runs"][c])) for c in CONTENDERS}}
    # rounds whose machine was quiet when probed; on a busy one the jobs' speeds follow other work, not the model
    quiet = [p is not None and p["cpu_pressure"] is not None and p["cpu_pressure"] <= BUSY for p in res["probes"]]
    d["quiet_rounds"] = quiet
    for strategy in PREDICTED:
        predicted = [p[strategy] if p else None for p in res["predicted"]]
        ratios = h.paired(predicted, res["samples"][strategy])
        d[f"{strategy}_predicted"] = h.median(predicted)
        d[f"{strategy}_ratio_per_round"] = ratios
        d[f"{strategy}_ratio"] = h.median(ratios)
        d[f"{strategy}_ratio_quiet"] = h.median(r for r, q in zip(ratios, quiet, strict=True) if q)
        d[f"{strategy}_error"] = abs(d[f"{strategy}_ratio_quiet"] - 1)
        d[f"{strategy}_ratio_wall"] = h.ratio(d[f"{strategy}_predicted"], d["median_wall_rate"][strategy])
        nominal = [p[strategy] if p else None for p in res["predicted_nominal"]]
        d[f"{strategy}_predicted_nominal"] = h.median(nominal)
        d[f"{strategy}_ratio_nominal"] = h.median(h.paired(nominal, res["samples"][strategy]))
    d["compute_speed_per_round"] = [p["speed"] if p else None for p in res["probes"]]
    d["cpu_pressure_per_round"] = [p["cpu_pressure"] if p else None for p in res["probes"]]
    return d


def _wall_rates(runs: list[Any]) -> list[float | None]:
    return [r["samples_per_second"] if isinstance(r, dict) and "error" not in r else None for r in runs]


def format_measured(d: dict[str, Any], loopback: dict[str, float], cluster, settings: dict[str, Any],
                    repeats: int) -> str:
    head = (f"CIFAR-10 example (synthetic, ResNet-20), batch {settings['batch_size']}/worker, {settings['steps']} "
            f"steps, 1 thread/process, {repeats} round(s); cluster = {cluster.name}: bus bandwidth "
            f"{loopback['bus_bandwidth'] / 1e9:.2f} GB/s, latency {loopback['latency'] * 1e6:.0f} us; per round, the "
            f"compute speed of 2 processes at once relative to 1 alone (matmul probe): "
            f"{h.fmt_all(d['compute_speed_per_round'], '.2f')}, CPU pressure "
            f"{h.fmt_all(d['cpu_pressure_per_round'], '.2f')}\n"
            f"step rate = workers x batch / chief's median step; wall rate = summary's samples_per_second; "
            f"predicted: this machine as probed (nominal: 2 idle cores, compute speed 1)")
    rows = [("job", "step rate", "wall rate", "predicted", "predicted / step rate", "per round",
             "quiet rounds", "predicted / wall rate", "nominal", "nominal / step rate")]
    rows.append(("1 worker (the input)", h.fmt(d["median_step_rate"]["1-worker"], ".1f"),
                 h.fmt(d["median_wall_rate"]["1-worker"], ".1f"), "", "", "", "", "", "", ""))
    for s in PREDICTED:
        rows.append((f"{WORKERS} workers {s}", h.fmt(d["median_step_rate"][s], ".1f"),
                     h.fmt(d["median_wall_rate"][s], ".1f"), h.fmt(d[f"{s}_predicted"], ".1f"),
                     h.fmt(d[f"{s}_ratio"], ".3f"), h.fmt_all(d[f"{s}_ratio_per_round"], ".3f"),
                     h.fmt(d[f"{s}_ratio_quiet"], ".3f"), h.fmt(d[f"{s}_ratio_wall"], ".3f"),
                     h.fmt(d[f"{s}_predicted_nominal"], ".1f"), h.fmt(d[f"{s}_ratio_nominal"], ".3f")))
    return "\n".join([head, "", h.format_rows(rows, left=(0, 5))])


# ==================================================================================================
# Main.
# ==================================================================================================


def goals(published: list[dict[str, Any]], measured: dict[str, Any] | None) -> list[dict[str, Any]]:
    rows = [h.Goal(f"published {r['case']}: |predicted - published efficiency| <= {PUBLISHED_GAP:.0%} points",
                   r["case"], PUBLISHED_GAP, "<=").row(abs(r["gap_points"]) / 100) for r in published]
    if measured is not None:
        busy = "" if any(measured["quiet_rounds"]) else (
            f"no quiet round: CPU pressure {h.fmt_all(measured['cpu_pressure_per_round'], '.2f')} > {BUSY} when "
            f"probed; run it again on an idle machine")
        rows += [h.Goal(f"measured {WORKERS} workers {s}: |predicted / measured samples/s - 1| <= {MEASURED_ERROR} "
                        f"(median over quiet rounds)", s, MEASURED_ERROR, "<=").row(
                            h.or_none(measured[f"{s}_error"]), **({"error": busy} if busy else {}))
                 for s in PREDICTED]
    return rows


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = h.parser(__doc__, "measured part: 1 round of 10 steps")
    p.add_argument("--part", choices=(*PARTS, "all"), default="all", help="which validation (default all)")
    p.add_argument("--steps", type=int, default=None, help="steps per job (default 30; --quick 10)")
    p.add_argument("--batch-size", type=int, default=64, help="per worker (default 64)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per job (default 600)")
    p.add_argument("--probe", metavar="JSON", help=argparse.SUPPRESS)
    p.add_argument("--compute-probe", metavar="JSON", help=argparse.SUPPRESS)
    return h.settle(p, p.parse_args(argv), {"repeats": (3, 1), "steps": (30, 10)},
                    positive=("repeats", "steps", "batch_size", "timeout"))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.probe is not None:
        probe(*json.loads(args.probe))
        return 0
    if args.compute_probe is not None:
        compute_probe(*json.loads(args.compute_probe))
        return 0
    started = time.perf_counter()
    machine = h.machine_start(("torch",))
    data = json.loads(DATA.read_text())
    published = run_published(data) if args.part in ("published", "all") else []
    tables = [format_published(published)] if published else []
    measured = res = None
    config: dict[str, Any] = {"part": args.part, "data": f"benchmarks/{DATA.name}", "quick": args.quick}
    if args.part in ("measured", "all"):
        settings = {"steps": args.steps, "batch_size": args.batch_size}
        loopback = measure_loopback(args.timeout)
        cluster = local_cluster(loopback, machine["cores"])
        print(f"loopback: {loopback['bus_bandwidth'] / 1e9:.2f} GB/s bus bandwidth, {loopback['latency'] * 1e6:.0f} us")
        res = run_rounds(settings, args.repeats, args.timeout, cluster)
        measured = derive_measured(res)
        tables.append(format_measured(measured, loopback, cluster, settings, args.repeats))
        config.update({**settings, "repeats": args.repeats, "order": res["order"], "loopback": loopback,
                       "cluster": {k: v for k, v in vars(cluster).items()}, "threads_per_process": 1})
    gs = goals(published, measured)
    report = {"benchmark": "scaling_model", "command": h.command_line("scaling_model", argv),
              "machine": h.machine_end(machine), "config": config, "published": published,
              "measured": measured, "predicted_per_round": res["predicted"] if res else None,
              "predicted_nominal_per_round": res["predicted_nominal"] if res else None,
              "machine_probes_per_round": res["probes"] if res else None,
              "samples": res["samples"] if res else None, "runs": res["runs"] if res else None,
              "errors": res["errors"] if res else [], "goals": gs, "all_pass": all(g["pass"] for g in gs),
              "table": "\n\n".join(tables), "wall_seconds": time.perf_counter() - started}
    h.publish("scaling_model", report, h.format_goals(gs), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
