"""`conveyor checkpoint export`: a run's model as one model.safetensors that plain PyTorch loads.

    conveyor checkpoint export runs/x --to runs/x-model [--step N] [--force]

Only parses arguments; the work is `conveyor.train.checkpoint.export`.
"""

from __future__ import annotations

import argparse

from conveyor.cli import Command, CommandError


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    export = sub.add_parser("export", help="write the whole model of a step as DIR/model.safetensors",
                            description="write the whole model of a step (any strategy's checkpoint) as "
                                        "DIR/model.safetensors, under the model's own parameter names")
    export.add_argument("run_dir", metavar="RUN_DIR", help="the run's output folder, or its checkpoints folder")
    export.add_argument("--to", metavar="DIR", required=True, help="the folder to write (refused if it exists)")
    export.add_argument("--step", type=int, default=None, metavar="N", help="the step (default: the latest)")
    export.add_argument("--force", action="store_true", help="write into DIR even if it exists")


def run(args: argparse.Namespace) -> int:
    from conveyor.train.checkpoint.export import export_model
    from conveyor.train.checkpoint.read import CheckpointError

    try:
        path = export_model(args.run_dir, args.to, step=args.step, force=args.force)
    except CheckpointError as e:
        raise CommandError(str(e)) from None
    print(f"wrote {path}")
    return 0


COMMAND = Command("checkpoint", "export a run's checkpoint: one model.safetensors plain PyTorch loads",
                  add_arguments, run)
