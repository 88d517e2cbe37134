"""Start a plan's tasks on this machine, relay their output, restart the job when a task dies.

    result = Supervisor(plan, policy=RestartPolicy(max_restarts=3)).run()     # until the job ends
    sys.exit(result.exit_code)      # 0, 1 (failed for good), 130/143 (interrupted)

What it promises: every task runs in its own process group, and stopping the job (a failure, Ctrl-C,
SIGTERM) stops every group - SIGTERM, ``grace`` seconds, SIGKILL - and, on Linux, a launcher killed
outright takes its tasks with it. Each task's output goes to ``<output>/logs/<type>-<index>.log`` and,
prefixed ``[worker:1]``, to stdout. The job succeeds as Kubeflow's TFJob does (the chief exits 0, or
without a chief every worker); a failure before that restarts the whole job as :func:`.restarts.decide`
says: up to ``max_restarts`` times with a growing pause, never for a usage error, and not again when
the same failure (by what failed, not which task: :mod:`.failures`) repeats without a new checkpoint.
A worker of a ``ps-async``/``ps-ssp:K`` job other than the chief is restarted alone (counted the same way; the
ps tasks and the other workers go on; docs/ps.md, "A worker restarted alone"). A data worker
(``conveyor run --data-workers K``) that exits is no failure: it is started again, at most
``DATA_WORKER_RESTARTS`` times per attempt, and listed in ``data_worker_exits`` (docs/data-service.md).
The states it moves through: :mod:`.states`. Across machines the launchers coordinate through
:class:`Peers` (``launch/rendezvous.py``). :meth:`Supervisor.run` must run on a thread that outlives the
tasks (the main thread). The design: ``docs/launcher.md``, "The supervisor: success, failure, restarts".
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from typing import IO, Any, Protocol

from conveyor.cluster.failure_report import finished_path, read_report, report_path
from conveyor.cluster.spec import DATA_JOBS
from conveyor.cluster.strategy_name import parse_strategy
from conveyor.errors import PeerError  # re-exported: its old home
from conveyor.launch.failures import exit_status, peer_signature, signature, signature_line
from conveyor.launch.plan import DATA_WORKER_RESTARTS, LaunchPlan
from conveyor.launch.restarts import Failure, RestartPolicy, Stop, decide, latest_step, resume_point, stop_message
from conveyor.launch.states import (
    Done,
    Failed,
    GaveUp,
    Interrupted,
    JobResult,
    Lingering,
    Regroup,
    Restarting,
    Running,
    Starting,
    State,
    TaskExit,
)
from conveyor.launch.tasks import Console, RunningTask, stop_tasks
from conveyor.recovery import fault_time, note_restart

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

    def regroup(self) -> str | None:
        """Elastic membership (``launch/elastic.py``): why the job must be re-formed now, else None. Optional:
        peers without it never regroup."""

    @property
    def timeout(self) -> float:
        """Seconds to wait for the other nodes at a barrier before giving up."""


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
        return chief[0].poll() == 0
    training = [rt for rt in running if rt.launch.task.is_training]
    return bool(training) and all(rt.poll() == 0 for rt in training)


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
    (TensorFlow's serving tasks never do). ``peers`` coordinates with the other nodes of a multi-node job.
    ``policy`` (:class:`~.restarts.RestartPolicy`) says when to restart; ``max_restarts``, ``restart_delay``,
    ``restart_delay_cap`` and ``same_failure_limit``, where given, replace its fields. ``first_attempt`` and
    ``history`` continue an elastic job in its next membership round (:attr:`history`: the failures restarted
    so far, which ``max_restarts`` counts; a membership change is none; ``recovering``: the last round's
    :attr:`recovering`, recorded when this round's tasks start, on node 0). The job moves through
    the states of :mod:`.states`, one method each; :func:`~.restarts.decide` weighs each failure.
    Long because it is the state machine: eight states, one method each, and the peer calls they make.
    """

    def __init__(
        self,
        plan: LaunchPlan,
        *,
        policy: RestartPolicy | None = None,
        max_restarts: int | None = None,
        grace: float = 5.0,
        linger: float = 30.0,
        poll: float = 0.05,
        peer_poll: float = 0.2,
        out: IO[str] | None = None,
        err: IO[str] | None = None,
        peers: Peers | None = None,
        restart_delay: float | None = None,
        restart_delay_cap: float | None = None,
        same_failure_limit: int | None = None,
        first_attempt: int = 0,
        history: tuple[Failure, ...] = (),
        recovering: Mapping[str, Any] | None = None,
    ) -> None:
        given = {"max_restarts": max_restarts, "delay": restart_delay, "delay_cap": restart_delay_cap,
                 "same_failure_limit": same_failure_limit}
        self.policy = replace(policy or RestartPolicy(), **{k: v for k, v in given.items() if v is not None})
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
        self._tasks: list[RunningTask] = []  # the current attempt's, until they are stopped
        self._first = (first_attempt, tuple(history))
        self._history: tuple[Failure, ...] = ()  # the failures restarted so far, oldest first
        self._next_peer_check = 0.0
        # the failure (or membership change) being recovered from: its moments (conveyor/recovery.py)
        self._recovery: dict = dict(recovering or {})
        parsed = parse_strategy(plan.strategy) if plan.strategy else None
        self._runs_apart = parsed is not None and parsed.uses_ps and parsed.mode != "sync"  # ps-async, ps-ssp:K
        #: every data worker that exited while the job ran: task, attempt, status, restarted, log (summary.json)
        self.data_worker_exits: list[dict] = []

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
        handlers = {Starting: self._starting, Running: self._running, Lingering: self._lingering,
                    Failed: self._failed, Restarting: self._restarting}
        attempt, self._history = self._first
        state: State = Starting(attempt)
        try:
            while not isinstance(state, (Done, GaveUp, Interrupted, Regroup)):
                new = handlers[type(state)](state)
                if self._tasks and not isinstance(new, (Running, Lingering)):
                    new = self._leave_attempt(new)
                elif type(new) is type(state) and isinstance(new, (Running, Lingering)):
                    self._signals.wake.wait(self.poll)  # nothing changed: look again in a moment
                state = new
        finally:
            self._stop_tasks()  # an exception (a task that could not start) leaves no task behind
        if isinstance(state, Interrupted):
            self._tell_peers_abort(f"node {self.plan.node_rank}'s launcher was stopped by {state.name}")
            self._say(f"stopped every task ({state.name})")
        return state.result()

    # -- one method per state -------------------------------------------------------------------

    def _starting(self, s: Starting) -> Running:
        start_step = latest_step(self.plan.checkpoint_dir)
        # restarts after failures differ from attempts only once an elastic job has changed its membership
        failures = {"failures": len(self._history)} if self._regroup_of() is not None else {}
        started = time.time()
        for launch in self.plan.tasks:
            for stale in (report_path(launch.log_path), finished_path(launch.log_path)):
                with contextlib.suppress(OSError):  # an earlier attempt's record would describe this one
                    os.remove(stale)
            self._tasks.append(RunningTask.start(launch, s.attempt, self._console, **failures))
        pids = ", ".join(f"{r.name} pid {r.proc.pid}" for r in self._tasks)
        self._say(f"attempt {s.attempt}: started {pids}; logs in {self.plan.log_dir}")
        recovering, self._recovery = self._recovery, {}
        # summary.json's recovery block: the chief (node 0's) reads it; one writer, as the output folder may be
        # shared by every node (each appending made one entry per node)
        if "stopped" in recovering and self.plan.node_rank == 0:
            note_restart(self.plan.log_dir, attempt=s.attempt, started=started, **recovering)
        self._next_peer_check = 0.0
        return Running(s.attempt, tuple(self._tasks), start_step)

    def _running(self, s: Running) -> State:
        if self._signals.received:
            return self._interrupt(s.attempt)
        if not s.trained and _ended(list(s.tasks)):
            if self.peers is None or _has_chief(list(s.tasks)):
                if self.peers is not None:
                    self._tell_peers_succeeded(s.attempt)
                return Lingering(s.attempt, s.tasks, s.start_step, since=time.monotonic())
            self._tell_peers_trained(s.attempt)  # the job has succeeded once every node's have (Peers.succeeded)
            s = replace(s, trained=True)
        for rt in s.tasks:
            code = rt.poll()
            if code is not None and rt.launch.task.type == "data_worker":  # not the job's failure: its splits
                return self._data_worker_died(s, rt, code)  # go to the others (docs/data-service.md)
            if code is not None and code != 0 and self._alone(rt):  # ps-async/ssp: the others go on (docs/ps.md)
                return self._restart_alone(s, rt, code)
            if code is not None and code != 0:
                failure = TaskExit(rt.name, code, rt.launch.log_path)
                self._recovery = {"task": rt.name, "seen": time.time()}
                self._report_failure(s.attempt, rt, failure)
                return Failed(s.attempt, s.start_step, "task", failure)
        return self._ask_peers(s)

    def _lingering(self, s: Lingering) -> State:
        """The job has succeeded; how the other tasks end no longer matters."""
        if self._signals.received:
            return self._interrupt(s.attempt)
        if not s.reported:
            # the data service's tasks serve until stopped: nothing to wait for once the training is over
            rest = [rt for rt in s.tasks if rt.proc.poll() is None and rt.launch.task.type not in DATA_JOBS]
            if rest and time.monotonic() - s.since > self.linger:
                self._say(f"{', '.join(rt.name for rt in rest)} still running {self.linger:g} s after "
                          f"{_end_condition(self.plan)}; stopping {'it' if len(rest) == 1 else 'them'}")
                rest = []
            if not rest:
                self._note_late_failures(s.tasks)
                if self.peers is None:
                    return Done(s.attempt)
                try:
                    self.peers.report_done(s.attempt)
                except PeerError as e:
                    return Failed(s.attempt, s.start_step, "final", message=str(e))
                s = replace(s, reported=True)
        return self._ask_peers(s)

    def _failed(self, s: Failed) -> GaveUp | Restarting:
        if s.kind == "final":
            return GaveUp(s.attempt, s.failure, s.message)
        failure = self._weigh(s)
        decision = decide(failure, self._history, self.policy)
        if isinstance(decision, Stop):
            return GaveUp(s.attempt, s.failure, stop_message(decision, failure, self.policy, self.plan.checkpoint_dir))
        self._history = (*self._history, failure)
        self._say(f"{failure.what}; restarting the job {resume_point(failure.step, self.plan.node_rank)} in "
                  f"{decision.delay:g} s (restart {decision.number} of {self.policy.max_restarts})")
        return Restarting(s.attempt + 1, decision.delay)

    def _restarting(self, s: Restarting) -> Starting | Interrupted:
        if self._signals.wait(s.delay, self.poll):
            return Interrupted(s.attempt - 1, self._signals.received[0])
        return Starting(s.attempt)

    # -- what the states share ------------------------------------------------------------------

    def _data_worker_died(self, s: Running, rt: RunningTask, code: int) -> Running:
        """A data worker exited: the dispatcher gives its unacknowledged splits to the others (exactly once), and
        it is started again, at most ``DATA_WORKER_RESTARTS`` times per attempt; then the job goes on without it."""
        restarts = sum(1 for e in self.data_worker_exits if e["task"] == rt.name and e["attempt"] == s.attempt)
        again = restarts < DATA_WORKER_RESTARTS
        self.data_worker_exits.append({"task": rt.name, "attempt": s.attempt, "status": exit_status(code),
                                       "restarted": again, "log": rt.launch.log_path})
        self._say(f"{rt.name} {exit_status(code)}; the dispatcher gives its splits to the other data workers; "
                  + (f"starting it again ({restarts + 1} of {DATA_WORKER_RESTARTS})" if again else
                     f"not started again ({DATA_WORKER_RESTARTS} restarts already): the job goes on without it"))
        rt.pump.join(timeout=1.0)
        new = RunningTask.start(rt.launch, s.attempt, self._console) if again else None
        kept = [t if t is not rt else new for t in self._tasks]
        self._tasks = [t for t in kept if t is not None]
        tasks = tuple(new if t is rt else t for t in s.tasks)
        return replace(s, tasks=tuple(t for t in tasks if t is not None))

    def _alone(self, rt: RunningTask) -> bool:
        """Whether ``rt``, which failed, is restarted by itself: a worker other than the chief (rank 0, which writes
        the checkpoints) of a ps-async/ps-ssp job whose membership is fixed. A ps task holds state nobody else has,
        and ps-sync's every step waits for every worker: those restart the whole job."""
        task = rt.launch.task
        return (self._runs_apart and task.type == "worker" and self.plan.spec.rank_of(task) != 0
                and self._regroup_of() is None)

    def _restart_alone(self, s: Running, rt: RunningTask, code: int) -> State:
        """Start a dead ps-async/ssp worker again by itself, counted against ``max_restarts`` like any restart: the
        ps tasks and the other workers keep running, and the new process (``CONVEYOR_REJOIN=1``) takes the dead
        one's step and data position from the servers. When the policy says stop, the job fails as for any task."""
        rt.pump.join(timeout=1.0)  # its last lines: the failure's signature, the fault hook's time
        seen = time.time()
        exited = TaskExit(rt.name, code, rt.launch.log_path, tuple(rt.tail))
        failure = self._weigh(Failed(s.attempt, s.start_step, "task", exited))
        decision = decide(failure, self._history, self.policy)
        if isinstance(decision, Stop):
            self._recovery = {"task": rt.name, "seen": seen}
            return Failed(s.attempt, s.start_step, "task", exited)
        self._history = (*self._history, failure)
        self._say(f"{failure.what}; restarting {rt.name} alone in {decision.delay:g} s: the ps tasks and the other "
                  f"workers go on, and it rejoins them where the servers say it was (restart {decision.number} of "
                  f"{self.policy.max_restarts})")
        if self._signals.wait(decision.delay, self.poll):
            return self._interrupt(s.attempt)
        new = RunningTask.start(rt.launch, s.attempt, self._console, failures=len(self._history),
                                rejoin=len(self._history))
        note_restart(self.plan.log_dir, attempt=s.attempt, task=rt.name, seen=seen, stopped=seen, started=time.time(),
                     died=fault_time(rt.tail), alone=True)
        self._say(f"{rt.name} restarted alone: pid {new.proc.pid}")
        self._tasks = [new if t is rt else t for t in self._tasks]
        return replace(s, tasks=tuple(new if t is rt else t for t in s.tasks))

    def _interrupt(self, attempt: int) -> Interrupted:
        signum = self._signals.received[0]
        self._tell_peers_abort(f"node {self.plan.node_rank}'s launcher was stopped by {signal.Signals(signum).name}")
        return Interrupted(attempt, signum)

    def _stop_tasks(self) -> None:
        tasks, self._tasks = self._tasks, []
        # A second Ctrl-C: no more patience.
        stop_tasks(tasks, self.grace, lambda: len(self._signals.received) >= 2, self._say)

    def _leave_attempt(self, state: State) -> State:
        """Stop the attempt's tasks, complete a failed task's tail, and (several nodes) wait until every node
        has stopped before a restart."""
        tasks = self._tasks
        self._stop_tasks()
        if self._recovery:
            self._recovery["stopped"] = time.time()
        if isinstance(state, Failed) and state.kind == "task" and state.failure is not None:
            # The tail is complete only now that the pump threads have drained the pipes.
            rt = next(r for r in tasks if r.name == state.failure.task)
            state = replace(state, failure=replace(state.failure, last_lines=tuple(rt.tail)))
            self._recovery["died"] = fault_time(rt.tail)
        if (self.peers is not None and isinstance(state, Failed) and state.kind != "final"
                and len(self._history) < self.policy.max_restarts):
            state = self._sync_restart(self.peers, state)
        return state

    def _weigh(self, s: Failed) -> Failure:
        """The failure ``s`` as :func:`decide` sees it: what failed (its signature), and the progress made."""
        step = latest_step(self.plan.checkpoint_dir)
        if s.failure is not None:
            report = read_report(report_path(s.failure.log_path))
            sig = signature(s.failure.returncode, s.failure.last_lines, report)
            return Failure(s.failure.describe(), sig, step, s.start_step, s.failure.log_path)
        sig, description = peer_signature(s.message)  # a peer's description: a line, then that task's last lines
        what, _, details = description.partition("\n")
        return Failure(what, sig, step, s.start_step, None, details)

    def _ask_peers(self, s: Running | Lingering) -> State:
        """What the other nodes say (at most every ``peer_poll`` seconds): an abort, a failure, success."""
        if self.peers is None or time.monotonic() < self._next_peer_check:
            return s
        self._next_peer_check = time.monotonic() + self.peer_poll
        try:
            reason = self.peers.aborted()
            if reason:
                return Failed(s.attempt, s.start_step, "final", message=reason)
            message = self.peers.failure(s.attempt)
            if message:
                self._recovery = {"task": None, "seen": time.time()}
                return Failed(s.attempt, s.start_step, "peer", message=message)
            if isinstance(s, Running) and self.peers.succeeded(s.attempt):  # the chief's node or every node
                return Lingering(s.attempt, s.tasks, s.start_step, since=time.monotonic())
            if isinstance(s, Lingering) and s.reported and self.peers.all_done(s.attempt):
                return Done(s.attempt)
            regroup = self._regroup()
            if regroup:  # once the job has succeeded, a node lost or waiting no longer matters
                if isinstance(s, Running):
                    self._recovery = self._recovery or {"task": None, "seen": time.time()}
                    return Regroup(s.attempt, regroup)
                return Done(s.attempt)
        except PeerError as e:
            return Failed(s.attempt, s.start_step, "final", message=str(e))
        return s

    def _note_late_failures(self, running: tuple[RunningTask, ...]) -> None:
        """Say which tasks failed after the job had succeeded (or in the same instant): not a failure of the
        job, whose outcome the chief decides, but worth a line in case it hides a problem."""
        for rt in running:
            code = rt.poll()
            if code is not None and code != 0:
                self._say(f"{TaskExit(rt.name, code, rt.launch.log_path).describe()} after "
                          f"{_end_condition(self.plan)}; the job succeeded all the same (see {rt.launch.log_path})")

    def _report_failure(self, attempt: int, rt: RunningTask, failure: TaskExit) -> None:
        """Tell the other nodes at once (before stopping anything here), so the first failure - the likely
        cause - is the one every node reports, not a peer's collective that broke because of it. Its
        signature travels with it, so that every node weighs the same failure the same way."""
        if self.peers is None:
            return
        rt.pump.join(timeout=0.5)  # the task has exited: its last lines are on their way
        lines = "".join(f"\n  | {line}" for line in rt.tail)
        sig = signature(failure.returncode, tuple(rt.tail), read_report(report_path(failure.log_path)))
        description = (f"{failure.describe()} on node {self.plan.node_rank} (log: {failure.log_path} there)\n"
                       f"last {len(rt.tail)} lines of {failure.log_path}:{lines}\n{signature_line(sig)}")
        try:
            self.peers.report_failure(attempt, description)
        except PeerError:
            pass  # the barrier after the stop reports the lost peers

    def _sync_restart(self, peers: Peers, s: Failed) -> State:
        """Multi-node: before anyone restarts, every node must have stopped the failed attempt's tasks, or an
        old task could join the new attempt's process group."""
        try:
            peers.report_stopped(s.attempt)
            deadline = time.monotonic() + peers.timeout
            while not peers.all_stopped(s.attempt):
                if self._signals.received:
                    return Interrupted(s.attempt, self._signals.received[0])
                reason = peers.aborted()  # a node lost for good never reports stopped
                if reason:
                    return replace(s, kind="final", message=reason)
                regroup = self._regroup()  # elastic: the failure was the lost node's, or a joiner waits
                if regroup:
                    return Regroup(s.attempt, regroup)
                if time.monotonic() > deadline:
                    what = s.failure.describe() if s.failure else s.message.partition("\n")[0]
                    return replace(s, kind="final", message=f"{what}; then the other nodes did not stop their "
                                                            f"tasks within {peers.timeout:g} s")
                self._signals.wake.wait(self.peer_poll)
        except PeerError as e:
            return replace(s, kind="final", message=str(e))
        return s

    @property
    def recovering(self) -> dict:
        """The moments of the failure or membership change not yet restarted from (an elastic job's next round
        starts its tasks and records them: conveyor/recovery.py); empty when none."""
        return dict(self._recovery)

    @property
    def history(self) -> tuple[Failure, ...]:
        """The failures restarted so far, oldest first: what an elastic job's next round goes on counting."""
        return self._history

    def _regroup_of(self):
        return getattr(self.peers, "regroup", None)  # the peers of an elastic job's round; static ones have none

    def _regroup(self) -> str | None:
        regroup = self._regroup_of()
        return regroup() if regroup is not None else None

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
