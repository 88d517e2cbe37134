"""One job at a time per output folder: a POSIX record lock on ``<output>/.conveyor.lock``.

    lock = OutputLock.acquire(output_dir)      # OutputDirBusyError, naming the holder and the fix
    environ[OUTPUT_LOCK_VAR] = str(lock.path)         # the launcher's tasks then do not take it again
    lock.release()                             # (or the process ends: the kernel releases it)

Taken by ``conveyor run`` (node 0's launcher only, when several nodes share the folder) for the whole
job, and by ``conveyor.init()`` on rank 0 of a script run without it (``OUTPUT_LOCK_VAR`` unset). The lock
is ``fcntl.lockf`` (POSIX ``fcntl`` record locks): the kernel drops it when its holder dies, kill -9
included, so nothing stale is ever left to clean up, and NFS (v3 through the lock manager, v4
natively) and the other shared file systems the README recommends honour it across machines, which
BSD ``flock`` does not promise. The file holds who took it (host, pid, since, command) for the
message a refused job prints; it is never deleted (deleting it would let two jobs lock two inodes).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar

from conveyor.cluster.variables import OUTPUT_LOCK_VAR
from conveyor.errors import ConveyorError

__all__ = ["LOCK_NAME", "lock_path", "OutputDirBusyError", "OutputLock", "lock_for_script"]

LOCK_NAME = ".conveyor.lock"



def lock_path(output_dir: str | os.PathLike[str]) -> Path:
    """Where the lock of `output_dir` lives (what `conveyor run` tells its tasks)."""
    return Path(output_dir).resolve() / LOCK_NAME


class OutputDirBusyError(ConveyorError, RuntimeError):
    """Another job holds the output folder; the message names it (host, pid, since when) and the fix."""

    usage_error = True  # a restart would find the folder taken again: `conveyor run` does not retry it


class OutputLock:
    """The lock on one output folder, held by this process until `release` or its end."""

    _held: ClassVar[dict[str, OutputLock]] = {}  # POSIX locks belong to the process: one open file per folder

    def __init__(self, path: Path, fd: int):
        self.path, self._fd, self._users = path, fd, 1

    @classmethod
    def acquire(cls, output_dir: str | os.PathLike[str]) -> OutputLock:
        """Lock `output_dir` (created if missing) for this process, or raise `OutputDirBusyError` at once."""
        path = lock_path(output_dir)
        folder = path.parent
        folder.mkdir(parents=True, exist_ok=True)
        held = cls._held.get(str(path))
        if held is not None:  # this process has it already (a second init() in one process): share it
            held._users += 1
            return held
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise OutputDirBusyError(_busy_message(folder, path)) from None
        holder = {"host": socket.gethostname(), "pid": os.getpid(),
                  "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv)[:500]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        lock = cls._held[str(path)] = cls(path, fd)
        return lock

    def release(self) -> None:
        """Give the folder back (when every `acquire` of this process has released it)."""
        self._users -= 1
        if self._users > 0 or self._fd < 0:
            return
        self._held.pop(str(self.path), None)
        fd, self._fd = self._fd, -1
        os.close(fd)  # closing the file drops the process's lock


def _busy_message(folder: Path, path: Path) -> str:
    pid = "PID"
    try:
        holder = json.loads(path.read_text()[:4096])
        pid = str(int(holder["pid"]))
        who = f"pid {pid} on host {holder['host']}, since {holder['since']} ({str(holder.get('command', ''))[:200]!r})"
    except (OSError, ValueError, TypeError, KeyError):
        who = "a process that has not written its name yet"
    return (f"output folder {folder} is in use by another job: {who} holds {path}. An output folder belongs to one "
            f"job at a time (its checkpoints, metrics and logs would mix). Give this job another --output-dir, or "
            f"wait for that job to end (or stop it: kill {pid}); the lock goes with its process, so nothing needs "
            f"cleaning up afterwards")


def lock_for_script(rank: int | None, output_dir: str | os.PathLike[str], environ: Mapping[str, str]
                    ) -> OutputLock | None:
    """What `conveyor.init()` takes: the folder's lock on rank 0, unless `conveyor run` holds it for the job
    (`OUTPUT_LOCK_VAR`); None elsewhere (other ranks are the same job)."""
    if rank != 0 or environ.get(OUTPUT_LOCK_VAR):
        return None
    return OutputLock.acquire(output_dir)
