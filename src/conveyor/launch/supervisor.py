"""Start a plan's tasks on this machine, relay their output, restart the job when a task dies.

    result = Supervisor(plan, max_restarts=3).run()     # blocks until the job ends
    sys.exit(result.exit_code)                           # 0, 1 (failed for good), 130/143 (interrupted)

Each task runs in its own session (``start_new_session=True``), so it leads a process group that also
holds whatever it starts (data-loader workers, shell pipelines); stopping a task signals the whole group.
A Ctrl-C at the terminal reaches only the launcher's own group, and the launcher then stops every task
the same way: SIGTERM to each group, a grace period (5 s) to save and exit, SIGKILL to what is left.

One thread per task reads its merged stdout+stderr line by line, appends each line to
``<output>/logs/<type>-<index>.log`` and prints it to the launcher's stdout as ``[worker:1] <line>``.

Success, as Kubeflow's TFJob defines it: a job with a chief succeeds when the chief exits 0; a job
without one when every worker has exited 0. Tasks still running then (parameter servers, TensorFlow 2
workers blocked in ``server.join()``) get ``linger`` seconds to exit by themselves, then are stopped like
any task (SIGTERM, ``grace``, SIGKILL); how they end no longer matters, and a task that failed in the
same instant as the chief succeeded is reported but does not fail the job. A failure before that point -
of the chief, a worker or a ps, which the chief needs - restarts the job as below.

Supervision, as torchrun's elastic agent does it: when a task exits non-zero or is killed, every task is
stopped and the whole job starts again with ``CONVEYOR_RESTART_COUNT`` + 1 (each log gets a
``=== restart N ===`` line); the script resumes from its latest checkpoint by itself. After
``max_restarts`` restarts the job fails for good, naming the task, how it ended and its last log lines.
Restarts back off (``restart_delay``, doubled after each failure without progress, capped at
``restart_delay_cap``), and a failure that repeats itself - the same task, exit status and last line,
``same_failure_limit`` times in a row with no new checkpoint in between - ends the job early: a damaged
checkpoint or a bad argument fails the same way every time, and restarting it only hides the cause.

A full disk under ``<output>/logs`` does not stop the job: the launcher says once which log it cannot
write and why, and keeps relaying that task's output to its own stdout.

Across machines the launchers coordinate through :class:`Peers` (``launch/rendezvous.py``): a failure on
one node restarts every node, every node stops its tasks before any node starts new ones, and the job
succeeds only when every node's tasks have. Processes that leave their task's process group (a daemon that
calls ``setsid``) are outside supervision, as they are under torchrun.

A launcher killed with SIGKILL (the OOM killer, a scheduler) runs no handler, so on Linux every task is
started with ``PR_SET_PDEATHSIG`` = SIGKILL: the kernel kills it when the launcher dies. SIGKILL rather
than SIGTERM because nobody is left to escalate a SIGTERM that a task ignores or handles slowly (a rank
blocked in a collective, a parameter server waiting for workers that will never come); checkpoints are
written atomically, so nothing half-written is left, and a task's data-loader workers watch their own
parent and follow it. The signal is tied to the *thread* that forked the task, so :meth:`Supervisor.run`
must run on a thread that outlives the tasks (the main thread, as in ``conveyor run``). Elsewhere than
Linux there is no such signal, and tasks outlive a killed launcher.
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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import IO, Protocol

import psutil

from conveyor.errors import PeerError  # re-exported: its old home
from conveyor.launch.plan import (
    RESTART_COUNT_VAR,
    RESUME_VAR,
    TORCHRUN_RESTART_VAR,
    TTY_VAR,
    LaunchPlan,
    TaskLaunch,
)

__all__ = ["JobResult", "PeerError", "Peers", "Supervisor", "TaskExit"]

TAIL_LINES = 20
_LINE_END = re.compile(rb"\r\n|\r|\n")
_STEP_FOLDER = re.compile(r"step-(\d{8,})")
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class Peers(Protocol):
    """How one node's supervisor agrees with the other nodes' (see ``launch/rendezvous.py``).

    Every method may raise :class:`PeerError`; the supervisor then stops its tasks and fails for good.
    """

    def failure(self, attempt: int) -> str | None:
        """A description of a failure another node reported during ``attempt``, else None."""

    def aborted(self) -> str | None:
        """Why the job was stopped for good by another node (its launcher was interrupted), else None."""

    def report_failure(self, attempt: int, description: str) -> None:
        """Tell the other nodes that a task here failed during ``attempt``."""

    def report_done(self, attempt: int) -> None:
        """Tell the other nodes that every task here finished ``attempt`` successfully."""

    def all_done(self, attempt: int) -> bool:
        """True once every node has reported ``attempt`` done."""

    def report_stopped(self, attempt: int) -> None:
        """Tell the other nodes that no task of ``attempt`` runs here any more."""

    def all_stopped(self, attempt: int) -> bool:
        """True once every node has stopped its tasks of ``attempt`` (then a restart may start)."""

    def abort(self, description: str) -> None:
        """Tell the other nodes to stop for good (this launcher was interrupted)."""

    @property
    def timeout(self) -> float:
        """Seconds to wait for the other nodes at a barrier before giving up."""


@dataclass(frozen=True)
class TaskExit:
    """How a task ended: its exit status (negative: killed by that signal) and its last output lines."""

    task: str
    returncode: int
    log_path: str
    last_lines: tuple[str, ...] = ()

    def describe(self) -> str:
        if self.returncode < 0:
            try:
                name = signal.Signals(-self.returncode).name
            except ValueError:
                name = f"signal {-self.returncode}"
            return f"{self.task} was killed by {name}"
        return f"{self.task} exited with status {self.returncode}"


@dataclass(frozen=True)
class JobResult:
    """How the job ended. ``exit_code``: 0 success, 1 failed for good, 128 + signal when interrupted."""

    ok: bool
    restarts: int
    failure: TaskExit | None = None
    signal: int | None = None
    message: str = ""

    @property
    def exit_code(self) -> int:
        if self.ok:
            return 0
        return 128 + self.signal if self.signal else 1


def _segments(stream: IO[bytes]):
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


def _last_line(lines) -> str:
    for line in reversed(list(lines)):
        if line.strip():
            return line.strip().removeprefix("| ").strip()
    return ""


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


def _die_with(launcher_pid: int):
    """A ``preexec_fn`` that makes the child die when the launcher does (Linux); None elsewhere."""
    prctl, sigkill = _PRCTL, int(signal.SIGKILL)
    if prctl is None:
        return None

    def setup() -> None:
        prctl(_PR_SET_PDEATHSIG, sigkill, 0, 0, 0)
        if os.getppid() != launcher_pid:  # the launcher died between fork and prctl: no signal will come
            os.kill(os.getpid(), sigkill)

    return setup


def latest_step(checkpoint_dir: str) -> int | None:
    """The newest step folder in ``checkpoint_dir`` (None: none yet) - how the launcher sees progress.

    Step folders appear by an atomic rename once complete (``conveyor.train.checkpoint``), so a name is
    enough; this layer does not import the training code to ask it.
    """
    try:
        with os.scandir(checkpoint_dir) as entries:
            steps = [int(m.group(1)) for e in entries if (m := _STEP_FOLDER.fullmatch(e.name))]
    except OSError:
        return None
    return max(steps, default=None)


class _Log:
    """A task's log file. A write that fails (a full disk) is reported once; then the log is given up and
    the task's output still reaches the console - a logging failure is no reason to stop a training job."""

    def __init__(self, path: str, task: str, say) -> None:
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


@dataclass
class _Streak:
    """Failures since the last progress (a new checkpoint), and how many in a row were the same."""

    step: int | None = None
    key: tuple[str, str] | None = None
    same: int = 0
    without_progress: int = 0

    def add(self, key: tuple[str, str], step: int | None) -> None:
        if self.without_progress and step != self.step:  # a checkpoint since the last failure: a fresh start
            self.same = self.without_progress = 0
        self.same = self.same + 1 if key == self.key else 1
        self.without_progress += 1
        self.key, self.step = key, step


@dataclass
class _Running:
    launch: TaskLaunch
    proc: subprocess.Popen
    log: _Log
    pump: threading.Thread
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    group_gone: bool = False

    @property
    def name(self) -> str:
        return self.launch.name


@dataclass(frozen=True)
class _Outcome:
    kind: str  # "done", "failed" (a task here), "peer" (a task on another node), "signal", "final" (no restart)
    failure: TaskExit | None = None
    message: str = ""


class Supervisor:
    """Runs a :class:`~conveyor.launch.plan.LaunchPlan` until it succeeds, fails for good or is interrupted.

    ``out`` gets the tasks' prefixed lines (default: ``sys.stdout``), ``err`` the launcher's own messages
    (default: ``sys.stderr``). ``grace`` is how long a task has to exit after SIGTERM. ``linger`` is how
    long the tasks still running when the job has succeeded (see :meth:`_ended`) may take to exit by
    themselves (conveyor's parameter servers do, once the workers are done) before they are stopped
    (TensorFlow's serving tasks never do). ``peers`` coordinates with
    the other nodes of a multi-node job. ``restart_delay`` is the pause before the first restart, doubled
    after each further failure without progress, at most ``restart_delay_cap``; ``same_failure_limit``
    identical failures in a row without progress end the job early.
    """

    def __init__(
        self,
        plan: LaunchPlan,
        *,
        max_restarts: int = 3,
        grace: float = 5.0,
        linger: float = 30.0,
        poll: float = 0.05,
        peer_poll: float = 0.2,
        out: IO[str] | None = None,
        err: IO[str] | None = None,
        peers: Peers | None = None,
        restart_delay: float = 1.0,
        restart_delay_cap: float = 30.0,
        same_failure_limit: int = 3,
    ) -> None:
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
            raise ValueError(f"max_restarts = {max_restarts!r}; expected a whole number >= 0")
        if not 0 <= restart_delay <= restart_delay_cap:
            raise ValueError(f"restart_delay = {restart_delay!r}, restart_delay_cap = {restart_delay_cap!r}; "
                             f"expected 0 <= restart_delay <= restart_delay_cap")
        if isinstance(same_failure_limit, bool) or not isinstance(same_failure_limit, int) or same_failure_limit < 1:
            raise ValueError(f"same_failure_limit = {same_failure_limit!r}; expected a whole number >= 1")
        self.restart_delay = restart_delay
        self.restart_delay_cap = restart_delay_cap
        self.same_failure_limit = same_failure_limit
        self.plan = plan
        self.max_restarts = max_restarts
        self.grace = grace
        self.linger = linger
        self.poll = poll
        self.peer_poll = peer_poll  # the other nodes are asked at most this often (a round trip each)
        self.out = out if out is not None else sys.stdout
        self._live_ok = _isatty(self.out)  # tasks may draw progress bars only where someone sees them
        self._live_shown = False
        self.err = err if err is not None else sys.stderr
        self.peers = peers
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._signals: list[int] = []

    # -- the job ----------------------------------------------------------------------------------

    def run(self) -> JobResult:
        """Run the job to its end; SIGINT/SIGTERM to this process stop every task and end it early."""
        os.makedirs(self.plan.log_dir, exist_ok=True)
        with self._catch_signals():
            try:
                return self._run()
            except BaseException as e:  # a task could not start (a wrong --python): the other nodes must stop too
                self._tell_peers_abort(f"node {self.plan.node_rank}'s launcher failed: {type(e).__name__}: {e}")
                raise

    def _run(self) -> JobResult:
        attempt = 0
        streak = _Streak()
        while True:
            outcome = self._attempt(attempt)
            if outcome.kind == "done":
                return JobResult(ok=True, restarts=attempt)
            if outcome.kind == "signal":
                return self._interrupted(attempt)
            # A peer's description is a line, then that task's last lines.
            what, _, details = (outcome.failure.describe() if outcome.failure else outcome.message).partition("\n")
            if outcome.kind == "final":
                return JobResult(ok=False, restarts=attempt, failure=outcome.failure, message=outcome.message)
            if attempt >= self.max_restarts:
                why = f"gave up after {attempt} restart(s) (--max-restarts {self.max_restarts})"
                message = f"{what}; {why}" + (f"\n{details}" if details else "")
                return JobResult(ok=False, restarts=attempt, failure=outcome.failure, message=message)
            step = latest_step(self.plan.checkpoint_dir)
            last = _last_line(outcome.failure.last_lines if outcome.failure else details.splitlines())
            streak.add((what, last), step)
            if streak.same >= self.same_failure_limit:
                message = self._repeated(what, last, streak.same, outcome.failure)
                return JobResult(ok=False, restarts=attempt, failure=outcome.failure, message=message)
            attempt += 1
            delay = min(self.restart_delay_cap, self.restart_delay * 2 ** (streak.without_progress - 1))
            self._say(f"{what}; restarting the job {self._resume_point(step)} in {delay:g} s "
                      f"(restart {attempt} of {self.max_restarts})")
            if self._wait_unless_signalled(delay):
                return self._interrupted(attempt - 1)

    def _interrupted(self, attempt: int) -> JobResult:
        name = signal.Signals(self._signals[0]).name
        self._tell_peers_abort(f"node {self.plan.node_rank}'s launcher was stopped by {name}")
        self._say(f"stopped every task ({name})")
        return JobResult(ok=False, restarts=attempt, signal=self._signals[0], message=f"interrupted by {name}")

    def _wait_unless_signalled(self, seconds: float) -> bool:
        """Pause between attempts; True when SIGINT/SIGTERM came meanwhile (nothing runs: just stop)."""
        deadline = time.monotonic() + seconds
        while not self._signals and time.monotonic() < deadline:
            self._wake.wait(min(self.poll * 4, max(0.0, deadline - time.monotonic())))
        return bool(self._signals)

    def _resume_point(self, step: int | None) -> str:
        if step is not None:
            return f"from its latest checkpoint (step {step})"
        if self.plan.node_rank == 0:  # the chief (rank 0), the one that writes checkpoints, runs here
            return "from the beginning (no checkpoint yet)"
        return "from the chief's latest checkpoint on node 0, if it wrote one"

    def _repeated(self, what: str, last: str, times: int, failure: TaskExit | None) -> str:
        where = f"see {failure.log_path}" if failure is not None else "see that task's log"
        return (f"{what} the same way {times} times in a row without progress (no new checkpoint): {last!r}; "
                f"not restarting again, since a restart would fail the same way: fix the cause ({where}) - a "
                f"damaged checkpoint can be moved out of {self.plan.checkpoint_dir} - and run the job again")

    def _attempt(self, attempt: int) -> _Outcome:
        running: list[_Running] = []
        try:
            for launch in self.plan.tasks:
                running.append(self._start(launch, attempt))
            pids = ", ".join(f"{r.name} pid {r.proc.pid}" for r in running)
            self._say(f"attempt {attempt}: started {pids}; logs in {self.plan.log_dir}")
            outcome = self._watch(running, attempt)
        finally:
            self._stop(running)
        if outcome.kind == "failed" and outcome.failure is not None:
            # The tail is complete only now that the pump threads have drained the pipes.
            rt = next(r for r in running if r.name == outcome.failure.task)
            outcome = _Outcome("failed", TaskExit(rt.name, outcome.failure.returncode, rt.launch.log_path,
                                                  tuple(rt.tail)))
        if self.peers is not None and outcome.kind in ("failed", "peer") and attempt < self.max_restarts:
            outcome = self._sync_restart(self.peers, attempt, outcome)
        return outcome

    def _watch(self, running: list[_Running], attempt: int) -> _Outcome:
        ended_at: float | None = None  # when this node's part of the job succeeded (see _ended)
        done_here = False
        next_peer_check = 0.0
        while True:
            if self._signals:
                name = signal.Signals(self._signals[0]).name
                self._tell_peers_abort(f"node {self.plan.node_rank}'s launcher was stopped by {name}")
                return _Outcome("signal")
            if ended_at is None and self._ended(running):
                ended_at = time.monotonic()
            if ended_at is None:  # once the job has succeeded, how the other tasks end no longer matters
                for rt in running:
                    code = rt.proc.poll()
                    if code is not None and code != 0:
                        failure = TaskExit(rt.name, code, rt.launch.log_path)
                        self._report_failure(attempt, rt, failure)
                        return _Outcome("failed", failure)
            elif not done_here:
                rest = [rt for rt in running if rt.proc.poll() is None]
                if rest and time.monotonic() - ended_at > self.linger:
                    self._say(f"{', '.join(rt.name for rt in rest)} still running {self.linger:g} s after "
                              f"{self._end_condition()}; stopping {'it' if len(rest) == 1 else 'them'}")
                    rest = []
                if not rest:
                    self._note_late_failures(running)
                    if self.peers is None:
                        return _Outcome("done")
                    done_here = True
                    try:
                        self.peers.report_done(attempt)
                    except PeerError as e:
                        return _Outcome("final", message=str(e))
            if self.peers is not None and time.monotonic() >= next_peer_check:
                next_peer_check = time.monotonic() + self.peer_poll
                try:
                    reason = self.peers.aborted()
                    if reason:
                        return _Outcome("final", message=reason)
                    message = self.peers.failure(attempt)
                    if message:
                        return _Outcome("peer", message=message)
                    if done_here and self.peers.all_done(attempt):
                        return _Outcome("done")
                except PeerError as e:
                    return _Outcome("final", message=str(e))
            self._wake.wait(self.poll)

    def _ended(self, running: list[_Running]) -> bool:
        """Whether this node's part of the job has succeeded: Kubeflow TFJob's success policy.

        With a chief, the job succeeds when the chief exits 0, whatever the other tasks are doing: in
        TensorFlow 2's parameter-server training the workers and ps only serve (``server.join()`` never
        returns) while the chief coordinates. Without a chief, when every training task has exited 0
        (TFJob's ``AllWorkers``). Parameter servers never decide. A node without the chief (several
        machines) ends when its own training tasks have all exited 0.
        """
        chief = [rt for rt in running if rt.launch.task.type == "chief"]
        if chief:
            return chief[0].proc.poll() == 0
        return all(rt.proc.poll() == 0 for rt in running if rt.launch.task.is_training)

    def _end_condition(self) -> str:
        if any(t.task.type == "chief" for t in self.plan.tasks):
            return "the chief finished"
        return "every training task finished"

    def _note_late_failures(self, running: list[_Running]) -> None:
        """Say which tasks failed after the job had succeeded (or in the same instant): not a failure of the
        job, whose outcome the chief decides, but worth a line in case it hides a problem."""
        for rt in running:
            code = rt.proc.returncode
            if code is not None and code != 0:
                self._say(f"{TaskExit(rt.name, code, rt.launch.log_path).describe()} after "
                          f"{self._end_condition()}; the job succeeded all the same (see {rt.launch.log_path})")

    def _report_failure(self, attempt: int, rt: _Running, failure: TaskExit) -> None:
        """Tell the other nodes at once (before stopping anything here), so the first failure - the likely
        cause - is the one every node reports, not a peer's collective that broke because of it."""
        if self.peers is None:
            return
        rt.pump.join(timeout=0.5)  # the task has exited: its last lines are on their way
        lines = "".join(f"\n  | {line}" for line in rt.tail)
        description = (f"{failure.describe()} on node {self.plan.node_rank} (log: {failure.log_path} there)\n"
                       f"last {len(rt.tail)} lines of {failure.log_path}:{lines}")
        try:
            self.peers.report_failure(attempt, description)
        except PeerError:
            pass  # the barrier after the stop reports the lost peers

    def _sync_restart(self, peers: Peers, attempt: int, outcome: _Outcome) -> _Outcome:
        """Multi-node: before anyone restarts, every node must have stopped the failed attempt's tasks, or an
        old task could join the new attempt's process group."""
        try:
            peers.report_stopped(attempt)
            deadline = time.monotonic() + peers.timeout
            while not peers.all_stopped(attempt):
                if self._signals:
                    return _Outcome("signal")
                if time.monotonic() > deadline:
                    what = outcome.failure.describe() if outcome.failure else outcome.message.partition("\n")[0]
                    return _Outcome("final", outcome.failure, f"{what}; then the other nodes did not stop their "
                                                              f"tasks within {peers.timeout:g} s")
                self._wake.wait(self.peer_poll)
        except PeerError as e:
            return _Outcome("final", outcome.failure, str(e))
        return outcome

    def _tell_peers_abort(self, description: str) -> None:
        if self.peers is not None:
            try:
                self.peers.abort(description)
            except PeerError:
                pass

    # -- one task ---------------------------------------------------------------------------------

    def _start(self, launch: TaskLaunch, attempt: int) -> _Running:
        log = _Log(launch.log_path, launch.name, self._say)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        log.write(f"=== restart {attempt} === {stamp}\n" if attempt else f"=== {launch.name} started === {stamp}\n")
        env = dict(launch.env)
        env[RESTART_COUNT_VAR] = str(attempt)
        if TORCHRUN_RESTART_VAR in env:  # training tasks only, as the plan set it
            env[TORCHRUN_RESTART_VAR] = str(attempt)
        if self._live_ok:
            env.setdefault(TTY_VAR, "1")
        if attempt:
            # A restart continues this job from its own latest checkpoint, even under --no-resume
            # (which only means: do not pick up checkpoints that were there before the job began).
            env[RESUME_VAR] = "1"
        try:
            proc = subprocess.Popen(launch.argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    preexec_fn=_die_with(os.getpid()))
        except BaseException:
            log.close()
            raise
        rt = _Running(launch, proc, log, threading.Thread())
        rt.pump = threading.Thread(target=self._pump, args=(rt,), name=f"conveyor-log-{launch.name}", daemon=True)
        rt.pump.start()
        return rt

    def _pump(self, rt: _Running) -> None:
        """Copy one task's output, line by line, to its log and (prefixed) to the launcher's stdout.

        A segment ended by a carriage return is a live update (a progress bar redrawing itself):
        on a terminal it is redrawn in place, prefixed like any line; the log keeps only whole lines.
        """
        prefix = f"[{rt.name}] "
        try:
            for text, live in _segments(rt.proc.stdout):
                if not live:
                    rt.tail.append(text)
                    rt.log.write(text + "\n")
                if live and not self._live_ok:
                    continue
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
        finally:
            rt.proc.stdout.close()
            rt.log.close()

    def _stop(self, running: list[_Running]) -> None:
        """SIGTERM every task's process group, wait up to ``grace`` seconds, SIGKILL what is left."""
        for rt in running:
            self._signal_group(rt, signal.SIGTERM)
        deadline = time.monotonic() + self.grace
        while time.monotonic() < deadline and len(self._signals) < 2:  # a second Ctrl-C: no more patience
            if all(rt.proc.poll() is not None for rt in running) and not any(self._group_alive(rt) for rt in running):
                break
            time.sleep(0.05)
        for rt in running:
            self._signal_group(rt, signal.SIGKILL)
        for rt in running:
            try:
                rt.proc.wait(timeout=self.grace)
            except subprocess.TimeoutExpired:  # SIGKILL cannot be ignored; this needs a hung kernel
                self._say(f"{rt.name} (pid {rt.proc.pid}) did not exit after SIGKILL")
            rt.pump.join(timeout=2.0)

    def _signal_group(self, rt: _Running, signum: int) -> None:
        if rt.group_gone:
            return
        if rt.proc.poll() is not None and not self._group_alive(rt):
            return
        try:
            os.killpg(rt.proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            rt.group_gone = True

    def _group_alive(self, rt: _Running) -> bool:
        """Whether any live (non-zombie) process is left in the task's process group.

        Only asked once the group leader has exited and been reaped; until then the pid is still ours,
        so ``rt.proc.pid`` cannot name some other process's group. ``os.killpg(pgid, 0)`` would count
        zombies, which stay forever where PID 1 does not reap orphans (many containers).
        """
        if rt.group_gone:
            return False
        if rt.proc.returncode is None:
            return True
        pgid = rt.proc.pid
        for proc in psutil.process_iter(["status"]):
            try:
                if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(proc.pid) == pgid:
                    return True
            except (ProcessLookupError, psutil.Error):
                continue
        rt.group_gone = True
        return False

    # -- signals and messages ---------------------------------------------------------------------

    @contextmanager
    def _catch_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signal handlers can only be set from the main thread; the caller handles its own
            return

        def handler(signum: int, frame: object) -> None:
            self._signals.append(signum)
            self._wake.set()

        previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    def _say(self, message: str) -> None:  # from any thread
        with self._lock:
            try:
                self.err.write(f"[conveyor] {message}\n")
                self.err.flush()
            except (OSError, ValueError):
                pass
