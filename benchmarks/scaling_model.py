"""Scaling model validation: `conveyor predict`'s model against published results and against conveyor's own runs.

    python benchmarks/scaling_model.py                        # both parts (published: instant; measured: ~8 min)
    python benchmarks/scaling_model.py --part published       # the papers only (the tests' run)
    python benchmarks/scaling_model.py --part measured --quick   # 1 round of 10 steps
    sudo python benchmarks/scaling_model.py --part measured --hosts 2 --caps 10,100,1000   # ~8 min

Part "published": every case of ``benchmarks/scaling_published.json`` (each input names its source); the
model (``conveyor.scaling``, default options) predicts the efficiency at the published worker count
relative to the published baseline count. Goal per case: within 10 points of the published efficiency.

Part "measured": the CIFAR-10 example (``--synthetic``, ResNet-20, one intra-op thread per process) run by
``conveyor run`` here as 1 worker, whose summary.json predicts the same job on 2 workers, in interleaved
rounds. Without ``--hosts``: 2 workers here under ``allreduce`` and ``ps-sync`` (+1 ps), the cluster one
node of 2 one-core workers, its link a loopback gloo all-reduce probed first. ``--hosts K`` (root): one
worker per network-namespace host (``conveyor.testing.hosts``; one ``conveyor run --nnodes`` per host),
``allreduce``, and with K = 3 ``ps-sync`` with the ps on host2; the links capped at each of ``--caps``
Mbit/s in turn; the cluster one one-core worker per node, its link a gloo all-reduce between two hosts
probed at each cap (bus bandwidth at 4 MiB, latency from 4 bytes). Before each round a matmul probe gives
its ``compute_speed`` (2 processes at once vs 1 alone) and Linux PSI its CPU pressure. Measured = workers
x batch / the chief's median step. Goal per 2-worker job: |predicted / measured - 1| <= 0.15, the median
over quiet rounds (pressure <= 0.25; none: "not measured"). More: docs/scaling-model.md.
Output: tables, PASS/FAIL lines, JSON (a ``hosts`` block with ``--hosts``) in
``<out>/scaling_model-<timestamp>.json`` and ``<out>/scaling_model-latest.json`` (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by file path
import harness as h  # noqa: E402
import hosts as hosts_bench  # noqa: E402  (--hosts: its Bench, link probe, caps and multi-host launch)

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
DATA = HERE.parent / "scaling_published.json"
EXAMPLE = ROOT / "examples" / "cifar10" / "train.py"
PARTS = ("published", "measured")
CONTENDERS = ("1-worker", "allreduce", "ps-sync")  # odd rounds reversed
PREDICTED = ("allreduce", "ps-sync")
HOST_STRATEGIES = ("allreduce", "ps-sync")  # --hosts 2: the first; --hosts 3: both, the ps on a host of its own
DEFAULT_CAPS = "10,100,1000"  # Mbit/s: ResNet-20's ~1.1 MB of gradients take ~0.9 s at 10 (3x its compute on
# one core here: communication-bound), ~90 ms at 100, ~9 ms at 1000 (compute-bound)
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
# Part "measured": the model against conveyor's own runs, on this machine or on namespace hosts.
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


def link_figures(big_seconds: float, small_seconds: float, nbytes: int, world: int = WORKERS) -> dict[str, float]:
    """Bus bandwidth and per-message latency of a ring all-reduce over `world` processes, from the median
    seconds of one of `nbytes` and of one of 4 bytes (latency only: the ring's 2(N-1) steps)."""
    steps = 2 * (world - 1)
    latency = small_seconds / steps
    wire = max(big_seconds - steps * latency, 1e-9)
    return {"bus_bandwidth": steps / world * nbytes / wire, "latency": latency, "big_seconds": big_seconds,
            "small_seconds": small_seconds, "nbytes": nbytes}


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
    return link_figures(r["big_seconds"], r["small_seconds"], r["nbytes"])


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


def example_args(settings: dict[str, Any]) -> list[str]:
    """SCRIPT and its arguments, the same in every job of the measured part."""
    size = max(4096, settings["steps"] * settings["batch_size"] * WORKERS)  # no epoch ends inside the run
    return [str(EXAMPLE), "--synthetic", "--synthetic-size", str(size), "--max-steps", str(settings["steps"]),
            "--batch-size", str(settings["batch_size"]), "--log-every", "5",
            "--checkpoint-every", str(10 * settings["steps"])]


def job_command(contender: str, settings: dict[str, Any], out_dir: Path) -> list[str]:
    """A job on this machine: `conveyor run` of 1 worker, or of WORKERS under the strategy `contender`."""
    if contender == "1-worker":
        shape = ["-n", "1"]
    else:
        shape = ["-n", str(WORKERS), "--strategy", contender] + (["--ps", "1"] if contender.startswith("ps") else [])
    return [sys.executable, "-m", "conveyor.cli.main", "run", *shape, "--max-restarts", "0", "--output-dir",
            str(out_dir), *example_args(settings)]


def run_job(contender: str, settings: dict[str, Any], out_dir: Path, timeout: float) -> dict[str, Any]:
    """One `conveyor run` job; its summary.json (``{"error": ...}`` on failure)."""
    code, output = h.run_launcher(job_command(contender, settings, out_dir), timeout, cwd=ROOT)
    if code is None:
        return {"error": f"timed out after {timeout:.0f} s: {output.strip()[-600:]}"}
    path = out_dir / "summary.json"
    if code or not path.exists():
        return {"error": f"conveyor run exited {code}: {output.strip()[-800:]}"}
    summary = json.loads(path.read_text())
    summary["path"] = str(path)
    return summary


@dataclasses.dataclass(frozen=True)
class Site:
    """Where the measured part's jobs run and how the model describes them. `contenders`: "1-worker" (the
    input) first, then the 2-worker jobs; `run(contender, settings, out_dir, timeout)`: one job's summary.json
    (``{"error": ...}`` on failure); `clusters`: each 2-worker job's ``conveyor.scaling.Cluster``; `labels`:
    each one's name in the table and goals; `network`: the links, in words, for the table."""

    contenders: tuple[str, ...]
    run: Callable[[str, dict[str, Any], Path, float], dict[str, Any]]
    clusters: dict[str, Any]
    labels: dict[str, str]
    network: str


def strategy_of(contender: str) -> str:
    """The strategy of a 2-worker contender: ``allreduce`` here, ``allreduce@20`` on hosts capped at 20 Mbit/s."""
    return contender.partition("@")[0]


def local_cluster(loopback: dict[str, float], cores: int):
    """This machine as the scaling model's cluster: one node of WORKERS workers sharing its cores."""
    from conveyor.scaling import Cluster

    return Cluster(intra_node_bandwidth=loopback["bus_bandwidth"], intra_node_latency=loopback["latency"],
                   inter_node_bandwidth=loopback["bus_bandwidth"], inter_node_latency=loopback["latency"],
                   gpus_per_node=WORKERS, cores_per_gpu=max(1, cores // WORKERS), ps_count=1,
                   compute_shares_cores=True, name=f"this machine: {cores} cores, loopback")


def local_site(loopback: dict[str, float], cores: int) -> Site:
    """Every job on this machine, described as one node (:func:`local_cluster`)."""
    cluster = local_cluster(loopback, cores)
    return Site(CONTENDERS, run_job, {s: cluster for s in PREDICTED}, {s: f"{WORKERS} workers {s}" for s in PREDICTED},
                f"cluster = {cluster.name}: bus bandwidth {loopback['bus_bandwidth'] / 1e9:.2f} GB/s, latency "
                f"{loopback['latency'] * 1e6:.0f} us")


def host_cluster(link: dict[str, float], cores: int, cap: float | None):
    """The namespace hosts as the model's cluster: one worker per node, fed by one core (the hosts share this
    machine's cores as the local jobs do), every node's link as the gloo probe between two hosts found it."""
    from conveyor.scaling import Cluster

    bandwidth, latency = link["bus_bandwidth"], link["latency"]
    return Cluster(intra_node_bandwidth=bandwidth, intra_node_latency=latency, inter_node_bandwidth=bandwidth,
                   inter_node_latency=latency, gpus_per_node=1, cores_per_gpu=max(1, cores // WORKERS), ps_count=1,
                   compute_shares_cores=True, name=f"namespace hosts, 1 worker each, link {hosts_bench.cap_label(cap)}")


def probe_links(bench, caps: Sequence[float | None], iters: int, timeout: float) -> dict[str, dict[str, float]]:
    """Per cap (its key), the link between host0 and host1 as a gloo all-reduce finds it: benchmarks/hosts.py's
    gloo_allreduce transport of PROBE_BYTES, and 20 all-reduces of 4 bytes for the latency."""
    links = {}
    for cap in caps:
        config = {"bytes": PROBE_BYTES, "tensors": 1, "iters": iters, "small_iters": 20}
        r = hosts_bench.run_transport(bench, hosts_bench.contender("gloo_allreduce", cap), config, timeout)
        if "error" in r:
            raise RuntimeError(f"the link probe at {hosts_bench.cap_label(cap)} failed: {r['error']}")
        link = links[hosts_bench.cap_key(cap)] = {**link_figures(r["median_s"], r["small_median_s"], r["bytes"]),
                                                   "cap_mbit": cap}
        print(f"link at {hosts_bench.cap_label(cap)}: {link['bus_bandwidth'] / 1e6:.2f} MB/s bus bandwidth "
              f"({8 * link['bus_bandwidth'] / 1e6:.1f} Mbit/s), {link['latency'] * 1e6:.0f} us")
    return links


def hosts_site(bench, secret_file: Path, count: int, caps: Sequence[float | None],
               links: dict[str, dict[str, float]], cores: int) -> Site:
    """The 1-worker job here, each 2-worker job (``strategy@cap``) one worker per host of `bench` at the cap
    (``ps-sync``: the ps on host2), one ``conveyor run`` per host (benchmarks/hosts.py's :func:`run_nodes`)."""
    names, clusters, labels = ["1-worker"], {}, {}
    for strategy in HOST_STRATEGIES[:count - 1]:
        for cap in caps:
            name = hosts_bench.contender(strategy, cap)
            names.append(name)
            clusters[name] = host_cluster(links[hosts_bench.cap_key(cap)], cores, cap)
            labels[name] = f"{WORKERS} workers {strategy} on hosts @ {hosts_bench.cap_label(cap)}"

    def run(contender: str, settings: dict[str, Any], out_dir: Path, timeout: float) -> dict[str, Any]:
        if contender == "1-worker":
            return run_job(contender, settings, out_dir, timeout)
        launcher = ["--timeout", f"{max(60, timeout / 2):g}"]  # collectives and rendezvous: within the job's time
        return hosts_bench.run_nodes(bench, contender, example_args(settings), launcher, secret_file, timeout, out_dir)

    probed = "; ".join(f"{hosts_bench.cap_label(link['cap_mbit'])}: {link['bus_bandwidth'] / 1e6:.2f} MB/s, "
                       f"{link['latency'] * 1e6:.0f} us" for link in links.values())
    return Site(tuple(names), run, clusters, labels,
                f"cluster = {count} namespace hosts{' (ps-sync: the ps on host2)' if count > 2 else ''}, one 1-core "
                f"worker per host, the link at each cap probed by a gloo all-reduce between two hosts: {probed}")


def step_rate(summary: dict[str, Any]) -> float:
    """The job's steady samples/s: its workers x batch / the chief's median step."""
    return summary["world_size"] * summary["scaling"]["batch_size"] / summary["step_breakdown"]["total"]


def predict_site(summary: dict[str, Any], clusters: dict[str, Any], speed: float | None = None) -> dict[str, Any]:
    """Each 2-worker contender's predicted point (``conveyor.scaling.Point``) from a 1-worker summary, on its
    cluster, with the cluster's `compute_speed` set to `speed` when given."""
    from conveyor.scaling import measured_from_summary, predict

    measured = measured_from_summary(summary, source=summary.get("path", "summary.json"))
    points = {}
    for name, cluster in clusters.items():
        if speed is not None:
            cluster = dataclasses.replace(cluster, compute_speed=speed)
        points[name] = predict(measured, cluster, workers=[WORKERS], strategies=[strategy_of(name)])[0]
    return points


def run_rounds(settings: dict[str, Any], repeats: int, timeout: float, site: Site) -> dict[str, Any]:
    """Interleaved rounds of the site's contenders; before each round, the compute probe (the machine changes
    speed as other work comes and goes); each round's 1-worker run then predicts that round's 2-worker runs."""
    probes: dict[int, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="conveyor-bench-scaling-") as tmp:
        jobs = iter(range(1, 1 << 30))

        def measure(c: str, rnd: int) -> tuple[float, dict[str, Any]]:
            if rnd not in probes:
                probes[rnd] = {**measure_compute_share(timeout, settings["probe_seconds"]),
                               "cpu_pressure": cpu_pressure()}
                print(f"  round {rnd + 1}: compute speed of 2 at once {probes[rnd]['speed']:.2f} of one alone, "
                      f"CPU pressure {h.fmt(probes[rnd]['cpu_pressure'], '.0%')}")
            pressure = cpu_pressure()
            summary = site.run(c, settings, Path(tmp) / f"out-{next(jobs)}-{c.replace('@', '-')}", timeout)
            summary["cpu_pressure_before"] = pressure
            if "error" in summary:
                raise h.ContenderFailed(summary["error"], summary)
            return step_rate(summary), summary

        def describe(value: float, summary: dict[str, Any]) -> str:
            b = summary["step_breakdown"]
            return (f"{value:.1f} samples/s at the median step ({b['total'] * 1e3:.0f} ms: compute "
                    f"{b['forward_backward'] * 1e3:.0f}, comm {b['communication'] * 1e3:.1f}), "
                    f"{summary['samples_per_second']:.1f} over the wall")

        res = h.interleaved_rounds(site.contenders, repeats, measure, describe=describe)
    res["probes"] = [probes.get(r) for r in range(repeats)]
    ok = [one if isinstance(one, dict) and "error" not in one else None for one in res["runs"]["1-worker"]]
    nominal = [predict_site(one, site.clusters) if one else None for one in ok]
    probed = [predict_site(one, site.clusters, probe["speed"]) if one and probe else None
              for one, probe in zip(ok, res["probes"], strict=True)]
    res["predicted_nominal"] = [{c: p.samples_per_second for c, p in ps.items()} if ps else None for ps in nominal]
    res["predicted"] = [{c: p.samples_per_second for c, p in ps.items()} if ps else None for ps in probed]
    res["predicted_bound"] = [{c: p.bound for c, p in ps.items()} if ps else None for ps in probed]
    return res


def derive_measured(res: dict[str, Any]) -> dict[str, Any]:
    """Medians, and per 2-worker contender (every one but "1-worker") the predicted / measured ratios."""
    names = list(res["samples"])
    d: dict[str, Any] = {"median_step_rate": {c: h.median(res["samples"][c]) for c in names},
                         "median_wall_rate": {c: h.median(_wall_rates(res["runs"][c])) for c in names}}
    # rounds whose machine was quiet when probed; on a busy one the jobs' speeds follow other work, not the model
    quiet = [p is not None and p["cpu_pressure"] is not None and p["cpu_pressure"] <= BUSY for p in res["probes"]]
    d["quiet_rounds"] = quiet
    for c in (n for n in names if n != "1-worker"):
        predicted = [p[c] if p else None for p in res["predicted"]]
        ratios = h.paired(predicted, res["samples"][c])
        d[f"{c}_predicted"] = h.median(predicted)
        d[f"{c}_ratio_per_round"] = ratios
        d[f"{c}_ratio"] = h.median(ratios)
        d[f"{c}_ratio_quiet"] = h.median(r for r, q in zip(ratios, quiet, strict=True) if q)
        d[f"{c}_error"] = abs(d[f"{c}_ratio_quiet"] - 1)
        d[f"{c}_ratio_wall"] = h.ratio(d[f"{c}_predicted"], d["median_wall_rate"][c])
        nominal = [p[c] if p else None for p in res["predicted_nominal"]]
        d[f"{c}_predicted_nominal"] = h.median(nominal)
        d[f"{c}_ratio_nominal"] = h.median(h.paired(nominal, res["samples"][c]))
        d[f"{c}_bound_per_round"] = [b[c] if b else None for b in res["predicted_bound"]]
    d["compute_speed_per_round"] = [p["speed"] if p else None for p in res["probes"]]
    d["cpu_pressure_per_round"] = [p["cpu_pressure"] if p else None for p in res["probes"]]
    return d


def _wall_rates(runs: list[Any]) -> list[float | None]:
    return [r["samples_per_second"] if isinstance(r, dict) and "error" not in r else None for r in runs]


def format_measured(d: dict[str, Any], site: Site, settings: dict[str, Any], repeats: int) -> str:
    head = (f"CIFAR-10 example (synthetic, ResNet-20), batch {settings['batch_size']}/worker, {settings['steps']} "
            f"steps, 1 thread/process, {repeats} round(s); {site.network}; per round, the compute speed of 2 "
            f"processes at once relative to 1 alone (matmul probe): {h.fmt_all(d['compute_speed_per_round'], '.2f')}"
            f", CPU pressure {h.fmt_all(d['cpu_pressure_per_round'], '.2f')}\n"
            f"step rate = workers x batch / chief's median step; wall rate = summary's samples_per_second; "
            f"predicted: this machine as probed (nominal: 2 idle cores, compute speed 1); bound: the model's")
    rows = [("job", "step rate", "wall rate", "predicted", "predicted / step rate", "per round",
             "quiet rounds", "predicted / wall rate", "nominal", "nominal / step rate", "bound per round")]
    rows.append(("1 worker (the input)", h.fmt(d["median_step_rate"]["1-worker"], ".1f"),
                 h.fmt(d["median_wall_rate"]["1-worker"], ".1f"), "", "", "", "", "", "", "", ""))
    for c, label in site.labels.items():
        rows.append((label, h.fmt(d["median_step_rate"][c], ".1f"),
                     h.fmt(d["median_wall_rate"][c], ".1f"), h.fmt(d[f"{c}_predicted"], ".1f"),
                     h.fmt(d[f"{c}_ratio"], ".3f"), h.fmt_all(d[f"{c}_ratio_per_round"], ".3f"),
                     h.fmt(d[f"{c}_ratio_quiet"], ".3f"), h.fmt(d[f"{c}_ratio_wall"], ".3f"),
                     h.fmt(d[f"{c}_predicted_nominal"], ".1f"), h.fmt(d[f"{c}_ratio_nominal"], ".3f"),
                     " ".join(b or "-" for b in d[f"{c}_bound_per_round"])))
    return "\n".join([head, "", h.format_rows(rows, left=(0, 5, 10))])


def rounds_fields(res: dict[str, Any]) -> dict[str, Any]:
    """What the JSON keeps of the rounds besides the derived values."""
    return {"predicted_per_round": res["predicted"], "predicted_nominal_per_round": res["predicted_nominal"],
            "predicted_bound_per_round": res["predicted_bound"], "machine_probes_per_round": res["probes"],
            "samples": res["samples"], "runs": res["runs"], "errors": res["errors"]}


def measure_here(args: argparse.Namespace, settings: dict[str, Any], cores: int):
    """The measured part on this machine: (report fields, config fields, derived values, labels, table)."""
    loopback = measure_loopback(args.timeout)
    print(f"loopback: {loopback['bus_bandwidth'] / 1e9:.2f} GB/s bus bandwidth, {loopback['latency'] * 1e6:.0f} us")
    site = local_site(loopback, cores)
    res = run_rounds(settings, args.repeats, args.timeout, site)
    d = derive_measured(res)
    config = {"order": res["order"], "loopback": loopback, "cluster": vars(site.clusters[PREDICTED[0]])}
    return ({"measured": d, **rounds_fields(res)}, config, d, site.labels,
            format_measured(d, site, settings, args.repeats))


def measure_on_hosts(args: argparse.Namespace, settings: dict[str, Any], cores: int):
    """The measured part with --hosts: (report fields, config fields, derived values, labels, table); the report's
    ``hosts`` block has, per cap and strategy, the predicted and measured samples/s."""
    from conveyor.testing.hosts import Hosts

    with tempfile.TemporaryDirectory(prefix="conveyor-bench-scaling-hosts-") as tmp, Hosts(args.hosts) as hosts:
        bench = hosts_bench.Bench(hosts, Path(tmp))
        links = probe_links(bench, args.caps, settings["link_iters"], args.timeout)
        site = hosts_site(bench, hosts_bench.job_secret_file(Path(tmp)), args.hosts, args.caps, links, cores)
        res = run_rounds(settings, args.repeats, args.timeout, site)
    d = derive_measured(res)
    by_cap: dict[str, dict[str, Any]] = {}
    for c in site.labels:
        strategy, key = hosts_bench.split_contender(c)
        by_cap.setdefault(key, {})[strategy] = {
            "predicted_samples_per_second": d[f"{c}_predicted"],
            "measured_samples_per_second": d["median_step_rate"][c], "ratio": d[f"{c}_ratio"],
            "ratio_quiet": d[f"{c}_ratio_quiet"], "bound_per_round": d[f"{c}_bound_per_round"]}
    block = {"hosts": args.hosts, "caps_mbit": [hosts_bench.cap_key(c) for c in args.caps], "links": links,
             "clusters": {c: vars(cl) for c, cl in site.clusters.items()}, "by_cap": by_cap, "measured": d,
             "order": res["order"], **rounds_fields(res)}
    return ({"hosts": block, "errors": res["errors"]}, {"hosts": args.hosts, "caps_mbit": block["caps_mbit"]}, d,
            site.labels, format_measured(d, site, settings, args.repeats))


# ==================================================================================================
# Main.
# ==================================================================================================


def goals(published: list[dict[str, Any]], measured: dict[str, Any] | None,
          labels: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """PASS/FAIL rows: one per published case, one per 2-worker job (`labels`: contender -> its name)."""
    rows = [h.Goal(f"published {r['case']}: |predicted - published efficiency| <= {PUBLISHED_GAP:.0%} points",
                   r["case"], PUBLISHED_GAP, "<=").row(abs(r["gap_points"]) / 100) for r in published]
    if measured is not None:
        busy = "" if any(measured["quiet_rounds"]) else (
            f"no quiet round: CPU pressure {h.fmt_all(measured['cpu_pressure_per_round'], '.2f')} > {BUSY} when "
            f"probed; run it again on an idle machine")
        rows += [h.Goal(f"measured {label}: |predicted / measured samples/s - 1| <= {MEASURED_ERROR} "
                        f"(median over quiet rounds)", c, MEASURED_ERROR, "<=").row(
                            h.or_none(measured[f"{c}_error"]), **({"error": busy} if busy else {}))
                 for c, label in (labels or {}).items()]
    return rows


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = h.parser(__doc__, "measured part: 1 round of 10 steps, a 1 s compute probe, 1 timed link probe per cap")
    p.add_argument("--part", choices=(*PARTS, "all"), default="all", help="which validation (default all)")
    p.add_argument("--steps", type=int, default=None, help="steps per job (default 30; --quick 10)")
    p.add_argument("--batch-size", type=int, default=64, help="per worker (default 64)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per job (default 600)")
    p.add_argument("--hosts", type=int, choices=(2, 3), default=None, metavar="K",
                   help="measured part: run the 2-worker jobs one worker per network-namespace host (root only): "
                        "K = 2: allreduce; K = 3: also ps-sync, its ps on a third host (default: on this machine; "
                        "--repeats then defaults to 2)")
    p.add_argument("--caps", type=hosts_bench.parse_caps, default=None, metavar="MBIT,...",
                   help="with --hosts: the links' caps in Mbit/s per direction, each in turn, 'none' for uncapped "
                        f"(default {DEFAULT_CAPS})")
    p.add_argument("--probe", metavar="JSON", help=argparse.SUPPRESS)
    p.add_argument("--compute-probe", metavar="JSON", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    h.settle(p, args, {"repeats": (3 if args.hosts is None else 2, 1), "steps": (30, 10)},
             positive=("repeats", "steps", "batch_size", "timeout"))
    if args.caps is not None and args.hosts is None:
        p.error("--caps needs --hosts K (the caps are the namespace hosts' links)")
    if args.hosts is not None and args.part == "published":
        p.error("--hosts applies to the measured part: give --part measured (or all)")
    args.caps = args.caps or hosts_bench.parse_caps(DEFAULT_CAPS)
    return args


def run_parts(args: argparse.Namespace, machine: dict[str, Any]) -> tuple[dict[str, Any], list[str], list[dict]]:
    """Both parts as asked: (report fields, tables, goal rows)."""
    data = json.loads(DATA.read_text())
    published = run_published(data) if args.part in ("published", "all") else []
    tables = [format_published(published)] if published else []
    config: dict[str, Any] = {"part": args.part, "data": f"benchmarks/{DATA.name}", "quick": args.quick}
    fields: dict[str, Any] = {"published": published, "measured": None, "errors": []}
    measured = labels = None
    if args.part in ("measured", "all"):
        settings = {"steps": args.steps, "batch_size": args.batch_size, "probe_seconds": 1.0 if args.quick else 4.0,
                    "link_iters": 1 if args.quick else 3}
        measure = measure_on_hosts if args.hosts else measure_here
        more, extra, measured, labels, table = measure(args, settings, machine["cores"])
        fields.update(more)
        config.update({**settings, "repeats": args.repeats, "threads_per_process": 1, **extra})
        tables.append(table)
    return {**fields, "config": config}, tables, goals(published, measured, labels)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.probe is not None:
        probe(*json.loads(args.probe))
        return 0
    if args.compute_probe is not None:
        compute_probe(*json.loads(args.compute_probe))
        return 0
    if args.hosts is not None:
        from conveyor.testing.hosts import unavailable

        why = unavailable()
        if why:
            print(f"benchmarks/scaling_model.py --hosts cannot run here: {why} (it makes network namespaces; run "
                  f"it as root)", file=sys.stderr)
            return 2
    started = time.perf_counter()
    machine = h.machine_start(("torch",))
    fields, tables, gs = run_parts(args, machine)
    report = {"benchmark": "scaling_model", "command": h.command_line("scaling_model", argv),
              "machine": h.machine_end(machine), **fields, "goals": gs, "all_pass": all(g["pass"] for g in gs),
              "table": "\n\n".join(tables), "wall_seconds": time.perf_counter() - started}
    h.publish("scaling_model", report, h.format_goals(gs), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
