"""A task's fatal error, written where its launcher reads it: what failed, beyond an exit status.

    install(os.environ)              # in the task (conveyor.init does it under `conveyor run`)
    report = read_report(report_path(task_log_path))            # in the launcher, once the task died

Under ``conveyor run`` an uncaught exception in a task's main thread writes
``<output>/logs/<type>-<index>.failure.json`` beside its log (JSON: ``type``, the qualified class name,
``message``, ``usage``) before Python prints the traceback as always. ``usage`` is the class attribute
``usage_error`` (:class:`conveyor.errors.ConveyorError`): a usage or configuration error that a restart
meets again. The launcher removes the file when it starts the task, so a report always belongs to the
attempt that wrote it; a task that dies without one (a signal, ``os._exit``) leaves its exit status and
output tail only.
Writing never raises: the original error is what the user must see.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType

from conveyor.cluster.variables import OUTPUT_DIR_VAR, RESTART_COUNT_VAR, TASK_INDEX_VAR, TASK_TYPE_VAR

__all__ = ["Signature", "install", "read_report", "report_path"]

_FORMAT = "conveyor.failure"
_MAX_BYTES = 64 * 1024  # a report is a class name and a message; anything larger is not one
_MAX_MESSAGE = 4000


@dataclass(frozen=True)
class Signature:
    """What failed (an error's class, ``module.Name``, or an exit status), its gist (the error's message, or
    the last output line) and whether it is a usage error; equal signatures are the same failure. The
    launcher makes one for a task that wrote no report (:func:`conveyor.launch.failures.signature`)."""

    what: str
    gist: str
    usage: bool = False


def report_path(log_path: str) -> str:
    """Where the task whose log is ``log_path`` (``<output>/logs/<type>-<index>.log``) writes its report."""
    return log_path.removesuffix(".log") + ".failure.json"


def read_report(path: str) -> Signature | None:
    """The report at ``path`` as a signature (class name, message, usage); None when there is none or it is
    not a well-formed one (never raises)."""
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(_MAX_BYTES))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        return None
    kind, message, usage = data.get("type"), data.get("message"), data.get("usage")
    if not isinstance(kind, str) or not isinstance(message, str) or not isinstance(usage, bool):
        return None
    return Signature(kind, message[:_MAX_MESSAGE], usage)


def install(environ: Mapping[str, str]) -> bool:
    """Under ``conveyor run`` (its variables in ``environ``), make an uncaught exception write this task's
    report, then run the hook that was there before. Idempotent; False when not run by ``conveyor run``."""
    try:
        log = f"{environ[TASK_TYPE_VAR]}-{int(environ[TASK_INDEX_VAR])}.log"  # the launcher's name for it
        where = report_path(os.path.join(environ[OUTPUT_DIR_VAR], "logs", log))
    except (KeyError, ValueError):
        return False
    if RESTART_COUNT_VAR not in environ:  # set by `conveyor run` only: another launcher reads no report
        return False
    previous = sys.excepthook
    if getattr(previous, "conveyor_report", None) == where:
        return True

    def hook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        _write(where, error)
        previous(kind, error, tb)

    hook.conveyor_report = where  # type: ignore[attr-defined]
    sys.excepthook = hook
    return True


def _write(path: str, error: BaseException) -> None:
    kind = type(error)
    report = {"format": _FORMAT, "version": 1, "type": f"{kind.__module__}.{kind.__qualname__}",
              "message": str(error)[:_MAX_MESSAGE], "usage": getattr(kind, "usage_error", False) is True}
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(report, f)
        os.replace(tmp, path)  # whole or absent: the launcher may read it the moment the task exits
    except OSError:
        pass  # a full disk or a removed folder: the exit status and the traceback still tell the launcher
