"""`conveyor predict`: how a measured run would scale on a cluster, from its summary.json.

    conveyor predict runs/cifar10/summary.json --cluster cluster.json
    conveyor predict runs/cifar10 --cluster cluster.toml --workers 1,8,64,512 --strategies allreduce,ps-sync
    conveyor predict runs/cifar10 --gpus-per-node 8 --intra-node-bandwidth "100 GB/s" --intra-node-latency "3 us" \\
        --inter-node-bandwidth "100 Gbit/s" --inter-node-latency "5 us" --compute-speed 40

Prints one table per strategy (step time, samples/s, speedup, efficiency and the bound of every N) and
writes prediction.json and prediction.png (the `plots` extra) into --out (default: <run>/prediction).
Only parses arguments; the model is `conveyor.scaling`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from conveyor.cli import Command
from conveyor.scaling import DEFAULT_WORKERS, STRATEGIES, Options, load_measured, predict
from conveyor.scaling.cluster import FIELDS, load_cluster
from conveyor.scaling.measured import OVERRIDABLE
from conveyor.scaling.report import format_table, plot, write_json
from conveyor.scaling.units import format_bandwidth, format_seconds

_NUMBERS = {"gpus_per_node": int, "ps_count": int, "cores_per_gpu": float, "compute_speed": float}


def _counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(n) for n in text.split(",") if n.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected worker counts like 1,2,4,8") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: worker counts must be positive")
    return counts


def _strategies(text: str) -> tuple[str, ...]:
    chosen = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [s for s in chosen if s not in STRATEGIES]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"unknown strategy {', '.join(unknown) or text!r}; choose from "
                                         f"{', '.join(STRATEGIES)}")
    return chosen


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("summary", metavar="SUMMARY", help="a run's summary.json, or its output folder")
    p.add_argument("--cluster", metavar="FILE", default=None,
                   help="the target cluster, a .json or .toml file of the fields below (flags override it)")
    group = p.add_argument_group("the cluster (each also a field of --cluster FILE)")
    for field, meaning in FIELDS.items():
        flag = "--" + field.replace("_", "-")
        if field == "compute_shares_cores":
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=meaning)
        elif field != "name":
            metavar = "BW" if "bandwidth" in field else "LAT" if "latency" in field else "N"
            group.add_argument(flag, dest=field, type=_NUMBERS.get(field, str), default=None, metavar=metavar,
                               help=meaning)
    model = p.add_argument_group("the model")
    model.add_argument("--workers", type=_counts, default=DEFAULT_WORKERS, metavar="N,...",
                       help="worker counts to predict (default 1,2,4,...,1024)")
    model.add_argument("--strategies", type=_strategies, default=STRATEGIES, metavar="S,...",
                       help=f"default: all of {', '.join(STRATEGIES)}")
    defaults = Options()
    model.add_argument("--overlap", type=float, default=defaults.overlap,
                       help="share of gradient communication that can run under backward (default %(default)s)")
    model.add_argument("--backward-fraction", type=float, default=defaults.backward_fraction,
                       help="backward's share of forward + backward (default 2/3)")
    model.add_argument("--bucket-mb", type=float, default=defaults.bucket_bytes / 2**20,
                       help="MiB of gradients per all-reduce call (default %(default)s, DDP's)")
    model.add_argument("--stages", type=int, default=defaults.stages, help="pipeline stages (default %(default)s)")
    model.add_argument("--microbatches", type=int, default=defaults.microbatches,
                       help="pipeline microbatches per step (default %(default)s)")
    model.add_argument("--activation-bytes", type=float, default=defaults.activation_bytes,
                       help="bytes per sample one pipeline stage sends the next (default 0: not measured)")
    run = p.add_argument_group("the measured run (override or supply summary.json's scaling block)")
    for key, meaning in zip(OVERRIDABLE, ("samples per step per worker", "bytes all-reduced per step",
                                          "bytes of the model's parameters", "input pipeline seconds per batch on "
                                          "one core"), strict=True):
        run.add_argument("--" + key.replace("_", "-").replace("-per-batch", ""), dest=key, type=float, default=None,
                         metavar="X", help=meaning)
    p.add_argument("--out", type=Path, default=None, help="folder for prediction.json/.png (default <run>/prediction)")
    p.add_argument("--no-plot", action="store_true", help="skip prediction.png")


def run(args: argparse.Namespace) -> int:
    options = Options(overlap=args.overlap, backward_fraction=args.backward_fraction,
                      bucket_bytes=args.bucket_mb * 2**20, stages=args.stages, microbatches=args.microbatches,
                      activation_bytes=args.activation_bytes)
    measured = load_measured(args.summary, overrides={k: getattr(args, k) for k in OVERRIDABLE},
                             overlap=options.overlap, backward_fraction=options.backward_fraction)
    cluster = load_cluster(args.cluster, {f: getattr(args, f, None) for f in FIELDS})
    points = predict(measured, cluster, options, workers=args.workers, strategies=args.strategies)
    print(f"measured ({measured.source}): {measured.batch_size:g} samples per step per worker, compute "
          f"{format_seconds(measured.compute)}, optimizer {format_seconds(measured.optimizer)}, other "
          f"{format_seconds(measured.overhead)}, input {_input(measured.input_core_seconds)}, gradients "
          f"{measured.gradient_bytes / 1e6:.4g} MB")
    print(f"cluster{' ' + cluster.name if cluster.name else ''}: {cluster.gpus_per_node} per node, "
          f"{cluster.cores_per_gpu:g} cores each, intra-node {format_bandwidth(cluster.intra_node_bandwidth)} + "
          f"{format_seconds(cluster.intra_node_latency)}, inter-node {format_bandwidth(cluster.inter_node_bandwidth)}"
          f" + {format_seconds(cluster.inter_node_latency)}, compute x{cluster.compute_speed:g}; overlap "
          f"{options.overlap:g}\n")
    print(format_table(points, options))
    run_dir = Path(args.summary) if Path(args.summary).is_dir() else Path(args.summary).parent
    out = args.out or run_dir / "prediction"
    written = write_json(out / "prediction.json", measured=measured, cluster=cluster, options=options, points=points)
    print(f"\nJSON: {written}")
    if not args.no_plot:
        drawn = plot(out / "prediction.png", points, title=f"predicted scaling of {measured.source}")
        if drawn is not None:
            print(f"plot: {drawn}")
    return 0


def _input(seconds: float | None) -> str:
    return "not measured (free)" if seconds is None else f"{format_seconds(seconds)} per batch on one core"


COMMAND = Command("predict", "predict step time, samples/s and scaling efficiency on a cluster from a run's "
                  "summary.json", add_arguments, run)
