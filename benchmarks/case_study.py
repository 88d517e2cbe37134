"""The CIFAR-10 case study's figures: input-pipeline scaling, all-reduce scaling, and strategies side by side.

    python benchmarks/case_study.py                          # every part, workers 1..cores (1,2 here), 3 rounds
    python benchmarks/case_study.py --workers 1,2,4,8,16      # on a 16-core host
    python benchmarks/case_study.py --quick                   # smoke run: tiny data, model and step counts
    python benchmarks/case_study.py --parts input --repeats 5 --compute-ms 20
    python benchmarks/case_study.py --parts gpu --gpu-cores 1,2,4,8,16   # on a GPU host

Four parts (`--parts`, default all), each a module of its own:

1. `input` (benchmarks/case_study_input.py): samples/s of a job of K worker processes against K, for the
   old approach (one file, sequential map, prefetch 1; with and without sharding the records before the map)
   and the new one (sharded files, list_files + shard, parallel interleave, shuffle, parallel map with
   AUTOTUNE, batch, prefetch), on CIFAR-shaped PNG TFRecords made by conveyor's CIFAR converter from an
   archive in the official format, the accelerator simulated by a fixed sleep per batch.
2. `allreduce` (benchmarks/case_study_scaling.py): speedup and scaling efficiency of
   examples/cifar10/train.py (ResNet-20, --synthetic) under `conveyor run -n K --strategy allreduce`, one
   core per worker, with the reference points 1.7x / 3.5x / 6.2x on 2 / 4 / 8 GPUs on the same axes.
3. `strategies` (benchmarks/case_study_strategies.py): parameter servers against all-reduce, sync against
   async, with a straggler: one table from the JSON of benchmarks/ps_training.py, ps.py and allreduce.py
   (each run here with --quick first when its JSON is missing, unless --no-run-missing).
4. `gpu` (benchmarks/case_study_gpu.py): on a CUDA device, the CIFAR example's ResNet-20 and a ResNet-50 on the
   chexnet-like JPEGs of benchmarks/pipeline.py, fed by conveyor's pipeline and by torch's DataLoader on
   1, 2, 4, ... cores: samples/s, GPU idle fraction, and the cores per GPU each needs to keep the GPU busy.
   Skipped, with the reason in the report, where there is no CUDA device (`--gpu-device cpu`: a smoke run).

Rounds are interleaved (every point of a part once per round, odd rounds reversed); medians over rounds;
ratios are paired within a round. Output: the tables on stdout; `<out>/case_study-<stamp>.json` and
`case_study-latest.json` (machine, config, every sample, derived values, tables), `<out>/input_scaling.png`,
`<out>/allreduce_scaling.png` and `<out>/gpu_feeding.png` (default `<out>` = runs/case_study).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by file path
import case_study_gpu as gpu  # noqa: E402
import case_study_input as inp  # noqa: E402
import case_study_plots as plots  # noqa: E402
import case_study_scaling as scaling  # noqa: E402
import case_study_strategies as strategies  # noqa: E402
import harness as h  # noqa: E402
from machine import cpu_cores, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("input", "allreduce", "strategies", "gpu")
REPORT_KEYS = {"input": "input_pipeline", "allreduce": "allreduce_scaling", "strategies": "strategies",
               "gpu": "gpu_feeding"}
DEFAULT_OUT = ROOT / "runs" / "case_study"
QUICK = ("tiny data (1,024 images), batch 32, 4 timed batches; ResNet-8, batch 8, 3 steps; GPU: 1 core, 3 steps; "
         "1 round")


def worker_counts(text: str) -> tuple[int, ...]:
    try:
        counts = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        counts = []
    if not counts or counts[0] < 1:
        raise argparse.ArgumentTypeError(f"--workers wants positive integers separated by commas, got {text!r}")
    return tuple(counts)


def default_workers(cores: int) -> str:
    """1, 2, 4, ... up to the cores this process may use, and the core count itself."""
    counts = {1, cores}
    k = 2
    while k < cores:
        counts.add(k)
        k *= 2
    return ",".join(str(k) for k in sorted(counts))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = h.parser(__doc__, QUICK)
    p.set_defaults(out=DEFAULT_OUT)
    p._option_string_actions["--out"].help = f"folder for the JSON and the plots (default {DEFAULT_OUT})"
    p.add_argument("--workers", type=worker_counts, default=None,
                   help=f"worker counts, e.g. 1,2,4 (default 1, 2, 4, ... up to the cores: "
                   f"{default_workers(cpu_cores())})")
    p.add_argument("--parts", type=h.contender_names(PARTS), default=PARTS, help=f"subset of {','.join(PARTS)}")
    g = p.add_argument_group("part 1, input pipeline")
    g.add_argument("--contenders", type=h.contender_names(inp.CONTENDERS), default=inp.CONTENDERS,
                   help=f"subset of {','.join(inp.CONTENDERS)} (default all)")
    g.add_argument("--compute-ms", type=float, default=None,
                   help="simulated accelerator time per batch (default: one core's CPU time for a batch's input, "
                   "measured first)")
    g.add_argument("--batch", type=int, default=None, help="images per batch (default 128; --quick 32)")
    g.add_argument("--batches", type=int, default=None, help="timed batches per worker (default 100; --quick 4)")
    g.add_argument("--warmup", type=int, default=None, help="untimed batches per worker first (default 5; --quick 2)")
    g.add_argument("--train-images", type=int, default=None, help="images in the made-up archive (default 10,000)")
    g.add_argument("--shards", type=int, default=None, help="files of the new approach (default max(16, workers))")
    g.add_argument("--data", type=Path, default=None, help="folder for the generated data (default <out>/data)")
    g = p.add_argument_group("part 2, allreduce scaling")
    g.add_argument("--steps", type=int, default=None, help="training steps per job (default 20; --quick 3)")
    g.add_argument("--model-batch", type=int, default=None, help="batch per worker (default 64; --quick 8)")
    g.add_argument("--depth", type=int, default=None, help="ResNet depth 6n+2 (default 20; --quick 8)")
    g.add_argument("--cores-per-worker", type=int, default=1, help="CPUs (and threads) per worker (default 1)")
    g = p.add_argument_group("part 3, strategies table")
    g.add_argument("--results", type=Path, default=h.RESULTS_DIR,
                   help=f"the benchmarks' JSON (default {h.RESULTS_DIR})")
    g.add_argument("--run-missing", action=argparse.BooleanOptionalAction, default=True,
                   help="run a benchmark whose JSON is missing with --quick first (default yes)")
    gpu.add_arguments(p, default_workers(cpu_cores()), worker_counts)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per job (default 300)")
    args = h.settle(p, p.parse_args(argv), {
        "repeats": (3, 1), "batch": (128, 32), "batches": (100, 4), "warmup": (5, 2), "train_images": (10_000, 1024),
        "steps": (20, 3), "model_batch": (64, 8), "depth": (20, 8), "gpu_steps": (60, 3), "gpu_warmup": (10, 1)},
        positive=("repeats", "batch", "batches", "train_images", "steps", "model_batch", "cores_per_worker",
                  "timeout", "gpu_steps"), non_negative=("warmup", "gpu_warmup"))
    args.workers = args.workers or worker_counts(default_workers(cpu_cores()))
    args.gpu_cores = args.gpu_cores or ((1,) if args.quick else worker_counts(default_workers(cpu_cores())))
    args.shards = args.shards or max(4 if args.quick else 16, max(args.workers))
    args.data = args.data or args.out / "data"
    if args.compute_ms is not None and not args.compute_ms >= 0:
        p.error("--compute-ms must be >= 0")
    if args.depth < 8 or (args.depth - 2) % 6:
        p.error(f"--depth must be 6n+2 (8, 20, 32, ...), got {args.depth}")
    if max(args.gpu_cores) > cpu_cores():
        p.error(f"--gpu-cores {max(args.gpu_cores)} is more than the {cpu_cores()} cores this process may use")
    if not 0 < args.gpu_enough <= 1:
        p.error(f"--gpu-enough must be in (0, 1], got {args.gpu_enough}")
    if args.shards < max(args.workers):
        p.error(f"--shards {args.shards} gives some of {max(args.workers)} workers no file; use >= the most workers")
    return args


# ------------------------------------------------------------------------------------ parts


def run_input(args: argparse.Namespace, cores: int) -> dict[str, Any]:
    print(f"\n== part 1: input pipeline, workers {','.join(map(str, args.workers))}")
    data = inp.prepare_data(args.data, args.train_images, args.shards)
    cal = inp.calibrate(data["one_file"], args.batch)
    compute_ms = args.compute_ms if args.compute_ms is not None else cal["seconds_per_batch"] * 1000
    print(f"one core: {cal['seconds_per_batch'] * 1000:.1f} ms per batch of {args.batch}; accelerator sleeps "
          f"{compute_ms:.1f} ms per batch")
    settings = {"one_file": data["one_file"], "pattern": data["pattern"], "batch": args.batch,
                "shuffle": min(10_000, args.train_images), "compute_ms": compute_ms, "warmup": args.warmup,
                "batches": args.batches, "timeout": args.timeout, "train_images": args.train_images,
                "shards": args.shards, "calibration": cal, "compute_ms_given": args.compute_ms is not None}
    res = inp.run_rounds(args.contenders, args.workers, settings, args.repeats)
    d = inp.derive(res, args.contenders, args.workers, settings, cores)
    table = inp.format_table(res, d, args.contenders, args.workers, settings, cores)
    title = (f"Input pipeline, CIFAR-shaped PNG records, accelerator = {compute_ms:.0f} ms/batch of {args.batch}\n"
             f"{cores} cores; other processes kept a median {h.fmt(d['other_cores_overall'], '.1f')} of them busy")
    plot = plots.plot_input_scaling(d, args.contenders, args.workers, args.out / "input_scaling.png", title)
    return {"config": settings, "data": data, "contenders": {c.name: c.label for c in inp.CONTENDERS_SPEC
                                                             if c.name in args.contenders},
            "workers": list(args.workers), "samples": res["samples"], "runs": res["runs"], "order": res["order"],
            "errors": res["errors"], "derived": d, "table": table, "plot": plot and str(plot)}


def run_allreduce(args: argparse.Namespace, cores: int) -> dict[str, Any]:
    print(f"\n== part 2: CIFAR example under allreduce, workers {','.join(map(str, args.workers))}")
    settings = {"steps": args.steps, "batch": args.model_batch, "depth": args.depth,
                "cores_per_worker": args.cores_per_worker, "timeout": args.timeout}
    res = scaling.run_rounds(args.workers, settings, args.repeats)
    d = scaling.derive(res, args.workers)
    table = scaling.format_table(res, d, settings, args.workers)
    others = h.median(list(d["other_cores"].values()))
    title = (f"CIFAR example (ResNet-{args.depth}, batch {args.model_batch}/worker) under allreduce, "
             f"{args.cores_per_worker} CPU core(s) per worker\n{cores} cores; other processes kept a median "
             f"{h.fmt(others, '.1f')} of them busy")
    plot = plots.plot_allreduce_scaling(d, args.workers, args.out / "allreduce_scaling.png", title,
                                        scaling.REFERENCE, scaling.REFERENCE_LABEL)
    return {"config": settings, "workers": list(args.workers), "reference": {str(k): v for k, v in
                                                                           scaling.REFERENCE.items()},
            "reference_label": scaling.REFERENCE_LABEL, "samples": res["samples"], "runs": res["runs"],
            "order": res["order"], "errors": res["errors"], "derived": d, "table": table, "plot": plot and str(plot)}


def run_strategies(args: argparse.Namespace) -> dict[str, Any]:
    print(f"\n== part 3: strategies, from {args.results}")
    sources = strategies.load_sources(args.results, args.run_missing, max(args.timeout, 900.0))
    rows, errors = strategies.assemble(sources)
    table = strategies.format_table(rows, sources, errors)
    described = {name: {k: v for k, v in src.items() if k != "report"} | (
        {"date": src["report"].get("machine", {}).get("date"), "command": src["report"].get("command")}
        if "report" in src else {}) for name, src in sources.items()}
    return {"sources": described, "rows": rows, "errors": errors, "table": table}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    machine = h.machine_start(("torch", "matplotlib"))
    cores = machine["cores"]
    print(f"CIFAR-10 case study: parts {','.join(args.parts)}, {args.repeats} round(s), {cores} cores, "
          f"load {machine['loadavg_start']}")
    report: dict[str, Any] = {"benchmark": "case_study", "command": h.command_line("case_study", argv)}
    parts = {"input": lambda: run_input(args, cores), "allreduce": lambda: run_allreduce(args, cores),
             "strategies": lambda: run_strategies(args), "gpu": lambda: gpu.run_part(args)}
    for part, key in REPORT_KEYS.items():
        report[key] = parts[part]() if part in args.parts else None
    report["machine"] = h.machine_end(machine)
    report["config"] = {"parts": list(args.parts), "workers": list(args.workers), "repeats": args.repeats,
                        "quick": args.quick, "timeout": args.timeout, "results": str(args.results)}
    done = [key for key in REPORT_KEYS.values() if report[key]]
    report["errors"] = [f"{key}: {e}" for key in done for e in report[key].get("errors", [])]
    report["plots"] = {key: report[key]["plot"] for key in done if report[key].get("plot")}
    report["wall_seconds"] = time.perf_counter() - started
    for key in done:
        print(f"\n{report[key]['table']}")
    if report["errors"]:
        print("\nerrors:\n  " + "\n  ".join(report["errors"]))
    if any("plot" in report[k] and report[k]["plot"] is None and not report[k].get("skipped") for k in done):
        print("\nno plots: matplotlib is missing (pip install 'conveyor[plots]')")
    path = write_results("case_study", report, args.out)
    shown = ", ".join(report["plots"].values())
    print(f"\nJSON: {path} (and case_study-latest.json){'; plots: ' + shown if shown else ''}; "
          f"total {report['wall_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
