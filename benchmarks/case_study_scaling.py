"""CIFAR-10 case study, part 2: speedup and scaling efficiency of the CIFAR example under `allreduce`.

Each measurement is a real job: `python -m conveyor.cli.main run -n K --strategy allreduce --max-restarts 0
examples/cifar10/train.py --synthetic --max-steps S --batch-size B --depth D` in a fresh output folder.
A worker stands for one accelerator: the launcher (and so every task it starts) may run only on the first
K x `cores_per_worker` CPUs of this process's set, and each task runs `cores_per_worker` intra-op threads;
when the machine has fewer CPUs than that, the job runs on all of them and the run says so
(`oversubscribed`). One worker's rate is the chief's median step time (summary.json `step_breakdown.total`,
which leaves out start-up, the first steps' warm-up, evaluation and the last checkpoint):
samples/s = K x B / median step seconds. Speedup(K) = samples/s(K) / samples/s(1) of the same round,
median over rounds; efficiency = speedup / K (against the smallest K measured when 1 is left out).

Reference points, drawn on the same axes and labelled as such: the speedups the issue's sources report for
a CNN trained data-parallel on GPUs, 1.7x on 2, 3.5x on 4, 6.2x on 8 (`REFERENCE`). They are not
measured here.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by file path
import harness as h  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "cifar10" / "train.py"
REFERENCE = {2: 1.7, 4: 3.5, 8: 6.2}  # workers -> speedup, CNN on GPUs (reference points, not measured here)
REFERENCE_LABEL = "reference: CNN, data-parallel on 2/4/8 GPUs (1.7x, 3.5x, 6.2x)"


def job_cpus(world: int, per_worker: int) -> list[int] | None:
    """The first world x per_worker CPUs this process may use, or None when there are fewer."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    need = world * per_worker
    return allowed[:need] if allowed and need <= len(allowed) else None


def job_command(world: int, settings: dict[str, Any], out_dir: Path, data_dir: Path) -> list[str]:
    size = max(2048, world * settings["batch"] * (settings["steps"] + 2))  # no epoch ends inside the steps
    return [sys.executable, "-m", "conveyor.cli.main", "run", "-n", str(world), "--strategy", "allreduce",
            "--max-restarts", "0", "--timeout", str(int(settings["timeout"])), "--data-dir", str(data_dir),
            "--output-dir", str(out_dir), str(EXAMPLE), "--synthetic", "--synthetic-size", str(size),
            "--max-steps", str(settings["steps"]), "--batch-size", str(settings["batch"]),
            "--depth", str(settings["depth"]), "--log-every", str(settings["steps"]),
            "--checkpoint-every", str(10 ** 6)]


def _launch(cmd: list[str], cpus: list[int] | None, per_worker: int, timeout: float) -> tuple[int | None, str]:
    return h.run_launcher(cmd, timeout, threads=per_worker, cwd=ROOT, cpus=cpus)

class JobCpu:
    """CPU seconds of the finished child processes (the launcher and, waited for by it, its tasks) and of the
    whole machine over a `with` block: how much of the machine the job had, and how much others took."""

    @staticmethod
    def _now() -> tuple[float, float, float]:
        own = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = psutil.cpu_times()
        busy = t.user + t.system + getattr(t, "nice", 0.0) + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
        return time.perf_counter(), own.ru_utime + own.ru_stime, busy

    def __enter__(self) -> JobCpu:
        self._start = self._now()
        return self

    def __exit__(self, *exc) -> None:
        (w0, own0, busy0), (w1, own1, busy1) = self._start, self._now()
        wall = max(w1 - w0, 1e-9)
        own = own1 - own0
        self.result = {"own_cores": own / wall, "other_cores": max(0.0, (busy1 - busy0) - own) / wall}


def run_job(world: int, settings: dict[str, Any], work: Path) -> tuple[float, dict[str, Any]]:
    """One `conveyor run` job: (samples/s from the median step, its details); ContenderFailed on failure."""
    out_dir = work / f"job-{time.monotonic_ns()}-{world}"
    cpus = job_cpus(world, settings["cores_per_worker"])
    cmd = job_command(world, settings, out_dir, work / "data")
    started = time.perf_counter()
    with JobCpu() as cpu:
        status, output = _launch(cmd, cpus, settings["cores_per_worker"], settings["timeout"] + 60)
    summary_path = out_dir / "summary.json"
    if status != 0 or not summary_path.exists():
        why = "timed out" if status is None else f"exited {status}"
        raise h.ContenderFailed(f"conveyor run -n {world} {why}: {output.strip()[-600:]}")
    s = json.loads(summary_path.read_text())
    step = s["step_breakdown"]["total"]
    if s["world_size"] != world or not step or step <= 0:
        raise h.ContenderFailed(f"summary.json says world size {s['world_size']}, median step {step}")
    rate = world * settings["batch"] / step
    return rate, {"samples_per_second": rate, "median_step_seconds": step, "step_breakdown": s["step_breakdown"],
                  "strategy": s["strategy"], "world_size": world, "steps": s["steps"],
                  "wall_samples_per_second": s["samples_per_second"], "wall_seconds": s["wall_seconds"],
                  "input_wait_fraction": s["input_wait_fraction"], "cpus": cpus, "oversubscribed": cpus is None,
                  "launcher_seconds": time.perf_counter() - started, "cores_used": cpu.result["own_cores"],
                  "other_cores": cpu.result["other_cores"]}


def run_rounds(workers: Sequence[int], settings: dict[str, Any], repeats: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="conveyor-case-study-allreduce-") as tmp:
        def measure(name: str, rnd: int) -> tuple[float, dict[str, Any]]:
            return run_job(int(name), settings, Path(tmp))

        def describe(rate: float, run: dict[str, Any]) -> str:
            return (f"{rate:.1f} samples/s (median step {run['median_step_seconds'] * 1000:.0f} ms, "
                    f"strategy {run['strategy']}, CPUs {run['cpus'] or 'all, oversubscribed'}; other processes "
                    f"{run['other_cores']:.2f} cores)")

        return h.interleaved_rounds([str(k) for k in workers], repeats, measure, describe=describe)


def derive(res: dict[str, Any], workers: Sequence[int]) -> dict[str, Any]:
    """Median samples/s per K; speedup and efficiency against the smallest K of the same round."""
    s = res["samples"]
    base = min(workers)
    speedup_rounds = {str(k): h.paired(s[str(k)], s[str(base)]) for k in workers}
    speedup = {str(k): h.median(v) for k, v in speedup_rounds.items()}
    return {
        "baseline_workers": base,
        "samples_per_second": {str(k): h.median(s[str(k)]) for k in workers},
        "speedup": speedup,
        "speedup_per_round": speedup_rounds,
        "efficiency": {str(k): h.ratio(speedup[str(k)], k / base) for k in workers},
        "median_step_seconds": {str(k): h.median([r and r["median_step_seconds"] for r in res["runs"][str(k)]])
                                for k in workers},
        "other_cores": {str(k): h.median([r and r.get("other_cores") for r in res["runs"][str(k)]]) for k in workers},
        "reference_speedup": {str(k): v for k, v in REFERENCE.items()},
    }


def format_table(res: dict[str, Any], d: dict[str, Any], settings: dict[str, Any], workers: Sequence[int]) -> str:
    head = (f"CIFAR example under allreduce: ResNet-{settings['depth']}, --synthetic, batch "
            f"{settings['batch']}/worker, "
            f"{settings['steps']} steps per job, {settings['cores_per_worker']} core(s) per worker; "
            f"{len(res['order']) // max(1, len(workers))} round(s)\n"
            f"samples/s = K x batch / chief's median step; speedup against {d['baseline_workers']} worker(s), "
            f"same round; medians over rounds")
    rows = [("workers", "samples/s", "step ms", "speedup", "efficiency", "reference speedup", "others",
             "per round")]
    for k in workers:
        key = str(k)
        rows.append((key, h.fmt(d["samples_per_second"][key], ".1f"), h.fmt(d["median_step_seconds"][key], ".0f", 1000),
                     h.fmt(d["speedup"][key], ".2f"), h.fmt(d["efficiency"][key], ".0%", 1),
                     h.fmt(REFERENCE.get(k), ".1f"), h.fmt(d["other_cores"][key], ".2f"),
                     h.fmt_all(res["samples"][key], ".1f")))
    for k, v in REFERENCE.items():
        if k not in workers:
            rows.append((str(k), "-", "-", "-", "-", f"{v:.1f}", "-", "(reference only)"))
    return "\n".join([head, "", h.format_rows(rows, left=(0, 7)), f"({REFERENCE_LABEL}; not measured here; "
                      "others = cores busy with other processes on the machine during the job)"])
