"""A task's fatal error, written where its launcher reads it: what failed, beyond an exit status; and that
a task's script ran to its end, so that an abort in the interpreter's finalization after it is no failure.

    install(os.environ)              # in the task (conveyor.init does it under `conveyor run`)
    report = read_report(report_path(task_log_path))            # in the launcher, once the task died
    finished_by(finished_path(task_log_path), pid)              # the launcher, for a task killed by SIGABRT

Under ``conveyor run`` an uncaught exception in a task's main thread writes
``<output>/logs/<type>-<index>.failure.json`` beside its log (JSON: ``type``, the qualified class name,
``message``, ``usage``) before Python prints the traceback as always. ``usage`` is the class attribute
``usage_error`` (:class:`conveyor.errors.ConveyorError`): a usage or configuration error that a restart
meets again. The launcher removes the file when it starts the task, so a report always belongs to the
attempt that wrote it; a task that dies without one (a signal, ``os._exit``) leaves its exit status and
output tail only.
When the interpreter of a training task begins its exit after the script ran to its end (no uncaught
exception), ``<type>-<index>.finished.json`` records the task's pid: gloo can abort a finished process
later in finalization (pytorch/pytorch PR 179291), and the launcher counts that abort as finished.
Writing never raises: the original error is what the user must see.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType

from conveyor.cluster.spec import TRAINING_JOBS
from conveyor.cluster.variables import OUTPUT_DIR_VAR, RESTART_COUNT_VAR, TASK_INDEX_VAR, TASK_TYPE_VAR

__all__ = ["Signature", "finished_by", "finished_path", "install", "install_finish", "read_report", "report_path"]

_FORMAT = "conveyor.failure"
_FINISHED = "conveyor.finished"
_MAX_BYTES = 64 * 1024  # a report is a class name and a message; anything larger is not one
_MAX_MESSAGE = 4000
_armed: set[str] = set()  # the records this process writes at exit (install_finish is idempotent)


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


def finished_path(log_path: str) -> str:
    """Where the task whose log is ``log_path`` records that its script ran to its end."""
    return log_path.removesuffix(".log") + ".finished.json"


def finished_by(path: str, pid: int) -> bool:
    """Whether the record at ``path`` says that process ``pid``'s script ran to its end (never raises)."""
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(_MAX_BYTES))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("format") == _FINISHED and data.get("pid") == pid


def _log_path(environ: Mapping[str, str]) -> str | None:
    """This task's log as ``conveyor run`` names it; None when not run by ``conveyor run``."""
    try:
        log = f"{environ[TASK_TYPE_VAR]}-{int(environ[TASK_INDEX_VAR])}.log"  # the launcher's name for it
        path = os.path.join(environ[OUTPUT_DIR_VAR], "logs", log)
    except (KeyError, ValueError):
        return None
    return path if RESTART_COUNT_VAR in environ else None  # set by `conveyor run` only: no other launcher reads it


def install_finish(environ: Mapping[str, str]) -> bool:
    """Under ``conveyor run`` in a training task (chief, worker), record this process's pid in
    :func:`finished_path` when its interpreter begins
    to exit without an uncaught exception in the main thread (an ``atexit`` handler: it runs after the script's
    end and the non-daemon threads, before the finalization where gloo can abort). Idempotent; False when not
    run by ``conveyor run``. A status given to ``sys.exit`` cannot be seen there: the record says "ran to its
    end", and the launcher reads it only for a task killed by SIGABRT."""
    log = _log_path(environ)
    if log is None or environ.get(TASK_TYPE_VAR) not in TRAINING_JOBS:  # a ps task's group-free exit is its own
        return False
    where, pid = finished_path(log), os.getpid()
    if where in _armed:
        return True
    _armed.add(where)

    def record() -> None:
        # PyErr_Print sets sys.last_value for an uncaught exception, whichever excepthook runs; a forked child
        # that runs this process's handlers is not the task
        if getattr(sys, "last_value", None) is None and os.getpid() == pid:
            _write_json(where, {"format": _FINISHED, "version": 1, "pid": pid})

    atexit.register(record)
    return True


def install(environ: Mapping[str, str]) -> bool:
    """Under ``conveyor run`` (its variables in ``environ``), make an uncaught exception write this task's
    report, then run the hook that was there before, and (:func:`install_finish`) record the script's end.
    Idempotent; False when not run by ``conveyor run``."""
    log = _log_path(environ)
    if log is None:
        return False
    install_finish(environ)
    where = report_path(log)
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
    _write_json(path, {"format": _FORMAT, "version": 1, "type": f"{kind.__module__}.{kind.__qualname__}",
                       "message": str(error)[:_MAX_MESSAGE], "usage": getattr(kind, "usage_error", False) is True})


def _write_json(path: str, report: dict) -> None:
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(report, f)
        os.replace(tmp, path)  # whole or absent: the launcher may read it the moment the task exits
    except OSError:
        pass  # a full disk or a removed folder: the exit status and the traceback still tell the launcher
