"""The `conveyor` command: a registry of small subcommands (see `main.py` for the list).

A subcommand is one module that parses its arguments and calls a layer below; it exposes
`COMMAND = Command(name, help, add_arguments, run)` and `main.py` lists it in `COMMANDS`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    """One subcommand: `conveyor <name> ...`.

    `add_arguments(parser)` fills the subcommand's argparse parser; `run(args)` does the work and
    returns the exit status (0 success, 1 the work failed, 2 bad input).
    """

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


class CommandError(Exception):
    """A failure to report as one line on stderr, without a traceback, with an exit status."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


__all__ = ["Command", "CommandError"]
