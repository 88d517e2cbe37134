"""One task's process, as the supervisor runs it: start it, relay and log its output, stop its process group.

    console = Console(sys.stdout, sys.stderr)
    task = RunningTask.start(launch, attempt, console)   # its own session, PR_SET_PDEATHSIG, launch.cpus
    ...
    stop_tasks([task], 5.0, impatient=lambda: False, say=console.say)   # SIGTERM, grace, SIGKILL

A task leads its own process group, and stopping it signals the whole group. Its merged stdout+stderr
is appended to its log and printed as ``[worker:1] <line>``; a log that cannot be written (a full disk)
is reported once and given up while the console still gets every line. Why it is done this way:
``docs/launcher.md``, "Running the tasks".
"""

from __future__ import annotations

import collections
import ctypes
import errno
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO

import psutil

from conveyor.cluster.failure_report import finished_by, finished_path
from conveyor.launch import warm
from conveyor.launch.binding import format_cpus
from conveyor.launch.plan import REJOIN_VAR, RESTART_COUNT_VAR, RESUME_VAR, TORCHRUN_RESTART_VAR, TTY_VAR, TaskLaunch

__all__ = ["TAIL_LINES", "Console", "RunningTask", "segments", "stop_tasks"]

TAIL_LINES = 20
_LINE_END = re.compile(rb"\r\n|\r|\n")
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def segments(stream: IO[bytes]):
    """Yield `(text, live)` for each piece of output ended by a newline (live=False) or by a
    carriage return (live=True: it will be overwritten)."""
    pending = b""
    for chunk in iter(lambda: stream.read1(65536), b""):
        pending += chunk
        start = 0
        for m in _LINE_END.finditer(pending):
            piece = pending[start:m.start()]
            start = m.end()
            live = m.group() == b"\r"
            if piece or not live:
                yield piece.decode("utf-8", "replace"), live
        pending = pending[start:]
    if pending:
        yield pending.decode("utf-8", "replace"), False


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _load_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


_PRCTL = _load_prctl()  # looked up here, in the launcher: the child only calls it, between fork and exec


def _child_setup(launcher_pid: int, cpus: tuple[int, ...] = ()):
    """A ``preexec_fn`` that binds the child to ``cpus`` (when given) and makes it die when the launcher
    does (Linux); None when there is nothing to do.

    The affinity is set here, between fork and exec, rather than on the pid after ``Popen``: by then the
    task may have started threads (torch's pools, data workers), and only the thread whose affinity is
    set, and what it starts afterwards, would be bound.
    """
    prctl, sigkill = _PRCTL, int(signal.SIGKILL)
    if prctl is None and not cpus:
        return None

    def setup() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, sigkill, 0, 0, 0)
            if os.getppid() != launcher_pid:  # the launcher died between fork and prctl: no signal will come
                os.kill(os.getpid(), sigkill)

    return setup


class Console:
    """The launcher's stdout (the tasks' prefixed lines) and stderr (its own messages), shared by threads.

    Tasks may draw progress bars (lines ended by a carriage return) only where someone sees them: when
    ``out`` is a terminal.
    """

    def __init__(self, out: IO[str], err: IO[str]) -> None:
        self.out = out
        self.err = err
        self.live_ok = _isatty(out)
        self._live_shown = False
        self._lock = threading.Lock()

    def say(self, message: str) -> None:  # from any thread
        with self._lock:
            try:
                self.err.write(f"[conveyor] {message}\n")
                self.err.flush()
            except (OSError, ValueError):
                pass

    def relay(self, prefix: str, text: str, live: bool) -> None:
        """Print one segment of a task's output; a live one is redrawn in place on a terminal."""
        if live and not self.live_ok:
            return
        with self._lock:
            try:
                if live:
                    self.out.write("\r" + prefix + text + "\x1b[K")
                    self._live_shown = True
                else:
                    self.out.write(("\r\x1b[K" if self._live_shown else "") + prefix + text + "\n")
                    self._live_shown = False
                self.out.flush()
            except (OSError, ValueError):
                pass  # the launcher's stdout is gone (a closed pipe); the log still gets every line


class TaskLog:
    """A task's log file. A write that fails (a full disk) is reported once; then the log is given up and
    the task's output still reaches the console - a logging failure is no reason to stop a training job."""

    def __init__(self, path: str, task: str, say: Callable[[str], None]) -> None:
        self.path = path
        self._task = task
        self._say = say
        self._file: IO[str] | None = None
        try:
            self._file = open(path, "a", encoding="utf-8")
        except OSError as e:
            self._fail(e)

    def write(self, text: str) -> None:
        if self._file is None:
            return
        try:
            self._file.write(text)
            self._file.flush()
        except OSError as e:
            self._fail(e)

    def close(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            try:
                f.close()
            except OSError:
                pass  # already reported by the write that failed, or nothing was left to write

    def _fail(self, e: OSError) -> None:
        full = e.errno in (errno.ENOSPC, errno.EDQUOT)
        hint = "disk full? free space or use --output-dir elsewhere" if full else "use --output-dir elsewhere"
        self._say(f"cannot write the log {self.path}: {e.strerror or e} ({hint}); {self._task}'s output still "
                  f"reaches this console")
        self.close()


def _task_env(launch: TaskLaunch, attempt: int, tty: bool, failures: int | None = None,
              rejoin: int = 0) -> dict[str, str]:
    env = dict(launch.env)
    env[RESTART_COUNT_VAR] = str(attempt)  # a worker restarted alone is in its peers' attempt (and says so below)
    if TORCHRUN_RESTART_VAR in env:  # training tasks only, as the plan set it
        # torchrun's meaning: restarts after failures (max_restarts - remaining), not membership changes;
        # without an elastic round the two counts are equal
        env[TORCHRUN_RESTART_VAR] = str(attempt if failures is None else failures)
    if tty:
        env.setdefault(TTY_VAR, "1")
    if attempt or rejoin:
        # A restart continues this job from its own latest checkpoint, even under --no-resume
        # (which only means: do not pick up checkpoints that were there before the job began).
        env[RESUME_VAR] = "1"
    if rejoin:  # it takes its step and data position from the parameter servers (docs/ps.md)
        env[REJOIN_VAR] = "1"
    return env


#: Lines kept in the task's log but not relayed: torch names each TCPStore connection's peer by a reverse
#: lookup, only for its own log text; where no DNS server answers (network namespaces, containers, hosts
#: without a resolver) the lookup of the IPv4-mapped IPv6 address its dual-stack socket reports fails with
#: EAI_AGAIN (/etc/hosts holds the IPv4 form only) and every multi-host run printed it. It changes nothing.
QUIET = re.compile(r"\[c10d\] The hostname of the client socket cannot be retrieved\. err=-?\d+$")


@dataclass
class RunningTask:
    """A started task: its process (leader of its own process group), its log, and the thread relaying
    its output. ``tail`` holds its last output lines."""

    launch: TaskLaunch
    proc: subprocess.Popen | warm.WarmProcess
    log: TaskLog
    pump: threading.Thread
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    group_gone: bool = False
    say: Callable[[str], None] | None = None
    aborted_after_end: bool = False  # killed by SIGABRT after its script's end: said once, counted as 0

    @property
    def name(self) -> str:
        return self.launch.name

    @classmethod
    def start(cls, launch: TaskLaunch, attempt: int, console: Console, failures: int | None = None,
              rejoin: int = 0) -> RunningTask:
        """Start ``launch`` for ``attempt`` (after ``failures`` restarts for failures, where an elastic job's
        membership rounds make the two differ) in a new session, dying with the launcher (Linux). ``rejoin``
        (> 0): it replaces a worker that died, alone, as the job's ``rejoin``-th restart (``CONVEYOR_REJOIN``)."""
        log = TaskLog(launch.log_path, launch.name, console.say)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        log.write(f"=== restarted alone ({rejoin}) === {stamp}\n" if rejoin else
                  f"=== restart {attempt} === {stamp}\n" if attempt else f"=== {launch.name} started === {stamp}\n")
        env = _task_env(launch, attempt, console.live_ok, failures, rejoin)
        try:
            # forked from the launcher's template with torch imported where it can (launch/warm.py), else a new process
            proc = warm.spawn(launch.argv, env, launch.cpus, console.say) or subprocess.Popen(
                launch.argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=_child_setup(os.getpid(), launch.cpus))
        except subprocess.SubprocessError as e:  # what an error in preexec_fn becomes: only the binding can fail
            log.close()
            raise OSError(f"cannot bind {launch.name} to cpus {format_cpus(launch.cpus)}, which the launcher was "
                          f"allowed when it planned the job ({e}); run with --bind none, or check the job's "
                          f"cpuset (taskset -p {os.getpid()})") from None
        except BaseException:
            log.close()
            raise
        task = cls(launch, proc, log, threading.Thread(), say=console.say)
        task.pump = threading.Thread(target=task._pump, args=(console,), name=f"conveyor-log-{launch.name}",
                                     daemon=True)
        task.pump.start()
        return task

    def _pump(self, console: Console) -> None:
        """Copy the task's output, line by line, to its log and (prefixed) to the launcher's stdout.

        A segment ended by a carriage return is a live update (a progress bar redrawing itself):
        on a terminal it is redrawn in place, prefixed like any line; the log keeps only whole lines.
        """
        prefix = f"[{self.name}] "
        try:
            for text, live in segments(self.proc.stdout):
                if QUIET.search(text):
                    self.log.write(text + "\n")
                    continue
                if not live:
                    self.tail.append(text)
                    self.log.write(text + "\n")
                console.relay(prefix, text, live)
        finally:
            self.proc.stdout.close()
            self.log.close()

    def poll(self) -> int | None:
        """The task's exit status as the job counts it (None: still running). Killed by SIGABRT after its script
        ran to its end (the record of ``failure_report.install_finish``, for this pid) counts as 0, with one
        line: gloo can abort a finished process in the interpreter's finalization (pytorch/pytorch PR 179291).
        An abort before that record stays a failure."""
        code = self.proc.poll()
        if code != -signal.SIGABRT:
            return code
        if not self.aborted_after_end and finished_by(finished_path(self.launch.log_path), self.proc.pid):
            self.aborted_after_end = True
            if self.say is not None:
                self.say(f"{self.name} was killed by SIGABRT after its script ran to its end (an abort in the "
                         f"interpreter's finalization, as gloo's threads can cause: pytorch/pytorch PR 179291); "
                         f"counted as finished")
        return 0 if self.aborted_after_end else code

    def signal_group(self, signum: int) -> None:
        if self.group_gone:
            return
        if self.proc.poll() is not None and not self.group_alive():
            return
        try:
            os.killpg(self.proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            self.group_gone = True

    def group_alive(self) -> bool:
        """Whether any live (non-zombie) process is left in the task's process group.

        Only asked once the group leader has exited and been reaped; until then the pid is still ours,
        so ``proc.pid`` cannot name some other process's group. ``os.killpg(pgid, 0)`` would count
        zombies, which stay forever where PID 1 does not reap orphans (many containers).
        """
        if self.group_gone:
            return False
        if self.proc.returncode is None:
            return True
        pgid = self.proc.pid
        for proc in psutil.process_iter(["status"]):
            try:
                if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(proc.pid) == pgid:
                    return True
            except (ProcessLookupError, psutil.Error):
                continue
        self.group_gone = True
        return False


def stop_tasks(running: list[RunningTask], grace: float, impatient: Callable[[], bool],
               say: Callable[[str], None]) -> None:
    """SIGTERM every task's process group, wait up to ``grace`` seconds (or until ``impatient()``: a second
    Ctrl-C), SIGKILL what is left, then wait for the leaders and their relaying threads."""
    for rt in running:
        rt.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and not impatient():
        if all(rt.proc.poll() is not None for rt in running) and not any(rt.group_alive() for rt in running):
            break
        time.sleep(0.05)
    for rt in running:
        rt.signal_group(signal.SIGKILL)
    for rt in running:
        try:
            rt.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:  # SIGKILL cannot be ignored; this needs a hung kernel
            say(f"{rt.name} (pid {rt.proc.pid}) did not exit after SIGKILL")
        rt.pump.join(timeout=2.0)
