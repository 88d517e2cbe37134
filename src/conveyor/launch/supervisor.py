"""Start a plan's tasks on this machine, relay their output, restart the job when a task dies.

    result = Supervisor(plan, max_restarts=3).run()     # blocks until the job ends
    sys.exit(result.exit_code)                           # 0, 1 (failed for good), 130/143 (interrupted)

What it promises: every task runs in its own process group, and stopping the job (a failure, Ctrl-C,
SIGTERM) stops every group - SIGTERM, ``grace`` seconds, SIGKILL - and, on Linux, a launcher killed
outright takes its tasks with it. Each task's output goes to ``<output>/logs/<type>-<index>.log`` and,
prefixed ``[worker:1]``, to stdout. The job succeeds as Kubeflow's TFJob does (the chief exits 0, or
without a chief every worker); a failure before that restarts the whole job, up to ``max_restarts``
times, with a growing pause, and ends it early when the same failure repeats without a new checkpoint.
Across machines the launchers coordinate through :class:`Peers` (``launch/rendezvous.py``).
:meth:`Supervisor.run` must run on a thread that outlives the tasks (the main thread). The design, with
its reasons: ``docs/launcher.md``, "The supervisor: success, failure, restarts".
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Protocol

from conveyor.errors import PeerError  # re-exported: its old home
from conveyor.launch.plan import LaunchPlan
from conveyor.launch.restarts import (
    FailureStreak,
    RestartPolicy,
    last_line,
    latest_step,
    repeated_failure,
    resume_point,
)
from conveyor.launch.tasks import Console, RunningTask, stop_tasks

__all__ = ["JobResult", "PeerError", "Peers", "Supervisor", "TaskExit"]


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

    def report_succeeded(self, attempt: int) -> None:
        """The chief of attempt ``attempt`` exited 0 on this node: the job has succeeded (TFJob's policy)."""

    def report_trained(self, attempt: int) -> None:
        """Every training task of this node (a job without a chief) exited 0 during ``attempt``."""

    def succeeded(self, attempt: int) -> bool:
        """Whether the job has succeeded in attempt ``attempt``: the node with the chief said so, or (no chief)
        every node with training tasks has reported them trained."""

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


@dataclass(frozen=True)
class _Outcome:
    kind: str  # "done", "failed" (a task here), "peer" (a task on another node), "signal", "final" (no restart)
    failure: TaskExit | None = None
    message: str = ""


class _Signals:
    """SIGINT/SIGTERM to the launcher, in arrival order, and the event that wakes the run loop for them."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.wake = threading.Event()

    @contextmanager
    def caught(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signal handlers can only be set from the main thread; the caller handles its own
            return

        def handler(signum: int, frame: object) -> None:
            self.received.append(signum)
            self.wake.set()

        previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    def wait(self, seconds: float, poll: float) -> bool:
        """Pause between attempts; True when SIGINT/SIGTERM came meanwhile (nothing runs: just stop)."""
        deadline = time.monotonic() + seconds
        while not self.received and time.monotonic() < deadline:
            self.wake.wait(min(poll * 4, max(0.0, deadline - time.monotonic())))
        return bool(self.received)


def _ended(running: list[RunningTask]) -> bool:
    """Whether this node's part of the job has succeeded: Kubeflow TFJob's success policy.

    With a chief, the job succeeds when the chief exits 0, whatever the other tasks are doing: in
    TensorFlow 2's parameter-server training the workers and ps only serve (``server.join()`` never
    returns) while the chief coordinates. Without a chief, when every training task has exited 0
    (TFJob's ``AllWorkers``). Parameter servers never decide, so a node of parameter servers only never
    ends by itself. Over several machines only the chief's node decides alone; any other node's job
    ends when ``Peers.succeeded`` says so (the chief's node, or every node with training tasks).
    """
    chief = [rt for rt in running if rt.launch.task.type == "chief"]
    if chief:
        return chief[0].proc.poll() == 0
    training = [rt for rt in running if rt.launch.task.is_training]
    return bool(training) and all(rt.proc.poll() == 0 for rt in training)


def _has_chief(running: list[RunningTask]) -> bool:
    return any(rt.launch.task.type == "chief" for rt in running)


def _end_condition(plan: LaunchPlan) -> str:
    if any(t.task.type == "chief" for t in plan.tasks):
        return "the chief finished"
    return "every training task finished"


class Supervisor:
    """Runs a :class:`~conveyor.launch.plan.LaunchPlan` until it succeeds, fails for good or is interrupted.

    ``out`` gets the tasks' prefixed lines (default: ``sys.stdout``), ``err`` the launcher's own messages
    (default: ``sys.stderr``). ``grace`` is how long a task has to exit after SIGTERM. ``linger`` is how
    long the tasks still running when the job has succeeded (see :func:`_ended`) may take to exit by
    themselves (conveyor's parameter servers do, once the workers are done) before they are stopped
    (TensorFlow's serving tasks never do). ``peers`` coordinates with
    the other nodes of a multi-node job. ``restart_delay`` is the pause before the first restart, doubled
    after each further failure without progress, at most ``restart_delay_cap``; ``same_failure_limit``
    identical failures in a row without progress end the job early (:class:`~.restarts.RestartPolicy`).
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
        self.policy = RestartPolicy(max_restarts, restart_delay, restart_delay_cap, same_failure_limit)
        self.max_restarts = max_restarts
        self.restart_delay = restart_delay
        self.restart_delay_cap = restart_delay_cap
        self.same_failure_limit = same_failure_limit
        self.plan = plan
        self.grace = grace
        self.linger = linger
        self.poll = poll
        self.peer_poll = peer_poll  # the other nodes are asked at most this often (a round trip each)
        self._console = Console(out if out is not None else sys.stdout, err if err is not None else sys.stderr)
        self.out, self.err = self._console.out, self._console.err
        self._say = self._console.say  # from any thread
        self.peers = peers
        self._signals = _Signals()

    # -- the job ----------------------------------------------------------------------------------

    def run(self) -> JobResult:
        """Run the job to its end; SIGINT/SIGTERM to this process stop every task and end it early."""
        os.makedirs(self.plan.log_dir, exist_ok=True)
        with self._signals.caught():
            try:
                return self._run()
            except BaseException as e:  # a task could not start (a wrong --python): the other nodes must stop too
                self._tell_peers_abort(f"node {self.plan.node_rank}'s launcher failed: {type(e).__name__}: {e}")
                raise

    def _run(self) -> JobResult:
        attempt = 0
        streak = FailureStreak()
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
            last = last_line(outcome.failure.last_lines if outcome.failure else details.splitlines())
            streak.add((what, last), step)
            if self.policy.gives_up(streak):
                log_path = outcome.failure.log_path if outcome.failure is not None else None
                message = repeated_failure(what, last, streak.same, log_path, self.plan.checkpoint_dir)
                return JobResult(ok=False, restarts=attempt, failure=outcome.failure, message=message)
            attempt += 1
            delay = self.policy.delay_after(streak)
            self._say(f"{what}; restarting the job {resume_point(step, self.plan.node_rank)} in {delay:g} s "
                      f"(restart {attempt} of {self.max_restarts})")
            if self._signals.wait(delay, self.poll):
                return self._interrupted(attempt - 1)

    def _interrupted(self, attempt: int) -> JobResult:
        signum = self._signals.received[0]
        name = signal.Signals(signum).name
        self._tell_peers_abort(f"node {self.plan.node_rank}'s launcher was stopped by {name}")
        self._say(f"stopped every task ({name})")
        return JobResult(ok=False, restarts=attempt, signal=signum, message=f"interrupted by {name}")

    def _attempt(self, attempt: int) -> _Outcome:
        running: list[RunningTask] = []
        try:
            for launch in self.plan.tasks:
                running.append(RunningTask.start(launch, attempt, self._console))
            pids = ", ".join(f"{r.name} pid {r.proc.pid}" for r in running)
            self._say(f"attempt {attempt}: started {pids}; logs in {self.plan.log_dir}")
            outcome = self._watch(running, attempt)
        finally:
            # A second Ctrl-C: no more patience.
            stop_tasks(running, self.grace, lambda: len(self._signals.received) >= 2, self._say)
        if outcome.kind == "failed" and outcome.failure is not None:
            # The tail is complete only now that the pump threads have drained the pipes.
            rt = next(r for r in running if r.name == outcome.failure.task)
            outcome = _Outcome("failed", TaskExit(rt.name, outcome.failure.returncode, rt.launch.log_path,
                                                  tuple(rt.tail)))
        if self.peers is not None and outcome.kind in ("failed", "peer") and attempt < self.max_restarts:
            outcome = self._sync_restart(self.peers, attempt, outcome)
        return outcome

    def _watch(self, running: list[RunningTask], attempt: int) -> _Outcome:
        ended_at: float | None = None  # when the job succeeded (see _ended)
        trained = False  # this node's training tasks have all exited 0 (several machines, no chief)
        done_here = False
        next_peer_check = 0.0
        while True:
            if self._signals.received:
                name = signal.Signals(self._signals.received[0]).name
                self._tell_peers_abort(f"node {self.plan.node_rank}'s launcher was stopped by {name}")
                return _Outcome("signal")
            if ended_at is None and not trained and _ended(running):
                if self.peers is None or _has_chief(running):
                    ended_at = time.monotonic()
                    if self.peers is not None:
                        self._tell_peers_succeeded(attempt)
                else:  # the job has succeeded when every node's training tasks have (Peers.succeeded)
                    self._tell_peers_trained(attempt)
                    trained = True
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
                              f"{_end_condition(self.plan)}; stopping {'it' if len(rest) == 1 else 'them'}")
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
                    if ended_at is None and self.peers.succeeded(attempt):  # the chief's node or every node
                        ended_at = time.monotonic()
                    if done_here and self.peers.all_done(attempt):
                        return _Outcome("done")
                except PeerError as e:
                    return _Outcome("final", message=str(e))
            self._signals.wake.wait(self.poll)


    def _note_late_failures(self, running: list[RunningTask]) -> None:
        """Say which tasks failed after the job had succeeded (or in the same instant): not a failure of the
        job, whose outcome the chief decides, but worth a line in case it hides a problem."""
        for rt in running:
            code = rt.proc.returncode
            if code is not None and code != 0:
                self._say(f"{TaskExit(rt.name, code, rt.launch.log_path).describe()} after "
                          f"{_end_condition(self.plan)}; the job succeeded all the same (see {rt.launch.log_path})")

    def _report_failure(self, attempt: int, rt: RunningTask, failure: TaskExit) -> None:
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
                if self._signals.received:
                    return _Outcome("signal")
                reason = peers.aborted()  # a node lost for good never reports stopped
                if reason:
                    return _Outcome("final", outcome.failure, reason)
                if time.monotonic() > deadline:
                    what = outcome.failure.describe() if outcome.failure else outcome.message.partition("\n")[0]
                    return _Outcome("final", outcome.failure, f"{what}; then the other nodes did not stop their "
                                                              f"tasks within {peers.timeout:g} s")
                self._signals.wake.wait(self.peer_poll)
        except PeerError as e:
            return _Outcome("final", outcome.failure, str(e))
        return outcome

    def _tell_peers_succeeded(self, attempt: int) -> None:
        """Nodes without the chief learn from this that their serving tasks may stop (they never exit)."""
        try:
            self.peers.report_succeeded(attempt)
        except PeerError as e:
            self._say(f"could not tell the other nodes that the chief finished ({e}); they stop when their own "
                      f"training tasks end")

    def _tell_peers_trained(self, attempt: int) -> None:
        try:
            self.peers.report_trained(attempt)
        except PeerError as e:  # the peer check that follows ends the job, saying why
            self._say(f"could not tell the other nodes that this node's training tasks finished ({e})")

    def _tell_peers_abort(self, description: str) -> None:
        if self.peers is not None:
            try:
                self.peers.abort(description)
            except PeerError:
                pass
