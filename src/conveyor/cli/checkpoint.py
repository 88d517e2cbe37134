"""`conveyor checkpoint`: a run's model as safetensors that plain PyTorch loads, and what a run's checkpoints hold.

    conveyor checkpoint export runs/x --to runs/x-model [--step N] [--max-shard-size 5GB] [--force]
    conveyor checkpoint show runs/x [--json]

Only parses arguments; the work is `conveyor.train.checkpoint.export` and `conveyor.train.checkpoint.show`.
"""

from __future__ import annotations

import argparse
import json

from conveyor.cli import Command, CommandError


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    export = sub.add_parser("export", help="write the whole model of a step as DIR/model.safetensors (or shards)",
                            description="write the whole model of a step (any strategy's checkpoint) as "
                                        "DIR/model.safetensors under the model's own parameter names; above "
                                        "--max-shard-size, Hugging Face-style shards with model.safetensors.index.json")
    export.add_argument("run_dir", metavar="RUN_DIR", help="the run's output folder, or its checkpoints folder")
    export.add_argument("--to", metavar="DIR", required=True, help="the folder to write (refused if it exists)")
    export.add_argument("--step", type=int, default=None, metavar="N", help="the step (default: the latest)")
    export.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                        help="the largest file before the model is split into shards, e.g. 500MB, 2GiB (default 5GB, "
                             "as Hugging Face)")
    export.add_argument("--force", action="store_true", help="write into DIR even if it exists")
    export.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="show a progress bar on stderr (default: when stderr is a terminal)")
    show = sub.add_parser("show", help="list a run's checkpoint steps, their items, sizes, strategy and world shape",
                          description="list a run's checkpoint steps (complete, latest, incomplete leftovers), their "
                                      "items and sizes, the strategy and world shape that wrote them, step, epoch and "
                                      "when they were written")
    show.add_argument("run_dir", metavar="RUN_DIR", help="the run's output folder, or its checkpoints folder")
    show.add_argument("--json", action="store_true", help="print JSON instead of lines for a person")


def run(args: argparse.Namespace) -> int:
    from conveyor.train.checkpoint.read import CheckpointError

    try:
        if args.action == "show":
            from conveyor.train.checkpoint.show import describe, format_text

            info = describe(args.run_dir)
            print(json.dumps(info, indent=2) if args.json else format_text(info))
            return 0
        from conveyor.train.checkpoint.export import export_model, parse_size

        try:
            limit = parse_size(args.max_shard_size)
        except ValueError as e:
            raise CommandError(f"--max-shard-size: {e}") from None
        paths = export_model(args.run_dir, args.to, step=args.step, force=args.force, max_shard_size=limit,
                             progress=args.progress)
    except CheckpointError as e:
        raise CommandError(str(e)) from None
    for path in paths:
        print(f"wrote {path}")
    return 0


COMMAND = Command("checkpoint", "export a run's model as safetensors plain PyTorch loads, or show its checkpoints",
                  add_arguments, run)
