"""The goodput section of benchmarks/elastic.py: an elastic job that loses a worker host every --period s.

Four network-namespace hosts (conveyor.testing.hosts, needs root): host0 runs node 0 (`--node-rank 0`: the
rendezvous store and the chief, never killed), host1..host3 are the 3 worker hosts; every host runs
`conveyor run -n 1 --nnodes 2:4 --warm-start` (--no-warm-start: new interpreters) of the digits example
(allreduce, 1 thread per task). Two jobs, one after the other in the same invocation: the failure-free peer;
then the same job where worker host ``1 + k % 3`` is killed at ``(k+1) x --period`` s (every process on it
SIGKILLed: launcher and tasks, a machine losing power) and its launcher started again --down s later. Both
train more epochs than any window holds, whatever the load, and the benchmark ends both the same way: at the
window's end, once the chief has logged a record past it (or --max-gap s later), every launcher is SIGKILLed.

Goodput. The chief logs every 5 steps (metrics.jsonl: the step, its time, the exact samples summed over the
workers since the last record, and their count). A record is *undone* when a later attempt resumed from a
checkpoint before its step (its samples left the model); checkpoints are at multiples of 5 steps, so an attempt
resumed from step R logs first at R + 5, and every earlier record past R is undone. Samples that stayed = the
samples of the records not undone within --duration s of the chief's first record (the window, where the kills
are timed from: start-up is no failure's cost); goodput = (that / duration) of the failure run over the peer's.
Goal >= 0.80 (TorchFT's 82 %). Per failure: the stall (the gap between the last record kept before the kill and
the first after, less the run's median gap) split into detect / stop / rendezvous / start-up by node 0's
logs/restarts.json (conveyor.recovery), steps undone, the same for the re-forming that takes the host back, and
the workers over time; a failure with no record after it says so (``recovered`` false). The job never stops:
node 0 runs until the benchmark ends it, no launcher ends by itself with a failure status, and no gap between
records kept (nor from the last one to the end) exceeds --max-gap (default --period).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as h  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "examples" / "digits" / "train.py"
PORT = 29400
LOG_EVERY = 5  # the digits example's log_every_steps: records are at multiples of it
WORKER_HOSTS = (1, 2, 3)
PARTS = ("detect_s", "stop_s", "rendezvous_s", "start_up_s")
GOAL = 0.80
GOALS = (h.Goal("goodput >= 0.80 of the failure-free run", "goodput", GOAL, ">="),
         h.Goal("the job never stops (node 0 runs to the end, no launcher fails, no gap > --max-gap)", "never_stops",
                1.0, ">="))
DEFAULTS = {"duration": (600.0, 90.0), "period": (60.0, 45.0), "down": (30.0, 20.0)}
EPOCHS = 100000  # more than any window holds (the digits: ~30 steps an epoch); the benchmark ends the runs


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The section's flags (defaults settled by :func:`settle`: full, --quick)."""
    p.add_argument("--duration", type=float, default=None, help="goodput: seconds per run (default 600; --quick 90)")
    p.add_argument("--period", type=float, default=None,
                   help="goodput: a worker host is killed every this many seconds (default 60; --quick 45)")
    p.add_argument("--down", type=float, default=None,
                   help="goodput: seconds a killed host stays down (default 30; --quick 20)")
    p.add_argument("--max-gap", type=float, default=None,
                   help="goodput: the longest gap between steps allowed (default --period: a period with no step "
                        "at all is a job that cannot keep up)")
    p.add_argument("--batch-size", type=int, default=32, help="goodput: per worker (default 32)")
    p.add_argument("--checkpoint-every", type=int, default=10,
                   help=f"goodput: steps, a multiple of {LOG_EVERY} (default 10)")
    p.add_argument("--node-timeout", type=float, default=5.0, help="goodput: conveyor run --node-timeout (default 5)")
    p.add_argument("--last-call", type=float, default=1.0, help="goodput: --rdzv-last-call (default 1)")
    p.add_argument("--keep", action="store_true", help="goodput: keep the jobs' folders (logs, records) in --dir")
    p.add_argument("--no-warm-start", dest="warm_start", action="store_false",
                   help="goodput: start tasks as new interpreters, not forked from a warm template (conveyor run "
                        "--warm-start, the default here; docs/launcher.md, Warm starts): for comparison")


def settle(args: argparse.Namespace) -> None:
    for name, (full, quick) in DEFAULTS.items():
        if getattr(args, name, None) is None:
            setattr(args, name, quick if args.quick else full)
    if args.max_gap is None:
        args.max_gap = args.period
    if args.checkpoint_every % LOG_EVERY or min(args.duration, args.period, args.down) <= 0:
        raise ValueError(f"--checkpoint-every must be a multiple of {LOG_EVERY} and --duration, --period, --down "
                         f"positive (got {args.checkpoint_every}, {args.duration}, {args.period}, {args.down})")


# ------------------------------------------------------------------------------------ the records (pure)


def kept_records(records: list[dict[str, Any]], log_every: int = LOG_EVERY) -> list[dict[str, Any]]:
    """The train records whose steps stayed in the model, in order (module docstring: an attempt resumed from
    R logs first at R + log_every; every record before it past R is undone). Each gets ``undone``: how many
    records its attempt's start undid."""
    kept: list[dict[str, Any]] = []
    for r in records:
        if r.get("event") != "train":
            continue
        resumed = r["step"] - log_every
        undone = 0
        while kept and kept[-1]["step"] > resumed and r["step"] <= kept[-1]["step"]:
            kept.pop()
            undone += 1
        kept.append({**r, "undone": undone})
    return kept


def gaps(kept: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """(time of a record, seconds since the one before) for every kept record after the first."""
    return [(b["time"], b["time"] - a["time"]) for a, b in zip(kept, kept[1:], strict=False)]


def world_timeline(kept: list[dict[str, Any]], t0: float) -> list[list[float]]:
    """[[seconds from t0, workers], ...] at each change of the workers a record sums."""
    out: list[list[float]] = []
    for r in kept:
        if not out or out[-1][1] != r["workers"]:
            out.append([round(r["time"] - t0, 1), r["workers"]])
    return out


def parts(since: float, restarts: list[dict[str, Any]], kept: list[dict[str, Any]]) -> dict[str, float]:
    """Where a stall that began at ``since`` went, from node 0's next restart record (logs/restarts.json:
    conveyor.recovery) and the chief's next record: detect (until node 0's launcher saw the failure or the
    regroup), stop (its tasks stopped), rendezvous (the next round's tasks started) and start-up (to the first
    record after: process start, imports, group, restore and that record's 5 steps)."""
    rec = next((r for r in restarts if r.get("seen") is not None and r["seen"] > since), None)
    if rec is None or rec.get("stopped") is None or rec.get("started") is None:
        return {}
    first = next((r["time"] for r in kept if r["time"] > rec["started"]), None)
    out = {"detect_s": rec["seen"] - since, "stop_s": rec["stopped"] - rec["seen"],
           "rendezvous_s": rec["started"] - rec["stopped"]}
    if first is not None:
        out["start_up_s"] = first - rec["started"]
    return out


def failure_rows(kept: list[dict[str, Any]], events: list[dict[str, Any]], pace: float,
                 restarts: list[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """Per failure: the stall at the loss (the gap holding the kill, less ``pace``) and its :func:`parts`, steps
    undone then, and the stall when the host rejoined (the gap before the first record with more workers after
    its restart) and its parts (``rejoin_``)."""
    rows = []
    for ev in events:
        after = next((i for i, r in enumerate(kept) if r["time"] > ev["killed"]), None)
        row: dict[str, Any] = {"host": ev["host"], "killed_s": ev["killed_rel"], "back_s": ev.get("back_rel"),
                               **parts(ev["killed"], list(restarts), kept)}
        row["recovered"] = after is not None  # (none after: the job stopped or stalled until the benchmark ended it)
        if after is not None and after > 0:
            row["stall_s"] = kept[after]["time"] - kept[after - 1]["time"] - pace
            row["undone_steps"] = kept[after]["undone"] * LOG_EVERY
            row["workers_after"] = kept[after]["workers"]
        back = ev.get("back")
        if back is not None and after is not None:
            low = kept[after]["workers"]
            grew = next((i for i, r in enumerate(kept) if r["time"] > back and r["workers"] > low and i > 0), None)
            if grew is not None:
                row["rejoin_stall_s"] = kept[grew]["time"] - kept[grew - 1]["time"] - pace
                row["rejoined_s"] = kept[grew]["time"] - ev["t0"]
                row.update({f"rejoin_{k}": v for k, v in parts(kept[grew - 1]["time"], list(restarts), kept).items()})
        rows.append(row)
    return rows


def summarize_run(records: list[dict[str, Any]], t0: float, duration: float) -> dict[str, Any]:
    """Samples kept within the window, their rate, the pace (median gap) and the longest gap, of one run."""
    kept = kept_records(records)
    inside = [r for r in kept if 0 < r["time"] - t0 <= duration]  # (the first record's samples: before the window)
    samples = sum(r["samples"] for r in inside)
    # the window, the same for both runs; only a run that did not outlast it (it stopped) is counted to its last record
    outlasted = any(r["time"] - t0 > duration for r in kept)
    span = duration if outlasted or not inside else inside[-1]["time"] - t0
    spans = [g for t, g in gaps(kept) if 0 < t - t0 <= duration]
    return {"samples_kept": samples, "rate": samples / span, "span_s": span, "outlasted_window": outlasted,
            "pace_s": statistics.median(spans) if spans else None,
            "max_gap_s": max((g for _, g in gaps(kept)), default=None),
            "records": len(records), "records_kept": len(kept),
            "undone_samples": sum(r["samples"] for r in records if r.get("event") == "train") - sum(
                r["samples"] for r in kept),
            "last_epoch_in_window": inside[-1]["epoch"] if inside else None, "kept": kept}


# ------------------------------------------------------------------------------------ the jobs


class Job:
    """One elastic job's launchers on the hosts: node 0 on host0, a worker node on each worker host."""

    def __init__(self, hosts: Any, folder: Path, data: Path, args: argparse.Namespace, epochs: int = EPOCHS) -> None:
        self.hosts, self.folder, self.out = hosts, folder, folder / "out"
        folder.mkdir(parents=True)
        secret = folder / "job.secret"
        secret.write_text(os.urandom(32).hex())
        secret.chmod(0o600)
        self.common = ["-n", "1", "--nnodes", f"2:{1 + len(WORKER_HOSTS)}", "--rdzv", f"host0:{PORT}",
                       "--job-secret-file", str(secret), "--timeout", "120", "--node-timeout", f"{args.node_timeout:g}",
                       "--rdzv-last-call", f"{args.last_call:g}", "--max-restarts", "1000", "--restart-delay", "0",
                       "--warm-start" if args.warm_start else "--no-warm-start",
                       "--data-dir", str(data), "--output-dir", str(self.out), str(DIGITS), "--epochs", str(epochs),
                       "--batch-size", str(args.batch_size), "--checkpoint-every", str(args.checkpoint_every)]
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.procs: dict[int, subprocess.Popen] = {}
        self.exits: list[dict[str, Any]] = []  # launchers that ended in the run: host, exit status, killed by us or not
        self.starts = 0
        self.stopped_at_end: list[int] = []  # the hosts whose launchers still ran when the benchmark ended the job
        self.t0 = 0.0
        self.ended_at = 0.0

    def start(self, host: int) -> None:
        argv = [sys.executable, "-m", "conveyor.cli.main", "run", *(["--node-rank", "0"] if host == 0 else []),
                *self.common]
        self.starts += 1
        with open(self.folder / f"host{host}-{self.starts:02d}.log", "w") as log:
            self.procs[host] = self.hosts.popen(self.hosts[host], argv, cwd=self.folder, stdout=log,
                                                stderr=subprocess.STDOUT, env=self.env)

    def kill(self, host: int, at_end: bool = False) -> None:
        """Every process on ``host``, launcher and tasks, SIGKILLed (conveyor.testing.hosts.Hosts.kill_host): a
        failure, or (``at_end``) the benchmark ending the job, which is no exit of the run's."""
        self.hosts.kill_host(self.hosts[host])
        proc = self.procs.pop(host)
        status = proc.wait(timeout=30)
        if at_end:
            self.stopped_at_end.append(host)
        else:
            self.exits.append({"host": host, "status": status, "killed": True})

    def ended(self) -> list[dict[str, Any]]:
        """Launchers that ended on their own since the last look (they are taken off the running ones)."""
        done = [(host, p.returncode) for host, p in self.procs.items() if p.poll() is not None]
        for host, status in done:
            del self.procs[host]
            self.exits.append({"host": host, "status": status, "killed": False})
        return [e for e in self.exits[len(self.exits) - len(done):]] if done else []

    def finish(self, window_end: float, timeout: float) -> None:
        """End the job after the window: once the chief logged a record past ``window_end`` (so every record of
        the window is on disk), or ``timeout`` s later when none comes (the trailing gap then shows it)."""
        deadline = time.monotonic() + timeout
        while 0 in self.procs and time.monotonic() < deadline:
            if any(r.get("event") == "train" and r["time"] > window_end for r in self.records()):
                break
            self.ended()
            time.sleep(0.2)
        self.stop()

    def stop(self) -> None:
        self.ended()  # (a launcher that ended by itself meanwhile is the run's exit, not the benchmark's stop)
        self.ended_at = time.time()
        for host in list(self.procs):
            self.kill(host, at_end=True)

    def first_record(self, timeout: float) -> float:
        """The time of the chief's first train record: the window starts there (start-up is no failure's cost)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            records = [r for r in self.records() if r.get("event") == "train"]
            if records:
                return float(records[0]["time"])
            if self.ended():
                break
            time.sleep(0.2)
        raise h.ContenderFailed(f"no train record within {timeout:g} s (exits {self.exits})\n{self.tail(0)}")

    def records(self) -> list[dict[str, Any]]:
        path = self.out / "metrics.jsonl"
        if not path.exists():
            return []
        lines = path.read_text().splitlines()
        return [json.loads(line) for line in lines[:-1] + [x for x in lines[-1:] if x.endswith("}")] if line.strip()]

    def tail(self, host: int = 0, chars: int = 1500) -> str:
        logs = sorted(self.folder.glob(f"host{host}-*.log"))
        return logs[-1].read_text()[-chars:] if logs else ""


def schedule(args: argparse.Namespace, failures: bool) -> list[tuple[float, str, int]]:
    """(seconds from launch, "kill" | "start", host) in time order, within --duration."""
    if not failures:
        return []
    events = []
    k = 0
    while (k + 1) * args.period < args.duration:
        host = WORKER_HOSTS[k % len(WORKER_HOSTS)]
        events.append(((k + 1) * args.period, "kill", host))
        if (k + 1) * args.period + args.down < args.duration:
            events.append(((k + 1) * args.period + args.down, "start", host))
        k += 1
    return sorted(events)


def drive(job: Job, args: argparse.Namespace, failures: bool, log: Any = print) -> list[dict[str, Any]]:
    """Launch the job, kill and restart hosts on the schedule until --duration; the failures as they went."""
    for host in (*WORKER_HOSTS, 0):  # node 0 last: the others wait for its store, so round 0 has every node
        job.start(host)
    job.t0 = job.first_record(timeout=600)
    events: list[dict[str, Any]] = []
    for at, what, host in schedule(args, failures):
        while time.time() < job.t0 + at and 0 in job.procs:
            if job.ended():  # a launcher that ends by itself inside the window: the job stopped there
                log(f"    a launcher ended at {time.time() - job.t0:.0f} s: {job.exits[-1]}")
            time.sleep(0.2)
        now = time.time()
        if 0 not in job.procs:  # node 0 ended inside the window: the job stopped (never_stops says so)
            break
        if what == "kill":
            job.kill(host)
            events.append({"host": f"host{host}", "killed": now, "killed_rel": round(now - job.t0, 1), "t0": job.t0})
            log(f"    {now - job.t0:6.1f} s: host{host} killed")
        else:
            job.start(host)
            ev = next(e for e in reversed(events) if e["host"] == f"host{host}")
            ev.update(back=now, back_rel=round(now - job.t0, 1))
            log(f"    {now - job.t0:6.1f} s: host{host} started again")
    while time.time() < job.t0 + args.duration and 0 in job.procs:
        job.ended()
        time.sleep(0.2)
    return events


def write_data(folder: Path) -> Path:
    """The digits as TFRecord shards, once for both jobs (the chief would write them on its first start)."""
    spec = importlib.util.spec_from_file_location("digits_train", DIGITS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.write_tfrecords(str(folder / "digits"))
    return folder


def one_run(hosts: Any, folder: Path, data: Path, args: argparse.Namespace, failures: bool,
            log: Any = print) -> dict[str, Any]:
    """One job, driven for --duration s and then ended by the benchmark (:meth:`Job.finish`), either run alike."""
    job = Job(hosts, folder, data, args)
    try:
        events = drive(job, args, failures, log)
        job.finish(job.t0 + args.duration, timeout=args.max_gap)
    finally:
        if job.procs:  # (an error before the end: nothing may keep running)
            job.stop()
    run = summarize_run(job.records(), job.t0, args.duration)
    own = [e for e in job.exits if not e["killed"]]
    last = run["kept"][-1]["time"] if run["kept"] else job.t0
    run.update(events=events, exits=job.exits, stopped_at_end=sorted(job.stopped_at_end),
               tail_gap_s=job.ended_at - last, wall_s=job.ended_at - job.t0)
    # the job never stops: node 0 ran until the benchmark ended it, no launcher failed by itself, no long gap
    run["never_stops"] = bool(0 in job.stopped_at_end and all(e["status"] == 0 for e in own)
                              and max(run["max_gap_s"] or 0.0, run["tail_gap_s"]) <= args.max_gap)
    if not run["never_stops"]:
        run["node0_tail"] = job.tail(0)
    if failures:
        restarts: list[dict[str, Any]] = []
        with contextlib.suppress(OSError, ValueError):
            restarts = json.loads((job.out / "logs" / "restarts.json").read_text())
        run["failures"] = failure_rows(run["kept"], events, run["pace_s"] or 0.0, restarts)
        run["world"] = world_timeline(run["kept"], job.t0)
        with contextlib.suppress(OSError, ValueError):
            run["recovery"] = json.loads((job.out / "summary.json").read_text()).get("recovery")
    del run["kept"]
    return run


def goodput(args: argparse.Namespace) -> dict[str, Any]:
    """The goodput section (module docstring): the peer, then the failure run, on one set of hosts."""
    from conveyor.testing.hosts import Hosts, unavailable

    settle(args)
    config = {k: getattr(args, k) for k in ("duration", "period", "down", "max_gap", "batch_size", "checkpoint_every",
                                            "node_timeout", "last_call", "warm_start")}
    reason = unavailable()
    if reason:
        return {"config": config, "runs": {}, "errors": [f"not run: {reason}"], "derived": {},
                "goals": h.evaluate_goals(GOALS, {}), "table": f"goodput: not run ({reason})"}
    runs: dict[str, Any] = {}
    errors: list[str] = []
    load = [os.getloadavg()]
    keep = args.keep and tempfile.mkdtemp(prefix="conveyor-elastic-goodput-", dir=args.dir)
    with (contextlib.nullcontext(keep) if keep else tempfile.TemporaryDirectory(
            prefix="conveyor-elastic-goodput-", dir=args.dir)) as tmp, Hosts(1 + len(WORKER_HOSTS)) as hosts:
        data = write_data(Path(tmp) / "data")
        print("  failure-free run", flush=True)
        runs["failure_free"] = one_run(hosts, Path(tmp) / "free", data, args, False)
        load.append(os.getloadavg())
        print("  failure run", flush=True)
        runs["failures"] = one_run(hosts, Path(tmp) / "failures", data, args, True)
        load.append(os.getloadavg())
    free, fail = runs["failure_free"], runs["failures"]
    derived = {"goodput": h.ratio(fail["rate"], free["rate"]), "never_stops": float(fail["never_stops"]),
               "stall_s_median": h.median([f.get("stall_s") for f in fail["failures"]]),
               "rejoin_stall_s_median": h.median([f.get("rejoin_stall_s") for f in fail["failures"]]),
               "loadavg": load}
    for name, run in runs.items():
        if not run["never_stops"]:
            errors.append(f"the {name} run stopped or stalled (exits {run['exits']}, node 0 ran to the end: "
                          f"{0 in run['stopped_at_end']}, longest gap {h.fmt(run['max_gap_s'], '.1f')} s, from the "
                          f"last record to the end {run['tail_gap_s']:.1f} s)")
    lost = [i for i, f in enumerate(fail["failures"], 1) if not f["recovered"]]
    if lost:
        errors.append(f"failure(s) {lost}: no record after the kill (the job did not recover before the end)")
    return {"config": config, "runs": runs, "errors": errors, "derived": derived,
            "goals": h.evaluate_goals(GOALS, derived), "table": table(args, runs, derived)}


def table(args: argparse.Namespace, runs: dict[str, Any], derived: dict[str, Any]) -> str:
    free, fail = runs["failure_free"], runs["failures"]
    loads = " / ".join(" ".join(f"{x:.1f}" for x in la) for la in derived["loadavg"])
    starts = "--warm-start (tasks forked from a template)" if args.warm_start else "--no-warm-start (new interpreters)"
    head = (f"goodput: digits (allreduce, batch {args.batch_size} per worker, 1 thread per task, checkpoint every "
            f"{args.checkpoint_every} steps), node 0 on host0 + {len(WORKER_HOSTS)} worker hosts, 1 task each, "
            f"{starts}, --nnodes 2:{1 + len(WORKER_HOSTS)} --node-timeout {args.node_timeout:g} --rdzv-last-call "
            f"{args.last_call:g}; a worker host killed every {args.period:g} s, back {args.down:g} s later, "
            f"{args.duration:g} s per run, both ended by the benchmark after it; load average (1/5/15 min) before / "
            f"between / after: {loads} on {os.cpu_count()} CPU(s)")
    rows = [["run", "samples kept", "samples/s", "samples undone", "pace s", "longest gap s", "last record to end s",
             "launchers' exits in the run", "running at the end"]]
    for name, run in (("failure-free", free), ("failures", fail)):
        exits = ", ".join(f"host{e['host']}:{'killed' if e['killed'] else e['status']}" for e in run["exits"]) or "-"
        rows.append([name, str(run["samples_kept"]), h.fmt(run["rate"], ".1f"), str(run["undone_samples"]),
                     h.fmt(run["pace_s"], ".2f"), h.fmt(run["max_gap_s"], ".1f"), h.fmt(run["tail_gap_s"], ".1f"),
                     exits, ",".join(f"host{x}" for x in run["stopped_at_end"]) or "none"])
    per = [["failure", "host", "killed s", "stall s", "(detect", "stop", "rdzv", "start-up)", "steps undone",
            "workers after", "back s", "rejoined s", "rejoin stall s", "(detect", "stop", "rdzv", "start-up)"]]
    for i, f in enumerate(fail["failures"], 1):
        per.append([str(i), f["host"], h.fmt(f["killed_s"], ".0f"), h.fmt(f.get("stall_s"), ".1f"),
                    *(h.fmt(f.get(k), ".1f") for k in PARTS), str(f.get("undone_steps", "-")),
                    str(f.get("workers_after", "-" if f["recovered"] else "no record after")),
                    h.fmt(f.get("back_s"), ".0f"), h.fmt(f.get("rejoined_s"), ".0f"),
                    h.fmt(f.get("rejoin_stall_s"), ".1f"), *(h.fmt(f.get(f"rejoin_{k}"), ".1f") for k in PARTS)])
    world = ", ".join(f"{t:g} s: {w}" for t, w in fail["world"])
    return "\n".join([head, h.format_rows(rows, underline=True),
                      f"goodput (samples kept per second, failures / failure-free): {h.fmt(derived['goodput'], '.3f')}"
                      f"; the job never stops: {bool(derived['never_stops'])} (ended by the benchmark "
                      f"{fail['wall_s']:.0f} s after its first record)",
                      h.format_rows(per, underline=True), f"workers over time (failure run): {world}"])
