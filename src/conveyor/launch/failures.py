"""What failed, so that failures compare by their cause and not by the task they struck.

    sig = signature(task_exit.returncode, task_exit.last_lines, read_report(path))   # this node's task
    sig = peer_signature(description)        # another node's, from what its launcher reported
    sig == earlier_sig                       # the same failure, whichever task, rank or node

A :class:`Signature` is ``what`` failed - the error's class from the task's report
(:mod:`conveyor.cluster.failure_report`), else ``exited with status N`` / ``was killed by SIGNAME`` -
its ``gist`` - the error's message, else the output's last line - and ``usage``: an error whose class
says it is a usage or configuration error, or argparse's (exit status 2 after a ``usage:`` line, its
``prog: error: ...`` line the gist). No task name, rank or node is part of it: the first task to fail
changes from attempt to attempt while the cause stays. The restart policy (:mod:`.restarts`) uses it.
"""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Sequence
from dataclasses import asdict

from conveyor.cluster.failure_report import Signature  # re-exported: the launcher's name for it

__all__ = ["Signature", "exit_status", "last_line", "peer_signature", "signature", "signature_line"]

_ARGPARSE_ERROR = re.compile(r"\S+: error: .+")
_PEER_STATUS = re.compile(r"(exited with status -?\d+|was killed by [A-Z0-9 ]+?)( on node \d+|$)")
_SIGNATURE_PREFIX = "failure signature: "
ARGPARSE_STATUS = 2  # argparse's exit status for a command-line error (parser.error)


def exit_status(returncode: int) -> str:
    """``exited with status N``, or ``was killed by SIGNAME`` for a negative ``returncode``."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with status {returncode}"


def last_line(lines: Sequence[str]) -> str:
    """The last non-blank line of a task's output (a peer's ``  | `` quoting removed): its failure's gist."""
    for line in reversed(list(lines)):
        if line.strip():
            return line.strip().removeprefix("| ").strip()
    return ""


def signature(returncode: int, lines: Sequence[str], report: Signature | None = None) -> Signature:
    """The signature of a task that ended with ``returncode`` after printing ``lines`` (its tail), with the
    ``report`` it wrote, if any (a report written before an exit status of 0 or a signal is not this end's)."""
    if report is not None and returncode > 0:
        return report
    gist = last_line(lines)
    usage = (returncode == ARGPARSE_STATUS and bool(_ARGPARSE_ERROR.fullmatch(gist))
             and any(line.strip().removeprefix("| ").startswith("usage: ") for line in lines))
    return Signature(exit_status(returncode), gist, usage)


def signature_line(sig: Signature) -> str:
    """The line a launcher adds to the failure it reports to the other nodes (:func:`peer_signature`)."""
    return _SIGNATURE_PREFIX + json.dumps(asdict(sig))


def peer_signature(description: str) -> tuple[Signature, str]:
    """Another node's failure (``Peers.failure``): its signature, and the description without its line."""
    kept, found = [], None
    for line in description.splitlines():
        if line.startswith(_SIGNATURE_PREFIX) and found is None:
            try:
                data = json.loads(line[len(_SIGNATURE_PREFIX):])
                found = Signature(str(data["what"]), str(data["gist"]), data["usage"] is True)
                continue
            except (ValueError, KeyError, TypeError):
                pass
        kept.append(line)
    if found is None:  # a description without the line: its status and quoted tail are all there is
        first, quoted = (kept[0] if kept else ""), [line for line in kept[1:] if line.startswith("  | ")]
        status = _PEER_STATUS.search(first)
        found = Signature(status.group(1) if status else first, last_line(quoted))
    return found, "\n".join(kept)
