"""Warm task starts against new interpreters: a task's start-up, a 2-task digits job, and a restart's stall.

    python benchmarks/warm_start.py [--repeats 5] [--epochs 2] [--section start|job|stall|all] [--json out.json]

``start``: from ``RunningTask.start`` to the first line after ``import torch, torch._dynamo`` in the task -
wall seconds and the task's own CPU seconds at that line (median of ``--repeats``); warm excludes the
template's one-time imports (reported once). ``job``: ``conveyor run -n 2 examples/digits/train.py`` for
``--epochs``: wall and CPU of the launcher and everything it started (the template and its tasks included:
it reaps them, the launcher reaps it). ``stall``: the same job with ``CONVEYOR_FAULT=worker:1:after-step:9``,
summary.json's recovery block (docs/launcher.md, "Recovery"). Both modes of a section run alternately.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "examples" / "digits" / "train.py"
FIRST_LINE = """import resource, time
import torch, torch._dynamo
r = resource.getrusage(resource.RUSAGE_SELF)
print(f"mark {time.time()!r} {r.ru_utime + r.ru_stime!r}", flush=True)
"""


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def start_section(repeats: int, folder: Path) -> dict:
    from conveyor.cluster.spec import TaskId
    from conveyor.launch import warm
    from conveyor.launch.plan import TaskLaunch
    from conveyor.launch.tasks import Console, RunningTask

    script = folder / "first_line.py"
    script.write_text(FIRST_LINE)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    began = time.monotonic()
    warm.configure(True, environ=env)
    template = warm._template
    template.ready.wait(300)
    ready = {"template_ready_wall_s": round(time.monotonic() - began, 2)}
    rows: dict[str, list] = {"plain": [], "warm": []}
    for i in range(repeats):
        for mode in ("plain", "warm"):
            warm.configure(mode == "warm")
            launch = TaskLaunch(task=TaskId("worker", 0), argv=(sys.executable, str(script)), env=env,
                                log_path=str(folder / f"{mode}-{i}.log"))
            t0 = time.time()
            task = RunningTask.start(launch, 0, Console(io.StringIO(), io.StringIO()))
            task.proc.wait(300)
            task.pump.join(10)
            _, when, cpu = next(line for line in task.tail if line.startswith("mark ")).split()
            rows[mode].append((float(when) - t0, float(cpu)))
    warm.shutdown()
    template.proc.wait(30)
    return {**ready, **{mode: {"wall_s": round(statistics.median(r[0] for r in runs), 3),
                               "cpu_s": round(statistics.median(r[1] for r in runs), 3), "runs": runs}
                        for mode, runs in rows.items()}}


def _job(mode: str, folder: Path, epochs: int, env: dict | None = None) -> dict:
    out = folder / f"out-{mode}-{time.monotonic_ns()}"
    flag = "--warm-start" if mode == "warm" else "--no-warm-start"
    cmd = [sys.executable, "-m", "conveyor.cli.main", "run", "-n", "2", flag,
           "--data-dir", str(folder / "data"), "--output-dir", str(out), "--max-restarts", "1", "--restart-delay", "0",
           str(DIGITS), "--epochs", str(epochs), "--batch-size", "64", "--checkpoint-every", "4"]
    cpu0, t0 = _children_cpu(), time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env={**os.environ, **(env or {})})
    wall, cpu = time.monotonic() - t0, _children_cpu() - cpu0
    if proc.returncode != 0:
        raise SystemExit(f"{mode} job failed: {(proc.stdout + proc.stderr)[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "recovery": summary.get("recovery")}


def job_section(repeats: int, folder: Path, epochs: int, fault: str | None = None) -> dict:
    _job("plain", folder, 1)  # writes the data folder, so that no measured run converts it
    env = {"CONVEYOR_FAULT": fault} if fault else None
    rows: dict[str, list] = {"plain": [], "warm": []}
    for _ in range(repeats):
        for mode in ("plain", "warm"):
            rows[mode].append(_job(mode, folder, epochs, env))
    result = {}
    for mode, runs in rows.items():
        result[mode] = {"wall_s": statistics.median(r["wall_s"] for r in runs),
                        "cpu_s": statistics.median(r["cpu_s"] for r in runs), "runs": runs}
        if fault:
            result[mode]["stall_s"] = statistics.median(r["recovery"][0]["total"] for r in runs)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--section", choices=("start", "job", "stall", "all"), default="all")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    report = {"load": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(prefix="warm-start-") as tmp:
        folder = Path(tmp)
        if args.section in ("start", "all"):
            report["start"] = start_section(args.repeats, folder)
        if args.section in ("job", "all"):
            report["job"] = job_section(args.repeats, folder, args.epochs)
        if args.section in ("stall", "all"):
            report["stall"] = job_section(args.repeats, folder, 1, fault="worker:1:after-step:9")
    report["load_after"] = os.getloadavg()[0]
    for section in ("start", "job", "stall"):
        if section in report:
            for mode in ("plain", "warm"):
                row = {k: v for k, v in report[section][mode].items() if k != "runs"}
                print(f"{section:6} {mode:6} {row}")
    if "start" in report:
        print(f"template ready after {report['start']['template_ready_wall_s']} s (wall, once per launcher)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
