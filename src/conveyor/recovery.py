"""Where the stall after a failure goes: cheap timestamps, and summary.json's ``recovery`` block built from them.

    recovery.note_restart(log_dir, attempt, task, seen, stopped, started, died)   # the launcher, per restart
    recovery.mark("group")                     # a task: a moment of its start-up (the first of each name counts)
    recovery.block(log_dir, attempt)           # the chief, at the end: [{"attempt": N, parts..., "total": s}, ...]

The launcher appends one record per restart to ``<log_dir>/restarts.json``: wall times (``time.time()``) of
the failure (``died``: the task's own last word where the fault hook gave one, else unknown), when the launcher
saw it, when every task had stopped, when the new tasks were started. Each task marks ``imports`` (its
``conveyor.init()`` was called), ``group`` (process group joined), ``fit`` (``Trainer.fit`` began), ``restored``
(checkpoint loaded), ``first_step`` (its first step done); its process start comes from ``/proc/self/stat``.
The parts, in seconds, in order: detect, stop, pause (the restart policy's delay), process_start, imports,
group_init, setup (the script's own model and data), restore, first_step; their sum is ``total``. The task
parts are the slowest rank's (the group waits for it) and exist for the restart that started this attempt
only: earlier attempts' tasks are gone. Torch-free: the launcher imports it. docs/launcher.md, "Recovery".
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from conveyor.fileio import atomic_write

__all__ = ["MARKS", "TASK_MARKS", "block", "drain_path", "fault_time", "mark", "note_restart", "process_start_time",
           "task_times"]

RESTARTS_FILE = "restarts.json"
DRAIN_FILE = "drain"  # an elastic job's request to stop at a checkpoint (launch/elastic.py, train/drain.py)
TASK_MARKS = ("imports", "group", "fit", "restored", "first_step")
TASK_PARTS = ("process_start", "imports", "group_init", "setup", "restore", "first_step")  # ending at each time
MARKS: dict[str, float] = {}


def mark(name: str) -> None:
    """Record now as the moment `name` of this process (the first call per name counts; a dict lookup after)."""
    if name not in MARKS:
        MARKS[name] = time.time()


def process_start_time() -> float | None:
    """This process's start (wall time) from /proc (Linux), else None."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            ticks = int(f.read().rpartition(")")[2].split()[19])  # field 22, starttime, after the command name
        with open("/proc/stat", encoding="ascii") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def task_times() -> list[float]:
    """This process's start and its marks, in order (-1 where unknown): what the ranks reduce with max."""
    start = process_start_time()
    return [start if start is not None else -1.0, *(MARKS.get(n, -1.0) for n in TASK_MARKS)]


def drain_path(output_dir: str | os.PathLike) -> Path:
    """Where node 0's launcher asks the chief to stop the job's steps at a checkpoint (``{"round": r}``)."""
    return Path(output_dir) / "logs" / DRAIN_FILE


def fault_time(lines) -> float | None:
    """When a task killed itself (conveyor.fault's last word among its last `lines`), else None."""
    for line in reversed(list(lines)):
        if "conveyor fault: SIGKILL" in line and " time " in line:
            try:
                return float(line.rpartition(" time ")[2].split()[0])
            except (ValueError, IndexError):
                return None
    return None


def note_restart(log_dir: str | os.PathLike, *, attempt: int, task: str | None, seen: float, stopped: float,
                 started: float, died: float | None = None, alone: bool = False) -> None:
    """Append the launcher's record of the restart that started `attempt` to ``<log_dir>/restarts.json``;
    `alone`: only `task` was started again, during `attempt` (a ps-async/ssp worker; nothing was stopped)."""
    path = Path(log_dir) / RESTARTS_FILE
    records = _read(path)
    records.append({"attempt": attempt, "task": task, "died": died, "seen": seen, "stopped": stopped,
                    "started": started, **({"alone": True} if alone else {})})
    atomic_write(path, json.dumps(records, indent=1).encode())


def block(log_dir: str | os.PathLike, attempt: int, times: list[float] | None = None) -> list[dict[str, Any]]:
    """summary.json's ``recovery``: one entry per restart recorded, parts in seconds (module docstring).
    `times` (:func:`task_times`, max over ranks) fills the task parts of the restart that started `attempt`."""
    out = []
    for r in _read(Path(log_dir) / RESTARTS_FILE):
        # (the part that ends at the moment, the moment); a part whose start is unknown spans back to the last known
        moments = [("", r.get("died")), ("detect", r["seen"]), ("stop", r["stopped"]), ("pause", r["started"])]
        if r["attempt"] == attempt and times is not None and not r.get("alone"):  # the ranks' start: not its
            moments += list(zip(TASK_PARTS, times, strict=True))
        known = [(name, t) for name, t in moments if t is not None and t >= 0]
        entry: dict[str, Any] = {"attempt": r["attempt"], "task": r.get("task"), **({"alone": True} if r.get("alone")
                                                                                   else {}),
                                 "from": "died" if r.get("died") is not None else "seen"}
        for (_, before), (name, t) in zip(known, known[1:], strict=False):
            entry[name] = max(0.0, t - before)  # clocks of one machine; max: /proc's start is in clock ticks
        entry["total"] = sum(entry[name] for name, _ in known[1:])
        out.append(entry)
    return out


def _read(path: Path) -> list[dict[str, Any]]:
    try:
        records = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    return records if isinstance(records, list) else []
