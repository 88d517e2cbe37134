"""Data-service benchmark: a one-core trainer fed by 1-3 one-core data-worker hosts over a capped link.

    sudo python benchmarks/data_service.py                        # 256 images, 1 Gbit/s link, 2 rounds
    sudo python benchmarks/data_service.py --quick                # 64 images, short windows, 1 round
    sudo python benchmarks/data_service.py --cores 0,1,2,3 --link-mbit 1000,none

Needs root (network namespaces, ``conveyor.testing.hosts``); without it, it says so and exits 2. Hosts:
host0 the trainer, host1-3 data workers, host4 the dispatcher (unpinned; it handles splits and figures,
no elements). Every link is capped with ``tc tbf`` at ``--link-mbit`` (both directions): a worker's link
carries its share only, so the trainer's link is the one that limits. The workload is the chexnet-like
pipeline (``pipeline_workloads.chexnet_fn``: JPEG 256² decode, random 224 crop, flip, normalise, float32
CHW), batches of ``--batch``, built by name on every worker (``--pipeline data_service:pipeline``),
``parallel_epochs`` over a repeated file list so no epoch ends inside a window. Each process is pinned
with ``taskset -c``: ``--cores T,W1,W2,W3`` (default: 0,1,2,3 modulo this machine's cores; on fewer than
4 cores some share one, and the table says which and that the K-worker rows are then bounded by cores).

Contenders, per round: ``local`` (the trainer runs the pipeline itself, no service), ``single-wI`` (worker
I alone: its single-host rate), ``service-kK`` (workers 1..K), ``tf-kK`` (TensorFlow's tf.data service on the
same hosts, cores and files, ``data_service_tf.py``; skipped with the reason unless ``tensorflow`` imports), and
``memory``: one worker, the trainer
sleeping per element so the worker could produce >= 10x faster; the trainer's and the dispatcher's peak
RSS (VmHWM, after ``clear_refs`` reset it at the start) against the bound the queue sizes give. Figures:
images/s the trainer took in a window after a warm-up. Goals: service-kK >= 0.9 x the sum of the single
rates of workers 1..K, unless the trainer's link carries >= 0.85 x its cap (then "link" is the limit), and
service-kK >= 1.0 x tf-kK at every K.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by file path
import data_service_tf as tfds  # noqa: E402
import harness as h  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
MIB = 1 << 20
TRAINER, WORKERS, DISPATCHER = 0, (1, 2, 3), 4
OPTIONS = {"max_outstanding": 2, "per_request": 1, "buffer": 4}  # the trainer's credit and queue
WORKER_BUFFER = 4  # elements a worker produces ahead per job (`conveyor data worker --buffer`)
LINK_BOUND_SHARE = 0.85  # the trainer's link carrying this share of its cap: the link is the limit
UNSTABLE_SPREAD = 1.5  # one contender's rounds differing this much: the machine's other work moved the figures


# ---------------------------------------------------------------------------------- the pipeline (workers)


def pipeline():
    """The chexnet-like pipeline over $DSBENCH_FILES, batches of $DSBENCH_BATCH (what every worker builds)."""
    from conveyor.data import TFRecordDataset
    from pipeline_workloads import chexnet_fn

    files = os.environ["DSBENCH_FILES"].split(os.pathsep)
    return TFRecordDataset(files).repeat().map(chexnet_fn).batch(int(os.environ["DSBENCH_BATCH"]))


def vm_kib(pid: int | str, field: str) -> int:
    """``field`` (VmRSS, VmHWM) of /proc/PID/status in KiB."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def reset_peak(pid: int | str) -> None:
    """Reset VmHWM to the current RSS (``clear_refs`` 5), so the peak counts from now."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def trainer_role(config: dict[str, Any]) -> None:
    """Consume for warmup + seconds; print one JSON line: images and bytes in the window, peak RSS."""
    ds = pipeline()
    if config["service"]:
        from conveyor.data.service import Service

        service = Service(config["service"], bytes.fromhex(config["secret"]))
        ds = ds.distribute(service, processing_mode="parallel_epochs", **OPTIONS)
    reset_peak("self")
    base = vm_kib("self", "VmRSS")
    figures = tfds.consume(ds, config)
    print(json.dumps({**figures, "base_rss_kib": base, "peak_rss_kib": vm_kib("self", "VmHWM")}), flush=True)


# ---------------------------------------------------------------------------------- the driver


def parse_cores(text: str) -> tuple[int, ...]:
    """``--cores T,W1,W2,W3``: the trainer's core, then each worker's."""
    try:
        cores = tuple(int(c) for c in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--cores {text!r}: expected 4 core numbers, e.g. 0,1,2,3") from None
    if len(cores) != 4 or min(cores) < 0:
        raise argparse.ArgumentTypeError(f"--cores {text!r}: expected 4 core numbers (trainer, worker 1-3)")
    return cores


def default_cores(ncores: int) -> tuple[int, ...]:
    return tuple(i % ncores for i in range(4))


def shared_cores(cores: Sequence[int]) -> list[str]:
    """Which processes share a core, in words (empty when each has its own)."""
    names = ["trainer", "worker 1", "worker 2", "worker 3"]
    by_core: dict[int, list[str]] = {}
    for name, core in zip(names, cores, strict=True):
        by_core.setdefault(core, []).append(name)
    return [f"core {c}: {' + '.join(ns)}" for c, ns in sorted(by_core.items()) if len(ns) > 1]


def parse_link(text: str) -> float | None:
    if text == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--link-mbit {text!r}: a rate in Mbit/s or 'none'") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"--link-mbit {text!r}: must be > 0")
    return value


def contenders(workers: int, tf: bool = False) -> list[str]:
    """The rounds' contenders; ``tf``: with TensorFlow's tf.data service rows (``tf-kK``)."""
    return ["local", *(f"single-w{i}" for i in range(1, workers + 1)),
            *(f"service-k{k}" for k in range(1, workers + 1)), *(f"tf-k{k}" for k in range(1, workers + 1) if tf),
            "memory"]


def memory_bound_kib(element_bytes: int, workers: int = 1) -> dict[str, int]:
    """The trainer's and the dispatcher's RSS growth allowed over their start: the trainer holds at most its
    queue plus every request in flight (``buffer + workers x max_outstanding x per_request`` elements), each
    counted 3x (the frame received, the array decoded from it, the one in use), plus 64 MiB for the transport's
    buffers and the interpreter; the dispatcher never holds an element: 32 MiB."""
    held = OPTIONS["buffer"] + workers * OPTIONS["max_outstanding"] * OPTIONS["per_request"]
    return {"trainer": (3 * held * element_bytes + 64 * MIB) // 1024, "dispatcher": 32 * MIB // 1024}


class Bench:
    """The hosts, the data and one contender's processes at a time."""

    def __init__(self, hosts, tmp: Path, files: list[str], args: argparse.Namespace) -> None:
        self.hosts, self.tmp, self.args = hosts, tmp, args
        self.secret = secrets.token_hex(32)
        self.secret_file = tmp / "job.secret"
        self.secret_file.write_text(self.secret)
        self.secret_file.chmod(0o600)
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "DSBENCH_BATCH": str(args.batch),
                    "DSBENCH_FILES": os.pathsep.join(files),
                    "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
        self.runs = 0

    def start(self, host: int, argv: list[str], core: int | None, log: str):
        pinned = ["taskset", "-c", str(core)] if core is not None else []
        with open(self.tmp / log, "wb") as out:
            return self.hosts.popen(self.hosts[host], [*pinned, sys.executable, *argv], env=self.env, cwd=ROOT,
                                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def wait_for(self, proc, log: str, text: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while text not in (self.tmp / log).read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise h.ContenderFailed(f"{log} did not say {text!r}: {_tail(self.tmp / log)}")
            time.sleep(0.1)

    def service(self, workers: Sequence[int]) -> tuple[Any, str]:
        """Start the dispatcher and ``workers`` (1-based); (the dispatcher's process, its address)."""
        self.runs += 1
        port = 5100 + 2 * (self.runs % 400)
        address = f"{self.hosts[DISPATCHER].address}:{port}"
        secret = ["--secret-file", str(self.secret_file)]
        log = f"dispatcher-{self.runs}.log"
        dispatcher = self.start(DISPATCHER, ["-m", "conveyor", "data", "serve", "--host", "0.0.0.0", "--port",
                                             str(port), *secret], None, log)
        self.wait_for(dispatcher, log, "listening")
        for w in workers:
            wlog = f"worker{w}-{self.runs}.log"
            proc = self.start(WORKERS[w - 1], ["-m", "conveyor", "data", "worker", "--dispatcher", address,
                                               "--host", self.hosts[WORKERS[w - 1]].address, "--port", str(port + 1),
                                               "--pipeline", "data_service:pipeline", "--buffer", str(WORKER_BUFFER),
                                               *secret], self.args.cores[w], wlog)
            self.wait_for(proc, wlog, "serving on")
        return dispatcher, address

    def tf_service(self, workers: Sequence[int]) -> str:
        """TensorFlow's dispatcher and ``workers`` (1-based) on the same hosts and cores; its address."""
        self.runs += 1
        port = 6100 + 2 * (self.runs % 400)  # apart from conveyor's ports: no reuse of a port just closed
        address = f"{self.hosts[DISPATCHER].address}:{port}"
        script = str(HERE / "data_service_tf.py")
        log = f"tf-dispatcher-{self.runs}.log"
        self.wait_for(self.start(DISPATCHER, [script, "dispatcher", "--port", str(port)], None, log), log, "listening")
        for w in workers:
            wlog = f"tf-worker{w}-{self.runs}.log"
            proc = self.start(WORKERS[w - 1], [script, "worker", "--dispatcher", address, "--host",
                                               self.hosts[WORKERS[w - 1]].address, "--port", str(port + 1)],
                              self.args.cores[w], wlog)
            self.wait_for(proc, wlog, "serving on")
        return address

    def trainer(self, address: str | None, sleep: float = 0.0, tf: bool = False) -> dict[str, Any]:
        """Run the trainer (conveyor's, or with ``tf`` TensorFlow's) on its core; its JSON line."""
        config = {"service": address, "secret": self.secret, "warmup": self.args.warmup,
                  "seconds": self.args.seconds, "sleep": sleep, "compression": self.args.tf_compression}
        log = f"trainer-{self.runs}-{int(time.time() * 1e3)}.log"
        argv = ([str(HERE / "data_service_tf.py"), "trainer", json.dumps(config)] if tf
                else [str(Path(__file__).resolve()), "--trainer", json.dumps(config)])
        proc = self.start(TRAINER, argv, self.args.cores[0], log)
        try:
            proc.wait(timeout=self.args.warmup + self.args.seconds + self.args.timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise h.ContenderFailed(f"the trainer ran past its time: {_tail(self.tmp / log)}") from None
        lines = [ln for ln in (self.tmp / log).read_text(errors="replace").splitlines() if ln.startswith("{")]
        if proc.returncode or not lines:
            raise h.ContenderFailed(f"the trainer exited {proc.returncode}: {_tail(self.tmp / log)}")
        return json.loads(lines[-1])

    def stop(self) -> None:
        for host in self.hosts:
            self.hosts.kill_host(host)


def _tail(path: Path, lines: int = 6) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])[-1200:]
    except OSError:
        return "(no log)"


def measure_memory(bench: Bench, single_rate: float | None) -> dict[str, Any]:
    """One worker, a trainer sleeping so the worker could produce >= 10x faster; both peaks against the bound."""
    sleep = 10 * bench.args.batch / single_rate if single_rate else 1.0
    dispatcher, address = bench.service([1])
    if b"conveyor" not in Path(f"/proc/{dispatcher.pid}/cmdline").read_bytes():
        raise h.ContenderFailed("the dispatcher's pid is not the conveyor process (a wrapper forked)")
    reset_peak(dispatcher.pid)
    d_base = vm_kib(dispatcher.pid, "VmRSS")
    run = bench.trainer(address, sleep=sleep)
    d_peak = vm_kib(dispatcher.pid, "VmHWM")
    element = 4 * 3 * 224 * 224 * bench.args.batch + 8 * bench.args.batch
    bound = memory_bound_kib(element)
    run.update({"sleep_s": sleep, "producer_vs_consumer": (single_rate or 0) * sleep / bench.args.batch,
                "element_bytes": element, "bound_kib": bound, "dispatcher_base_rss_kib": d_base,
                "dispatcher_peak_rss_kib": d_peak,
                "trainer_growth_kib": run["peak_rss_kib"] - run["base_rss_kib"],
                "dispatcher_growth_kib": d_peak - d_base})
    run["within_bound"] = (run["trainer_growth_kib"] <= bound["trainer"]
                           and run["dispatcher_growth_kib"] <= bound["dispatcher"])
    return run


def measure(bench: Bench, name: str, singles: dict[str, float]) -> tuple[float, dict[str, Any]]:
    try:
        if name == "local":
            run = bench.trainer(None)
        elif name == "memory":
            run = measure_memory(bench, singles.get("single-w1"))
            return float(run["within_bound"]), run
        elif name.startswith("tf-k"):
            run = bench.trainer(bench.tf_service(range(1, int(name[-1]) + 1)), tf=True)
        else:
            workers = [int(name[-1])] if name.startswith("single") else list(range(1, int(name[-1]) + 1))
            _, address = bench.service(workers)
            run = bench.trainer(address)
        run["loadavg_1min"] = os.getloadavg()[0]
        if name.startswith("single"):
            singles[name] = run["images_per_s"]
        return run["images_per_s"], run
    finally:
        bench.stop()


def tf_skip(args: argparse.Namespace) -> str | None:
    """Why the tf.data service rows are not run, or None when they are."""
    return "left out (--no-tf)" if args.no_tf else tfds.skip_reason()


def derive_tf(res: dict[str, Any], med: dict[str, float], skipped: str | None) -> dict[str, Any]:
    """Per K TensorFlow's rate and conveyor's over it; ``min_ratio`` (NaN when any K failed) or the skip reason."""
    rows = {}
    for k in range(1, len(WORKERS) + 1):
        name = f"tf-k{k}"
        if name in res["samples"]:
            rows[name] = {"images_per_s": med.get(name),
                          "conveyor_vs_tf": h.ratio(med.get(f"service-k{k}"), med.get(name)),
                          "bytes_per_s": h.median(r.get("bytes_per_s") for r in res["runs"][name] if r)}
    ratios = [r["conveyor_vs_tf"] for r in rows.values()]
    measured = bool(ratios) and len(h.finite(ratios)) == len(ratios)
    return {"rows": rows, "min_ratio": min(ratios) if measured else math.nan,
            "skipped": None if rows else (skipped or "not run")}


def derive(res: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Medians per contender; per K the sum of the single rates, the ratio and what limits."""
    med = {c: h.median(v) for c, v in res["samples"].items() if c != "memory"}
    cap_bytes = None if args.link_mbit is None else args.link_mbit * 1e6 / 8
    rows = {}
    for k in range(1, len(WORKERS) + 1):
        name = f"service-k{k}"
        total = sum(med.get(f"single-w{i}", float("nan")) for i in range(1, k + 1))
        bps = h.median(r.get("bytes_per_s") for r in res["runs"][name] if r)
        link_share = h.ratio(bps, cap_bytes)
        limit = "link" if cap_bytes and link_share >= LINK_BOUND_SHARE else "workers"
        ratio = h.ratio(med.get(name), total)
        rows[name] = {"images_per_s": med.get(name), "sum_single": total, "vs_sum": ratio, "bytes_per_s": bps,
                      "link_share": link_share, "limit": limit,
                      "pass": bool(limit == "link" or (ratio == ratio and ratio >= 0.9))}
    memory = next((r for r in res["runs"]["memory"] if r and "within_bound" in r), None)
    return {"medians": med, "service": rows, "memory": memory, "tf": derive_tf(res, med, tf_skip(args)),
            "scaling_pass": all(r["pass"] for r in rows.values()),
            "memory_pass": bool(memory and memory["within_bound"])}


def tf_rows(tf: dict[str, Any], args: argparse.Namespace) -> list[list[str]]:
    """The tf.data service rows of the table: each with conveyor's service-kK over it, or one skipped row."""
    if tf["skipped"]:
        return [["tf-data-service", f"skipped: {tf['skipped']}"]]
    cap_bytes = None if args.link_mbit is None else args.link_mbit * 1e6 / 8
    return [[f"{name} (tf.data service, workers 1..{name[-1]})", h.fmt(r["images_per_s"], ".1f"),
             h.fmt(r["bytes_per_s"], ".1f", 1e-6), "", "", h.fmt(h.ratio(r["bytes_per_s"], cap_bytes), ".2f"), "",
             h.fmt(r["conveyor_vs_tf"], ".2f")] for name, r in tf["rows"].items()]


def loaded_note(res: dict[str, Any], cores: int) -> str | None:
    """A warning line when the machine's other work moved the figures (a 1-min load average above the cores
    during a contender, or one contender's rounds differing >= UNSTABLE_SPREAD x), else None. #23: a run at
    load 22-37 on 2 cores had rows move 4x between rounds, which read as a service cap that no quiet run shows."""
    loads = [r["loadavg_1min"] for runs in res["runs"].values() for r in runs if r and "loadavg_1min" in r]
    spreads = {name: max(v) / min(v) for name, v in res["samples"].items()
               if name != "memory" and len(v) > 1 and all(x == x for x in v) and min(v) > 0}
    reasons = []
    if loads and max(loads) > cores:
        reasons.append(f"1-min load average up to {max(loads):.1f} on {cores} cores")
    worst = max(spreads, key=spreads.__getitem__, default=None)
    if worst is not None and spreads[worst] >= UNSTABLE_SPREAD:
        reasons.append(f"{worst}'s rounds differ {spreads[worst]:.1f}x")
    if not reasons:
        return None
    return ("LOADED (" + "; ".join(reasons) + "): the machine's other work moves these rows, so a row's shortfall "
            "may be the load's, not the contender's; read a cap or a ranking only from a run on a quiet machine.")


def format_table(res: dict[str, Any], d: dict[str, Any], args: argparse.Namespace, uptime: str) -> str:
    med, svc = d["medians"], d["service"]
    link = "uncapped" if args.link_mbit is None else f"{args.link_mbit:g} Mbit/s"
    rows: list[Any] = [["contender", "images/s", "MB/s", "sum of singles", "/ sum", "link share", "limit",
                        "conveyor / tf"]]
    rows.append(["local (trainer runs the pipeline, no service)", h.fmt(med.get("local"), ".1f"), *[""] * 6])
    for i in range(1, len(WORKERS) + 1):
        bps = h.median(r.get("bytes_per_s") for r in res["runs"][f"single-w{i}"] if r)
        rows.append([f"single-w{i} (worker {i} alone, core {args.cores[i]})", h.fmt(med.get(f"single-w{i}"), ".1f"),
                     h.fmt(bps, ".1f", 1e-6), *[""] * 5])
    for name, r in svc.items():
        rows.append([f"{name} (workers 1..{name[-1]})", h.fmt(r["images_per_s"], ".1f"),
                     h.fmt(r["bytes_per_s"], ".1f", 1e-6), h.fmt(r["sum_single"], ".1f"), h.fmt(r["vs_sum"], ".2f"),
                     h.fmt(r["link_share"], ".2f"), r["limit"], ""])
    rows += tf_rows(d["tf"], args)
    lines = [f"data service: chexnet-like JPEG 256² -> 224 crop, batch {args.batch}, {args.images} images repeated, "
             f"trainer link {link}, cores trainer {args.cores[0]}, workers {','.join(map(str, args.cores[1:]))}, "
             f"{args.warmup:g} s warm-up + {args.seconds:g} s window, {args.repeats} round(s), medians"
             + ("" if d["tf"]["skipped"] else f"; tf.data service compression {args.tf_compression}"),
             h.format_rows(rows, left=(0,), underline=True)]
    m = d["memory"]
    if m:
        lines.append(f"memory: trainer sleeping {m['sleep_s']:.2f} s per element (worker "
                     f"~{m['producer_vs_consumer']:.0f}x faster); peak RSS growth trainer "
                     f"{m['trainer_growth_kib'] / 1024:.0f} MiB (bound "
                     f"{m['bound_kib']['trainer'] / 1024:.0f}), dispatcher {m['dispatcher_growth_kib'] / 1024:.1f} MiB "
                     f"(bound {m['bound_kib']['dispatcher'] / 1024:.0f}); peaks {m['peak_rss_kib'] / 1024:.0f} and "
                     f"{m['dispatcher_peak_rss_kib'] / 1024:.0f} MiB")
    shared = shared_cores(args.cores)
    if shared:
        lines.append("SHARED CORES (" + "; ".join(shared) + "): processes on one core split it, so a K-worker "
                     "row is bounded by the cores, not the service, and '/ sum' understates the service; give "
                     "--cores with distinct cores on a machine with >= 4 for real figures.")
    loaded = loaded_note(res, os.cpu_count() or 1)
    if loaded:
        lines.append(loaded)
    lines.append(f"uptime: {uptime}")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = h.parser(__doc__, "64 images, 3 s warm-up + 4 s windows, 1 round")
    p.add_argument("--cores", type=parse_cores, default=None,
                   help="T,W1,W2,W3: the trainer's core and each worker's (default 0,1,2,3 modulo the cores)")
    p.add_argument("--link-mbit", type=parse_link, default=1000.0,
                   help="every host link's cap in Mbit/s per direction (tc tbf), or 'none' (default 1000)")
    p.add_argument("--images", type=int, default=None, help="JPEG images in the data (default 256; --quick 64)")
    p.add_argument("--batch", type=int, default=16, help="images per element (default 16)")
    p.add_argument("--warmup", type=float, default=None, help="seconds before the window (default 5; --quick 3)")
    p.add_argument("--seconds", type=float, default=None, help="the measured window (default 10; --quick 4)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a trainer may run past its window")
    p.add_argument("--tf-compression", choices=("AUTO", "none"), default="none",
                   help="tf-kK rows: distribute(compression=...); default none: TensorFlow's default AUTO compresses "
                        "each batch on the worker's one core and measured slower here")
    p.add_argument("--no-tf", action="store_true", help="leave the tf.data service rows out (they start TensorFlow)")
    p.add_argument("--trainer", metavar="JSON", help=argparse.SUPPRESS)
    args = h.settle(p, p.parse_args(argv), {"images": (256, 64), "repeats": (2, 1), "warmup": (5.0, 3.0),
                                            "seconds": (10.0, 4.0)},
                    positive=("images", "batch", "repeats", "warmup", "seconds", "timeout"))
    if args.cores is None:
        args.cores = default_cores(os.cpu_count() or 1)
    return args


def make_data(tmp: Path, images: int) -> list[str]:
    import dataclasses

    from pipeline_workloads import WORKLOADS, generate_workload

    wl = dataclasses.replace(WORKLOADS["chexnet"], name=f"dsbench{images}", num_images=images, num_shards=8)
    files, _ = generate_workload(wl, tmp, progress=False)
    return files


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    from conveyor.testing.hosts import Hosts

    names = contenders(len(WORKERS), tf=tf_skip(args) is None)
    singles: dict[str, float] = {}
    names_of_hosts = ["trainer", "worker1", "worker2", "worker3", "dispatcher"]
    with tempfile.TemporaryDirectory(prefix="conveyor-bench-ds-") as tmp, \
            Hosts(5, rate_mbit=args.link_mbit, names=names_of_hosts) as hosts:
        files = make_data(Path(tmp), args.images)
        bench = Bench(hosts, Path(tmp), files, args)

        def describe(value: float, run: dict[str, Any]) -> str:
            if "within_bound" in run:
                return f"RSS growth within bound: {run['within_bound']}"
            return f"{value:7.1f} images/s  {run['bytes_per_s'] / 1e6:7.1f} MB/s"

        return h.interleaved_rounds(names, args.repeats, lambda n, _: measure(bench, n, singles),
                                    describe=describe, reverse_odd=False)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.trainer is not None:
        trainer_role(json.loads(args.trainer))
        return 0
    from conveyor.testing.hosts import unavailable

    why = unavailable()
    if why:
        print(f"benchmarks/data_service.py cannot run here: {why} (it makes network namespaces; run it as root)",
              file=sys.stderr)
        return 2
    started = time.perf_counter()
    machine = h.machine_start(("torch", "pyzmq"))
    res = run_all(args)
    d = derive(res, args)
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    goals = goal_rows(d)
    report = {"benchmark": "data_service", "command": h.command_line("data_service", argv),
              "machine": h.machine_end(machine), "uptime": uptime,
              "config": {"cores": list(args.cores), "shared_cores": shared_cores(args.cores),
                         "link_mbit": args.link_mbit, "images": args.images, "batch": args.batch,
                         "warmup": args.warmup, "seconds": args.seconds, "repeats": args.repeats, "quick": args.quick,
                         "options": OPTIONS, "worker_buffer": WORKER_BUFFER, "tf_data_service": d["tf"]["skipped"],
                         "tf_compression": args.tf_compression}}
    h.publish_run("data_service", report, res, d, goals, format_table(res, d, args, uptime), started,
                  goal_lines(goals, d), args.out)
    return 0


def goal_rows(d: dict[str, Any]) -> list[dict[str, Any]]:
    """Scaling and memory as yes/no; conveyor over tf.data service (the lowest K) unless TF was skipped."""
    goals = [GOAL_SCALING.row(1.0 if d["scaling_pass"] else 0.0), GOAL_MEMORY.row(1.0 if d["memory_pass"] else 0.0)]
    if not d["tf"]["skipped"]:
        ratio = d["tf"]["min_ratio"]
        goals.append(GOAL_TF.row(ratio, shown=f"{ratio:.2f}x at the lowest K"))
    return goals


def goal_lines(goals: list[dict[str, Any]], d: dict[str, Any]) -> str:
    lines = h.format_goals(goals, show=lambda g: g.get("shown") or ("yes" if g["pass"] else "no"))
    if d["tf"]["skipped"]:
        lines += f"\nSKIP {GOAL_TF.name}: {d['tf']['skipped']}"
    return lines


GOAL_SCALING = h.Goal("K workers >= 0.9 x the sum of their single rates, or the link the limit", "scaling", 1.0)
GOAL_MEMORY = h.Goal("trainer and dispatcher peak RSS within the queue-size bound, worker >= 10x faster", "memory", 1.0)
GOAL_TF = h.Goal("service-kK >= 1.0 x TensorFlow's tf.data service (tf-kK) at every K", "vs_tf", 1.0)


if __name__ == "__main__":
    sys.exit(main())
