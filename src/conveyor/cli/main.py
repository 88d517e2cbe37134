"""`conveyor`: the command line.

    conveyor --version
    conveyor data convert digits.npz data/digits --shards 4 --split train=0.8 --split test=0.2
    conveyor data inspect data/digits/train-*.tfrecord
    conveyor predict runs/digits/summary.json --cluster cluster.json
    conveyor checkpoint export runs/digits --to runs/digits-model

Every subcommand is a `Command` in `COMMANDS`; adding one is a module plus a line here. Bad input
(a missing file, a wrong argument) prints one line on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib import metadata

from conveyor import exiting
from conveyor.cli import Command, CommandError
from conveyor.cli import checkpoint as checkpoint_command
from conveyor.cli import data as data_command
from conveyor.cli import k8s as k8s_command
from conveyor.cli import predict as predict_command
from conveyor.cli import run as run_command
from conveyor.cli import slurm as slurm_command

COMMANDS: tuple[Command, ...] = (data_command.COMMAND, run_command.COMMAND, slurm_command.COMMAND,
                                 k8s_command.COMMAND, k8s_command.TASK_COMMAND, predict_command.COMMAND,
                                 checkpoint_command.COMMAND)


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line (and where to find help), not a usage dump."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _version() -> str:
    try:
        return metadata.version("conveyor")
    except metadata.PackageNotFoundError:
        return "unknown"


def build_parser(commands: Sequence[Command] = COMMANDS) -> argparse.ArgumentParser:
    parser = _Parser(prog="conveyor", description="Train PyTorch models across processes, GPUs and machines.")
    parser.add_argument("--version", action="version", version=f"conveyor {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for cmd in commands:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
        p.set_defaults(_command=cmd)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line `argv` (default: sys.argv[1:]); return the exit status."""
    # a launcher's rendezvous and several commands import torch: a quick exit (conveyor.exiting), withdrawn
    # when the command loads a user's code (a data pipeline) unless CONVEYOR_FAST_EXIT=1, as in training tasks
    exiting.install()
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, usage errors: argparse has printed already
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    name = args._command.name
    try:
        return int(args._command.run(args))
    except CommandError as e:
        _fail(name, str(e))
        return e.exit_code
    except _BAD_INPUT as e:  # a wrong value, a missing or unreadable file
        _fail(name, _describe(e))
        return 2
    except OSError as e:  # the work failed (disk full, a damaged file): not the user's input
        _fail(name, _describe(e))
        return 1
    except KeyboardInterrupt:
        _fail(name, "interrupted")
        return 130


_BAD_INPUT = (ValueError, FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError,
              PermissionError)


def _describe(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror and e.filename and str(e).startswith("["):
        return f"{e.filename}: {e.strerror}"  # "[Errno 2] ..." → "path: No such file or directory"
    return str(e)


def _fail(command: str, message: str) -> None:
    print(f"conveyor {command}: error: {message}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
