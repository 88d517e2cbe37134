"""Parameter-server training benchmark: the digits example under ps-sync, ps-async and all-reduce, with a straggler.

    python benchmarks/ps_training.py               # default: 3 rounds x 5 contenders, 8 epochs each (4-5 min)
    python benchmarks/ps_training.py --quick       # 1 round, 1 epoch, every contender (smoke run)
    python benchmarks/ps_training.py --quick --contenders ps-sync+straggler,ps-async+straggler   # the tests' run
    python benchmarks/ps_training.py --repeats 5 --epochs 8 --out /tmp/bench-results

Workload: the real digits demo (``examples/digits/train.py``: its ``Net``, ``pipeline``, ``FEATURES`` and
``write_tfrecords``, loaded by file path, not copied), trained by the same ``conveyor.Trainer`` its
``main()`` builds (SGD with momentum 0.9, batch 32 per worker, checkpoint every 50 steps, a log record
every 5 steps, evaluation on the test split at the end). This file is the training script: every job
is a real ``conveyor run`` subprocess (``python -m conveyor.cli.main run -n 2 [--ps 1] --strategy S
--max-restarts 0 --data-dir DATA --output-dir OUT benchmarks/ps_training.py --train JSON``), so the
launcher, the ps task, the TFRecord input pipeline and the checkpoints are all the real ones. All jobs
of one invocation share one ``DATA`` folder (the shards are written into ``DATA/digits`` by the first
job), each job gets a fresh ``OUT``, all in a temporary folder. Every task runs one intra-op thread
(``OMP_NUM_THREADS=1``): 2 workers + 1 ps task on this 2-core machine. Same seed, same epochs and the
same lr (0.02, ``--lr``) for every contender: asynchronous updates need a smaller step than the demo's
synchronous 0.05 (stale gradients act like extra momentum), and one lr for all keeps the comparison fair.

Contenders (2 workers each):

- ``allreduce``: ``--strategy allreduce``, no ps task; workers in lockstep (gloo all-reduce of gradients).
- ``ps-sync``: 1 ps task, ``--strategy ps-sync``; every step waits for both workers' gradients.
- ``ps-async``: 1 ps task, ``--strategy ps-async``; each worker pushes and pulls at its own pace and
  all stop when the steps committed by both together reach epochs x steps per epoch x 2 (as
  TensorFlow's global step), so a faster worker does more of the steps.
- ``ps-sync+straggler`` / ``ps-async+straggler``: the same, with worker rank 1 made ``--slowdown`` (2)
  times slower. After each of its steps a Trainer callback sleeps ``(slowdown - 1) x (total - input_wait)``
  of that step's ``StepTimes``: its compute, push and pull, but not its wait for the input pipeline,
  take ``slowdown`` times as long. It sleeps rather than spinning, so it frees the CPU: seen from the
  other tasks that is what a slower machine or accelerator looks like (it is simply later), and it
  does not steal cycles from them on this 2-core machine. The straggler writes what it did (steps,
  seconds busy, seconds slept) to ``OUT/straggler-worker-1.json``; the table shows each worker's steps.

Accounting (all from the chief's ``OUT/summary.json``; rank 0, never the straggler): wall = the
chief's training wall seconds (``wall_seconds``: from the first step to the end of the final
evaluation and checkpoint; excludes process start, imports and the rendezvous), steps/s = the
chief's steps / wall, samples/s = ``samples_per_second`` = the samples of every worker summed / wall
(with ps-async and a straggler the chief does more steps than the straggler, so samples/s is the
measure that counts both), accuracy = ``eval_accuracy`` on the test split (359 images) at the end.

Rounds are interleaved (``allreduce, ps-sync, ps-async, ps-sync+straggler, ps-async+straggler``, then
reversed, ...) so that the machine's drift (1.5-2x over minutes here) hits every contender alike and
the straggler pair always runs back to back; the table reports the median per contender over rounds
and the JSON keeps every sample. A failing job is reported (``errors``) and leaves a gap, not a crash.

Goals (straggler runs, same run, ratios of medians): ps-async samples/s >= 1.5 x ps-sync samples/s, and
|ps-async accuracy - ps-sync accuracy| <= 0.02. (With one worker at half speed, lockstep training runs at
the straggler's pace, 2 x B / 2t, while async adds both paces, B / t + B / 2t: 1.5 x is what perfect
overlap gives if the fast worker gains nothing from the CPU the sleeping one frees.) Output: an aligned
table and PASS/FAIL lines on stdout; JSON (machine, config, samples, the summary figures used, derived
values, goals) in ``<out>/ps_training-<timestamp>.json`` and ``<out>/ps_training-latest.json`` (default
``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by file path
import harness as h  # noqa: E402
from machine import write_results  # noqa: E402

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
EXAMPLE = ROOT / "examples" / "digits" / "train.py"
CONTENDERS = ("allreduce", "ps-sync", "ps-async", "ps-sync+straggler", "ps-async+straggler")  # odd rounds reversed
STRAGGLER_RANK = 1
STRAGGLER_FILE = f"straggler-worker-{STRAGGLER_RANK}.json"
GOALS = (
    h.Goal("straggler (worker 1 2x slower): ps-async samples/s >= 1.5 x ps-sync samples/s (same run)",
           "straggler_async_vs_sync_samples_per_second", 1.5, ">="),
    h.Goal("straggler: |ps-async test accuracy - ps-sync test accuracy| <= 0.02 (same epochs, lr, seed)",
           "straggler_accuracy_gap", 0.02, "<="),
)
WORKERS = 2
PS_TASKS = 1
METRICS = ("steps_per_second", "samples_per_second", "wall_seconds", "eval_accuracy")


# ==================================================================================================
# Training side: this file run by `conveyor run` as the job's script (`--train JSON`).
# ==================================================================================================


def _load_example():
    """examples/digits/train.py as a module (it is a script, not a package module)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("conveyor_example_digits", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Straggler:
    """Trainer callback: after each step, sleep so that the step's non-input time takes `factor` x as long."""

    def __init__(self, factor: float):
        self.factor = factor
        self.steps = 0
        self.busy_seconds = 0.0  # the steps' own time, without input wait
        self.slept_seconds = 0.0

    def __call__(self, event) -> None:
        busy = max(0.0, event.times.total - event.times.input_wait)
        pause = (self.factor - 1.0) * busy
        self.steps += 1
        self.busy_seconds += busy
        self.slept_seconds += pause
        if pause > 0:
            time.sleep(pause)


def train(config: dict[str, Any]) -> None:
    """What examples/digits/train.py's main() does, with its settings from `config` and an optional straggler."""
    import glob

    import torch
    from torch import nn

    import conveyor

    digits = _load_example()
    job = conveyor.init()
    folder = str(job.data_dir / "digits")
    if job.is_chief and not glob.glob(os.path.join(folder, "train-*.tfrecord")):
        print(f"writing the digits as TFRecord shards to {folder}", flush=True)
        digits.write_tfrecords(folder)
    job.barrier()  # the other workers wait for the files

    torch.manual_seed(config["seed"])
    model = digits.Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    model, optimizer = job.prepare(model, optimizer)

    straggler = Straggler(config["slowdown"]) if config["straggler"] and job.rank == STRAGGLER_RANK else None
    trainer = conveyor.Trainer(
        job, model, optimizer, nn.functional.cross_entropy,
        digits.pipeline(folder, "train", job, config["batch_size"], training=True),
        eval_data=digits.pipeline(folder, "test", job, 256, training=False),
        epochs=config["epochs"], checkpoint_every_steps=config["checkpoint_every"], log_every_steps=5,
        callbacks=[straggler] if straggler else [],
    )
    summary = trainer.fit()
    if straggler is not None:
        Path(job.output_dir, STRAGGLER_FILE).write_text(json.dumps({
            "rank": job.rank, "factor": straggler.factor, "steps": straggler.steps,
            "busy_seconds": straggler.busy_seconds, "slept_seconds": straggler.slept_seconds}))
    if job.is_chief:
        print(f"test accuracy {summary['eval_accuracy']:.4f}, {summary['samples_per_second']:.0f} samples/s",
              flush=True)
    job.shutdown()


# ==================================================================================================
# Driver side.
# ==================================================================================================


def job_command(contender: str, settings: dict[str, Any], data_dir: Path, out_dir: Path) -> list[str]:
    strategy, _, variant = contender.partition("+")
    ps = [] if strategy == "allreduce" else ["--ps", str(PS_TASKS)]
    config = {key: settings[key] for key in ("epochs", "lr", "batch_size", "seed", "slowdown", "checkpoint_every")}
    config["straggler"] = variant == "straggler"
    return [sys.executable, "-m", "conveyor.cli.main", "run", "-n", str(WORKERS), *ps, "--strategy", strategy,
            "--max-restarts", "0", "--data-dir", str(data_dir), "--output-dir", str(out_dir), str(HERE),
            "--train", json.dumps(config, separators=(",", ":"))]


def _communication(comm: dict[str, Any] | None) -> dict[str, Any] | None:
    if not comm:
        return None
    return {k: comm.get(k) for k in ("push_seconds", "pull_seconds", "wait_seconds", "staleness", "max_staleness")}


def run_job(contender: str, settings: dict[str, Any], data_dir: Path, out_dir: Path,
            timeout: float) -> dict[str, Any]:
    """One `conveyor run` job; the figures of its summary.json (``{"error": ...}`` on failure)."""
    cmd = job_command(contender, settings, data_dir, out_dir)
    started = time.perf_counter()
    code, output = h.run_launcher(cmd, timeout, cwd=ROOT)
    if code is None:
        return {"error": f"timed out after {timeout:.0f} s: {output.strip()[-600:]}"}
    launcher_seconds = time.perf_counter() - started
    summary_path = out_dir / "summary.json"
    if code or not summary_path.exists():
        return {"error": f"conveyor run exited {code}"
                         f"{'' if summary_path.exists() else ', no summary.json'}: {output.strip()[-800:]}"}
    s = json.loads(summary_path.read_text())
    wall = float(s["wall_seconds"])
    run = {
        "strategy": s["strategy"], "world_size": s["world_size"], "steps": s["steps"], "samples": s["samples"],
        "samples_per_second": s["samples_per_second"], "wall_seconds": wall,
        "steps_per_second": s["steps"] / wall if wall > 0 else math.nan,
        "eval_accuracy": s.get("eval_accuracy"), "eval_loss": s.get("eval_loss"),
        "step_breakdown": s.get("step_breakdown"), "communication": _communication(s.get("communication")),
        "launcher_seconds": launcher_seconds,
    }
    straggler_path = out_dir / STRAGGLER_FILE
    if straggler_path.exists():
        run["straggler"] = json.loads(straggler_path.read_text())
    elif contender.endswith("+straggler"):
        return {"error": f"the straggler wrote no {STRAGGLER_FILE}", "summary": run}
    if s["strategy"] != contender.partition("+")[0] or s["world_size"] != WORKERS:
        return {"error": f"summary.json says strategy {s['strategy']!r}, world size {s['world_size']}", "summary": run}
    return run


def run_rounds(contenders: Sequence[str], settings: dict[str, Any], repeats: int, timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="conveyor-bench-ps-training-") as tmp:
        data_dir = Path(tmp) / "data"  # shared: the first job writes the TFRecord shards
        jobs = iter(range(1, 1 << 30))

        def measure(c: str, rnd: int) -> tuple[dict[str, float], dict[str, Any]]:
            res = run_job(c, settings, data_dir, Path(tmp) / f"out-{next(jobs)}-{c}", timeout)
            if "error" in res:
                raise h.ContenderFailed(res["error"], res)
            return {m: res[m] for m in METRICS}, res

        def describe(value: dict[str, float], res: dict[str, Any]) -> str:
            return (f"{res['steps_per_second']:.1f} steps/s, {res['samples_per_second']:.0f} samples/s, "
                    f"accuracy {res['eval_accuracy']:.4f}")

        res = h.interleaved_rounds(contenders, repeats, measure, describe=describe)
    # Per contender, per metric, the rounds' values (None where the job failed).
    res["samples"] = {c: {m: [v[m] if isinstance(v, dict) else None for v in res["samples"][c]] for m in METRICS}
                      for c in contenders}
    return res


def _worker_steps(run: dict[str, Any], batch_size: int) -> list[int] | None:
    """[chief's steps, the other worker's steps] (samples / batch - the chief's; batches are full)."""
    if "error" in run:
        return None
    return [run["steps"], run["samples"] // batch_size - run["steps"]]


def derive(res: dict[str, Any], contenders: Sequence[str], batch_size: int) -> dict[str, Any]:
    s = res["samples"]
    med = {m: {c: h.median(s[c][m]) for c in contenders} for m in METRICS}
    d: dict[str, Any] = {f"median_{m}": med[m] for m in METRICS}
    d["worker_steps"] = {c: [_worker_steps(run, batch_size) for run in res["runs"][c]] for c in contenders}
    sync, asyn = "ps-sync+straggler", "ps-async+straggler"
    have = sync in contenders and asyn in contenders
    d["straggler_async_vs_sync_samples_per_second"] = (
        h.ratio(med["samples_per_second"][asyn], med["samples_per_second"][sync]) if have else math.nan)
    d["straggler_accuracy_gap"] = (
        h.gap(med["eval_accuracy"][asyn], med["eval_accuracy"][sync]) if have else math.nan)
    d["paired_per_round"] = {
        "straggler_async_vs_sync_samples_per_second":
            h.paired(s[asyn]["samples_per_second"], s[sync]["samples_per_second"]) if have else [],
        "straggler_accuracy_gap":
            h.paired(s[asyn]["eval_accuracy"], s[sync]["eval_accuracy"], op=h.gap) if have else [],
    }
    d["paired_median"] = {k: h.median(v) for k, v in d["paired_per_round"].items()}
    base = "allreduce" if "allreduce" in contenders else None
    d["steps_per_second_vs_allreduce"] = {
        c: h.ratio(med["steps_per_second"][c], med["steps_per_second"][base]) if base else math.nan
        for c in contenders if "+" not in c}
    # What the straggler runs cost against the same strategy without one (same run, ratio of medians).
    d["straggler_vs_unslowed_samples_per_second"] = {
        c: h.ratio(med["samples_per_second"][c], med["samples_per_second"][c.partition("+")[0]])
        for c in contenders if "+" in c and c.partition("+")[0] in contenders}
    return d


def format_table(res: dict[str, Any], d: dict[str, Any], contenders: Sequence[str], settings: dict[str, Any],
                 repeats: int) -> str:
    head = (f"digits, {WORKERS} workers (+{PS_TASKS} ps task for ps-*), {settings['epochs']} epoch(s), batch "
            f"{settings['batch_size']}/worker, lr {settings['lr']}, seed {settings['seed']}, straggler = worker "
            f"{STRAGGLER_RANK} {settings['slowdown']:g}x slower; {repeats} round(s), 1 thread/process\n"
            f"steps/s = chief's steps / chief wall s; samples/s = all workers' samples / chief wall s; "
            f"medians over rounds")
    rows = [("contender", "steps/s", "samples/s", "wall s", "accuracy", "worker steps", "samples/s per round",
             "accuracy per round")]
    for c in contenders:
        s = res["samples"][c]
        steps = "/".join("-" if w is None else f"{w[0]}+{w[1]}" for w in d["worker_steps"][c])
        rows.append((c, h.fmt(d["median_steps_per_second"][c], ".1f"), h.fmt(d["median_samples_per_second"][c], ".0f"),
                     h.fmt(d["median_wall_seconds"][c], ".2f"), h.fmt(d["median_eval_accuracy"][c], ".4f"), steps,
                     h.fmt_all(s["samples_per_second"], ".0f"), h.fmt_all(s["eval_accuracy"], ".4f")))
    lines = [head, "", h.format_rows(rows, left=(0, 5, 6, 7))]
    lines.append("(worker steps: chief + other worker, per round)")
    lines.append("")
    vs = d["steps_per_second_vs_allreduce"]
    if "allreduce" in contenders:
        lines.append("steps/s vs allreduce: " + ", ".join(f"{c} {h.fmt(v, '.3f')}" for c, v in vs.items()
                                                         if c != "allreduce"))
    for c, v in d["straggler_vs_unslowed_samples_per_second"].items():
        lines.append(f"{c} samples/s / {c.partition('+')[0]} samples/s  {h.fmt(v, '.3f')}")
    pr, pm = d["paired_per_round"], d["paired_median"]
    key = "straggler_async_vs_sync_samples_per_second"
    lines += [
        f"straggler: ps-async / ps-sync samples/s   {h.fmt(d[key], '.3f')}  (ratio of medians; paired per round: "
        f"{h.fmt_all(pr[key], '.3f')}, their median {h.fmt(pm[key], '.3f')})",
        f"straggler: |ps-async - ps-sync| accuracy  {h.fmt(d['straggler_accuracy_gap'], '.4f')}  (of medians; "
        f"per round: {h.fmt_all(pr['straggler_accuracy_gap'], '.4f')}, their median "
        f"{h.fmt(pm['straggler_accuracy_gap'], '.4f')})",
    ]
    return "\n".join(lines)


def goals(d: dict[str, Any]) -> list[dict[str, Any]]:
    return h.evaluate_goals(GOALS, d)


def write_json(report: dict[str, Any], out_dir: Path) -> Path:
    return write_results("ps_training", report, out_dir)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = h.parser(__doc__, "1 round, 1 epoch")
    p.add_argument("--epochs", type=int, default=None, help="epochs per job, every contender (default 8; --quick 1)")
    p.add_argument("--lr", type=float, default=0.02, help="SGD learning rate, every contender (default 0.02)")
    p.add_argument("--batch-size", type=int, default=32, help="per worker (default 32)")
    p.add_argument("--seed", type=int, default=0, help="torch seed of the model (default 0)")
    p.add_argument("--slowdown", type=float, default=2.0, help="the straggler's step time factor (default 2)")
    p.add_argument("--contenders", type=h.contender_names(CONTENDERS), default=CONTENDERS,
                   help=f"comma-separated subset of {','.join(CONTENDERS)} (default all)")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds per job (default 180)")
    p.add_argument("--train", metavar="JSON", help=argparse.SUPPRESS)
    args = h.settle(p, p.parse_args(argv), {"repeats": (3, 1), "epochs": (8, 1)},
                    positive=("repeats", "epochs", "lr", "batch_size", "timeout"))
    if not args.slowdown >= 1:
        p.error("--slowdown must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.train is not None:
        train(json.loads(args.train))
        return 0
    started = time.perf_counter()
    settings = {"epochs": args.epochs, "lr": args.lr, "batch_size": args.batch_size, "seed": args.seed,
                "slowdown": args.slowdown, "checkpoint_every": 50}
    machine = h.machine_start(("torch", "pyzmq"))
    print(f"{len(args.contenders)} contender(s) x {args.repeats} round(s), {args.epochs} epoch(s) each, "
          f"{machine['cores']} cores")
    res = run_rounds(args.contenders, settings, args.repeats, args.timeout)
    d = derive(res, args.contenders, args.batch_size)
    gs = goals(d)
    table = format_table(res, d, args.contenders, settings, args.repeats)
    report = {
        "benchmark": "ps_training", "command": h.command_line("ps_training", argv), "machine": h.machine_end(machine),
        "config": {**settings, "repeats": args.repeats, "quick": args.quick, "timeout": args.timeout,
                   "workers": WORKERS, "ps_tasks": PS_TASKS, "straggler_rank": STRAGGLER_RANK,
                   "threads_per_process": 1, "contenders": list(args.contenders), "order": res["order"],
                   "script": "examples/digits/train.py's Net, pipeline and Trainer, run by benchmarks/ps_training.py "
                             "--train under `conveyor run -n 2 [--ps 1] --strategy S --max-restarts 0`",
                   "straggler": "after each step rank 1 sleeps (slowdown - 1) x (step total - input wait)",
                   "units": {"steps_per_second": "chief's steps / chief's wall_seconds",
                             "samples_per_second": "all workers' samples / chief's wall_seconds",
                             "wall_seconds": "chief's training wall seconds (summary.json)",
                             "eval_accuracy": "test-split accuracy at the end (summary.json)"}},
    }
    h.publish_run("ps_training", report, res, d, gs, table, started, h.format_goals(gs), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
