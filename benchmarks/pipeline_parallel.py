"""Pipeline-parallel benchmark: conveyor's pipeline strategy against one process, two free halves and a bare loop.

    python benchmarks/pipeline_parallel.py                 # 2048 x 64 MLP + Adam, 2 rounds, ~12 min on 2 cores
    python benchmarks/pipeline_parallel.py --quick         # tiny MLP, M = 16 only, 1 round (a test runs it, ~20 s)
    python benchmarks/pipeline_parallel.py --repeats 3 --steps 8 --four-stages --out /tmp/bench-results
    python benchmarks/pipeline_parallel.py --device cuda   # on a host with >= 2 GPUs: one process per GPU, NCCL

Workload: an ``nn.Sequential`` of ``--depth`` blocks, each ``Linear(W, W)`` + ReLU (the last a plain
Linear), W = ``--width``; MSE against a fixed random target; ``Adam(lr=1e-4, fused=True)``. Default W
2048, depth 64: 269M parameters, whose parameters, gradients and Adam's two moments take 4.3 GB in one
process — big enough that the ~220 MB every process pays for importing torch (and ~75 MB more for
``torch.distributed.pipelining``) does not decide the memory ratio, as it did at 67M (0.70). One fixed
batch of ``--batch`` rows (default 256, divisible by every M). Every process runs one intra-op thread
(``OMP_NUM_THREADS=MKL_NUM_THREADS=1`` and ``torch.set_num_threads(1)``). Adam is the fused kernel
because the default one makes ~10 passes over memory per parameter and, with two processes at once,
its time varied 2-4x with what the other process was doing, which drowned the pipelines' comparison.

Contenders, each a fresh set of processes started by this script (settings as a JSON argument, results
as JSON files), all doing ``--warmup`` untimed steps then ``--steps`` timed ones; samples/s = batch x
steps / the timed wall time (2 processes: between two barriers, on rank 0). Every one builds the whole
model (seed 0), as a user's script does; the 2-process ones keep their half (cut before block D/2):

- ``one_process``: the whole model in one process (``zero_grad``, forward, loss, backward, ``step``).
- ``two_halves``: 2 processes, each training its half alone on the whole batch at once (the second
  half's input needs its gradient, as a pipeline's later stage computes it): the same work as
  one_process with nothing crossing, no microbatches and no bubble. Its rate over 2 x one_process is
  how fast two processes run at once on this machine, the ceiling of any 2-process pipeline.
- ``bare_pipelining``: 2 processes, ``dist.init_process_group("gloo", init_method="tcp://127.0.0.1:P")``,
  a static ``PipelineStage`` (example tensors for one microbatch) and ``Schedule1F1B(stage, M,
  loss_fn, scale_grads=True)``; a step is ``zero_grad``, ``schedule.step(...)``, ``optimizer.step()`` —
  the loop torch's documentation shows.
- ``conveyor_pipeline``: 2 processes with the environment ``conveyor run -n 2 --strategy pipeline
  --stages 2 --microbatches M --schedule 1f1b --split D/2`` gives them (the launcher's ``local_plan``),
  ``conveyor.init()``, ``job.prepare(model, optimizer)``, ``job.train_step(...)``.

The throughput rounds use M = ``--microbatches`` (default 2: microbatches of 128 rows; on one CPU
thread a 2048-wide Linear with fewer rows is bound by reading its weights and adding each microbatch's
weight gradient into ``.grad``, so smaller microbatches cost more per sample — the sweep's samples/s
column shows it) and are interleaved (order reversed every other round); medians and per-round paired
ratios are reported. The ideal is S (1 - (S-1)/(M+S-1)) x one_process.

conveyor against the bare loop is also measured **paired** (``--paired-steps``, default 8): both in one pair
of processes started as ``conveyor run`` starts them — conveyor's stage through ``job.prepare``, and a second
copy of the model's half under a bare ``PipelineStage`` + ``Schedule1F1B`` on the default group — one step
of each in turn (order alternating), a barrier after every step, rank 0 timing each. Separate runs of the two
differed by up to 10 % per round here from the machine alone (other processes, one core slower than the
other for a while), which the paired steps share; the throughput goal is judged on them.

Measured besides (all from inside the processes):

- **Memory**: each process's resident set from ``/proc/self/status`` (VmRSS at phases: after the imports,
  with the whole model built, after the cut; VmHWM for the peaks of set-up and of training, the peak
  reset in between through ``/proc/self/clear_refs``). Not ``getrusage(...).ru_maxrss``, which Linux
  carries over ``execve``: a child started by a large parent reported the parent's peak as its own.
  one_process is "1 stage", the largest conveyor_pipeline process "2 stages" (and a 4-stage conveyor
  run with ``--four-stages``, or when the machine has >= 4 cores).
- **Bubble**: conveyor runs for M in ``--sweep`` (default 2, 4, 8, 16) x (gpipe, 1f1b); after the
  warm-up the stage runner's counters are zeroed, so conveyor's own ``report()`` figures cover the
  timed steps only: per stage its compute (forward, loss, backward chunks) and its idle share of the
  window every stage shares, from the latest stage's schedule start to the latest one's end (see
  docs/strategies.md, Pipeline parallelism, for why that window and not each stage's schedule call),
  next to (S-1)/(M+S-1). That theory assumes equal stages; each row also shows the theory with the
  run's measured stage costs, (M-1) c_max + sum(c) for the window, so a gap from one process computing
  slower than the other (on a shared machine, other processes' load lands unevenly) is told apart
  from what the pipeline adds. Waiting for a stage that started the step late is shown apart.
- **Activation memory of stage 0**, in the same sweep runs: one more step under
  ``torch.autograd.graph.saved_tensors_hooks`` counts the bytes autograd holds for backward (each
  saved tensor once, the stage's parameters excluded), live from pack until the graph frees them. Its peak, in
  units of one microbatch's saved bytes (the step's total / M), is how many microbatches' activations
  the stage holds at once: the quantity 1F1B bounds by S and GPipe does not. Chosen over RSS growth
  because CPU RSS includes allocator caching and Adam's temporaries, and torch tracks no CPU memory.

``--device cuda`` runs every process on its own GPU (rank r on ``cuda:r``; one_process on ``cuda:0``), the
2-process groups on NCCL, and compares peak GPU memory (``torch.cuda.max_memory_allocated``, reset when set-up
ends) beside the RSS. It needs 2 GPUs (4 for the 4-stage run): NCCL refuses two ranks on one GPU, so stages
cannot share one. With fewer the run is skipped and its JSON says why. Without ``--device cuda`` the processes
see no GPU (``CUDA_VISIBLE_DEVICES=""``), so the CPU figures mean the same on a GPU host.

Output: aligned tables and PASS/FAIL goal lines on stdout; JSON (machine incl. load average, config,
every sample, derived values, goals) in ``<out>/pipeline_parallel-<timestamp>.json`` and
``<out>/pipeline_parallel-latest.json`` (default ``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import json
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
import harness as h  # noqa: E402
from machine import write_results  # noqa: E402
from pipeline_parallel_report import (  # noqa: E402, F401
    CONTENDERS,
    CONTENDERS_SPEC,
    SCHEDULES,
    derive,
    format_table,
    theory,
)
from pipeline_parallel_worker import STAGES, saved_activations, worker  # noqa: E402, F401

NAME = "pipeline_parallel"
HERE = Path(__file__).resolve()
GOALS = (
    h.Goal("memory: largest process with 2 stages / one-process peak RSS", "memory_ratio_2", 0.6, "<="),
    h.Goal("bubble: max |measured - (S-1)/(M+S-1)| over stages, schedules, M >= 4", "bubble_max_gap", 0.05, "<="),
    h.Goal("throughput: conveyor_pipeline / bare_pipelining, step by step in the same 2 processes",
           "conveyor_vs_bare_paired", 0.97),
    h.Goal("throughput: conveyor_pipeline / (S x (1 - bubble) x one_process)", "conveyor_vs_ideal", 0.85),
    h.Goal("activations: 1F1B stage 0 at the largest M, microbatches held (about S)", "act_1f1b", 1.25 * STAGES,
           "<="),
    h.Goal("activations: GPipe stage 0 at the largest M, microbatches held / M (about 1)", "act_gpipe_share", 0.9),
)


# ==================================================================================================
# Parent side: starts the runs, collects, reports.
# ==================================================================================================


def _base_env(device: str) -> dict[str, str]:
    from conveyor.launch import OWNED_VARS

    env = {k: v for k, v in os.environ.items() if k not in OWNED_VARS and not k.startswith("CONVEYOR_")}
    env |= {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return env if device == "cuda" else env | {"CUDA_VISIBLE_DEVICES": ""}


def _launches(config: dict[str, Any], workdir: Path) -> list[tuple[list[str], dict[str, str]]]:
    """(argv, env) of each process of the run `config` describes."""
    from conveyor.launch import RunOptions, free_ports, local_plan

    env, kind = _base_env(config.get("device", "cpu")), config["contender"]
    if kind == "one_process":
        return [([sys.executable, str(HERE), "--worker", json.dumps(config)], env)]
    if kind in ("two_halves", "bare_pipelining"):
        port = free_ports(1)[0]
        return [([sys.executable, str(HERE), "--worker", json.dumps({**config, "rank": r, "port": port})], env)
                for r in range(STAGES)]
    stages = config["stages"]
    options = RunOptions(script=str(HERE), script_args=("--worker", json.dumps(config)), workers=stages,
                         strategy="pipeline", stages=stages, microbatches=config["microbatches"],
                         schedule=config["schedule"], split=str(config["split"]) if stages == 2 else None,
                         data_dir=str(workdir / "data"), output_dir=str(workdir / "output"), python=sys.executable)
    ports = free_ports(stages + 1)  # as `conveyor run`: one per task, one for torch's store
    plan = local_plan(options, ports[:-1], master_port=ports[-1], secret=secrets.token_bytes(32), environ=env)
    return [(list(t.argv), dict(t.env)) for t in plan.tasks]


def _tail(path: Path, lines: int = 6) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(text[-lines:]) or "(empty log)"


def run_processes(config: dict[str, Any], workdir: Path, timeout: float) -> list[dict[str, Any]]:
    """Start the run's processes, wait for them (killing our own on failure), return every rank's result."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = {**config, "result_dir": str(workdir)}
    procs: list[tuple[subprocess.Popen, Path]] = []
    failed = None
    try:
        for r, (argv, env) in enumerate(_launches(config, workdir)):
            log = workdir / f"rank{r}.log"
            with open(log, "wb") as f:
                procs.append((subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL, cwd=str(workdir)), log))
        deadline = time.monotonic() + timeout
        for proc, log in procs:
            try:
                code = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                failed = f"timed out after {timeout:.0f} s"
                break
            if code != 0:
                failed = f"{log.stem} exited with code {code}: {_tail(log)}"
                break
    finally:
        for proc, _ in procs:  # only our own children, by handle
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if failed:
        raise h.ContenderFailed(failed)
    paths = [workdir / f"rank{r}.json" for r in range(len(procs))]
    missing = [p.name for p in paths if not p.exists()]
    if missing:
        raise h.ContenderFailed(f"no result from {', '.join(missing)}")
    return [json.loads(p.read_text()) for p in paths]


def summarize(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """A run as kept in the JSON: rank 0's rate and step time, every rank's peak RSS."""
    head = ranks[0]
    keep = {k: head[k] for k in ("samples_per_s", "wall_s", "step_ms", "step_ms_median") if k in head}
    keep["peak_rss_mb"] = [r["peak_rss_mb"] for r in ranks]
    if all("peak_gpu_mb" in r for r in ranks):
        keep["peak_gpu_mb"] = [r["peak_gpu_mb"] for r in ranks]
    keep["memory"] = [{k: r.get(k) for k in ("setup_peak_rss_mb", "train_peak_rss_mb", "rss_mb", "peak_reset")}
                      for r in ranks]
    keep["threads"] = [r["threads"] for r in ranks]
    for key in ("figures", "activations"):
        found = [r[key] for r in ranks if key in r and r.get("stage", 0) == 0]
        if found:
            keep[key] = found[0]
    return keep


def run_rounds(config: dict[str, Any], repeats: int, timeout: float, tmp: Path,
               contenders: Sequence[str] = CONTENDERS) -> dict[str, Any]:
    """Interleaved throughput rounds (1F1B, M = --microbatches) with every process's peak RSS."""

    def measure(c: str, rnd: int) -> tuple[float, dict[str, Any]]:
        cfg = {**config, "contender": c, "stages": STAGES, "schedule": "1f1b", "activations": True}
        run = summarize(run_processes(cfg, tmp / f"r{rnd}-{c}", timeout))
        return run["samples_per_s"], run

    def describe(sps: float, run: dict[str, Any]) -> str:
        rss = ", ".join(f"{x:.0f}" for x in run["peak_rss_mb"])
        return f"{sps:8.1f} samples/s  (step {run['step_ms_median']:.0f} ms, peak RSS {rss} MB)"

    return h.interleaved_rounds(contenders, repeats, measure, describe=describe)


def run_sweep(config: dict[str, Any], sweep: Sequence[int], timeout: float, tmp: Path,
              done: dict[str, Any] | None = None) -> dict[str, Any]:
    """conveyor for every (schedule, M): its own per-stage figures and stage 0's saved activations.
    `done`: runs already made ({"1f1b/8": run}: the throughput rounds' last conveyor run), not repeated."""
    out: dict[str, Any] = {}
    for schedule in SCHEDULES:
        for m in sweep:
            key = f"{schedule}/{m}"
            if done and key in done:
                out[key] = {**done[key], "from": "throughput rounds"}
                continue
            cfg = {**config, "contender": "conveyor_pipeline", "stages": STAGES, "schedule": schedule,
                   "microbatches": m, "activations": True}
            try:
                out[key] = summarize(run_processes(cfg, tmp / f"sweep-{schedule}-{m}", timeout))
                fig = out[key]["figures"]
                shown = " ".join(h.fmt(s["bubble_fraction"], ".3f") for s in fig["per_stage"])
                print(f"  sweep {key:<8} bubble per stage {shown} (theory {fig['theoretical_bubble_fraction']:.3f}), "
                      f"stage 0 holds {h.fmt(out[key]['activations']['peak_microbatches'], '.2f')} microbatches")
            except h.ContenderFailed as e:
                out[key] = {"error": str(e)}
                print(f"  sweep {key:<8} FAILED: {e}")
    return out


def run_paired_steps(config: dict[str, Any], steps: int, timeout: float, tmp: Path) -> dict[str, Any]:
    """conveyor against the bare loop step by step in the same processes (run_paired): rank 0's step times,
    each pair's bare / conveyor time, and the ratio of their sums (conveyor's throughput / bare's)."""
    cfg = {**config, "contender": "paired", "stages": STAGES, "schedule": "1f1b", "steps": steps}
    try:
        seconds = run_processes(cfg, tmp / "paired", timeout)[0]["paired_seconds"]
    except h.ContenderFailed as e:
        print(f"  paired steps FAILED: {e}")
        return {"error": str(e)}
    ratio = sum(seconds["bare"]) / sum(seconds["conveyor"])
    per_pair = [b / c for c, b in zip(seconds["conveyor"], seconds["bare"], strict=True)]
    print(f"  paired steps: conveyor / bare throughput {ratio:.3f} over {steps} pairs "
          f"(per pair {' '.join(f'{r:.3f}' for r in per_pair)})")
    return {"steps": steps, "seconds": seconds, "per_pair": per_pair, "conveyor_vs_bare": ratio}


def run_four_stages(config: dict[str, Any], timeout: float, tmp: Path) -> dict[str, Any]:
    cfg = {**config, "contender": "conveyor_pipeline", "stages": 4, "schedule": "1f1b",
           "microbatches": max(config["microbatches"], 4)}
    try:
        return summarize(run_processes(cfg, tmp / "four-stages", timeout))
    except h.ContenderFailed as e:
        return {"error": str(e)}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = h.parser(__doc__, "tiny MLP (256 wide, 4 blocks), batch 32, M 16 only, 1 round, 2 steps")
    p.add_argument("--width", type=int, default=None, help="Linear width (default 2048; --quick 256)")
    p.add_argument("--depth", type=int, default=None, help="blocks (default 64; --quick 4)")
    p.add_argument("--batch", type=int, default=None, help="rows per step (default 256; --quick 32)")
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps (default 6; --quick 2): with 3, one core running a few %% slower than the "
                   "other for a few seconds decided the bubble's gap to theory")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 1; --quick 1)")
    p.add_argument("--microbatches", type=int, default=None, help="M of the throughput rounds (default 2; --quick 16)")
    p.add_argument("--sweep", type=lambda t: tuple(int(x) for x in t.split(",")), default=None,
                   help="M of the bubble sweep, comma-separated (default 2,4,8,16; --quick 16)")
    p.add_argument("--paired-steps", type=int, default=None,
                   help="steps of each in the paired conveyor/bare run (default 8; --quick 2; 0: not run)")
    p.add_argument("--four-stages", action="store_true", help="also a 4-stage run (memory), even on < 4 cores")
    p.add_argument("--timeout", type=float, default=None, help="seconds per run before it is stopped (default 900)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu (default; the processes see no GPU) or cuda: one GPU per process, NCCL (needs 2 GPUs)")
    p.add_argument("--contenders", type=h.contender_names(CONTENDERS), default=CONTENDERS,
                   help=f"comma-separated subset of {','.join(CONTENDERS)}")
    p.add_argument("--worker", metavar="JSON", help=argparse.SUPPRESS)
    args = h.settle(p, p.parse_args(argv), {"width": (2048, 256), "depth": (64, 4), "batch": (256, 32),
                                            "steps": (6, 2), "warmup": (1, 1), "microbatches": (2, 16),
                                            "sweep": ((2, 4, 8, 16), (16,)), "repeats": (2, 1), "timeout": (900, 120),
                                            "paired_steps": (8, 2)},
                    positive=("width", "depth", "batch", "steps", "microbatches", "repeats", "timeout"),
                    non_negative=("warmup", "paired_steps"))
    for m in (args.microbatches, *args.sweep):
        if m < 1 or args.batch % m:
            p.error(f"--batch {args.batch} must be divisible by every M (got M = {m})")
    if args.depth < 2 * STAGES:
        p.error(f"--depth {args.depth}: at least {2 * STAGES} blocks for the 4-stage run")
    args.contenders = list(args.contenders)
    return args


def cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        worker(json.loads(args.worker))
        return 0
    started = time.perf_counter()
    params = args.depth * (args.width * args.width + args.width)
    config = {"width": args.width, "depth": args.depth, "batch": args.batch, "steps": args.steps,
              "warmup": args.warmup, "microbatches": args.microbatches, "split": args.depth // 2,
              "params": params, "state_mb": 16 * params / 1e6, "device": args.device}
    machine = h.machine_start(("torch",))
    gpus = cuda_devices() if args.device == "cuda" else 0
    if args.device == "cuda" and gpus < STAGES:
        reason = (f"--device cuda needs {STAGES} GPUs (one process per GPU: NCCL refuses two ranks on one GPU); "
                  f"this machine has {gpus}")
        print(f"skipped: {reason}")
        report = {"benchmark": NAME, "command": h.command_line(NAME, argv), "machine": h.machine_end(machine),
                  "config": config, "skipped": reason}
        path = write_results(NAME, report, args.out)
        print(f"JSON: {path}")
        return 0
    four_wanted = (args.four_stages or machine["cores"] >= 4) and (args.device == "cpu" or gpus >= 4)
    print(f"MLP {args.depth} x {args.width}: {params:,} params ({config['state_mb']:.0f} MB with grads and Adam), "
          f"batch {args.batch}, {args.repeats} round(s), {machine['cores']} cores, load {machine['loadavg_start']}")
    with tempfile.TemporaryDirectory(prefix="conveyor-pipeline-bench-") as tmp:
        res = run_rounds(config, args.repeats, args.timeout, Path(tmp), args.contenders)
        paired = run_paired_steps(config, args.paired_steps, args.timeout, Path(tmp)) if args.paired_steps else None
        last = [r for r in res["runs"].get("conveyor_pipeline", []) if r is not None and "figures" in r]
        sweep = run_sweep(config, args.sweep, args.timeout, Path(tmp),
                          {f"1f1b/{args.microbatches}": last[-1]} if last else None)
        four = run_four_stages(config, args.timeout, Path(tmp)) if four_wanted else None
    d = derive(res, sweep, four, args.microbatches, paired)
    gs = h.evaluate_goals(GOALS, d)
    table = format_table(res, d, config, args.repeats)
    report = {
        "benchmark": NAME, "command": h.command_line(NAME, argv), "machine": h.machine_end(machine),
        "config": {**config, "repeats": args.repeats, "quick": args.quick, "sweep": list(args.sweep),
                   "timeout": args.timeout, "threads_per_process": 1, "optimizer": "Adam(lr=1e-4, fused=True)",
                   "stages": STAGES, "schedule_throughput": "1f1b", "four_stages": four_wanted,
                   "contenders": {c.name: c.label for c in CONTENDERS_SPEC}, "order": res["order"],
                   "activation_method": "saved_tensors_hooks: live saved bytes (each tensor once, "
                                        "parameters excluded), peak / (step total / M)"},
        "sweep": sweep, "four_stages": four, "paired": paired,
    }
    h.publish_run(NAME, report, res, d, gs, table, started, h.format_goals(gs), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
