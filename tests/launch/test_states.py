"""Every transition of the supervisor's state machine, one handler call each, with fake tasks: no process.

The real processes are in test_supervisor.py; here each state method gets a state and fake tasks whose exit
statuses the test sets, and the state it returns is checked.
"""

from __future__ import annotations

import collections
import io
import json
import signal
import time
from types import SimpleNamespace

import pytest

import conveyor.launch.supervisor as supervisor_module
from conveyor.cluster import TaskId
from conveyor.errors import PeerError
from conveyor.launch import states as st
from conveyor.launch.failures import Signature
from conveyor.launch.restarts import RestartPolicy
from conveyor.launch.supervisor import Supervisor
from conveyor.train.checkpoint import CheckpointManager


class FakeTask:
    """What the supervisor reads of a RunningTask: its launch, its process's status, its tail."""

    def __init__(self, kind: str, index: int, log_dir: str, code: int | None = None, tail: tuple[str, ...] = ()):
        self.launch = SimpleNamespace(task=TaskId(kind, index), log_path=f"{log_dir}/{kind}-{index}.log")
        self.proc = SimpleNamespace(pid=1000 + index, returncode=code, poll=lambda: self.proc.returncode)
        self.tail = collections.deque(tail)
        self.pump = SimpleNamespace(join=lambda timeout: None)
        self.name = f"{kind}:{index}"

    def poll(self) -> int | None:  # RunningTask.poll: the status as the job counts it
        return self.proc.returncode

    def exit(self, code: int) -> None:
        self.proc.returncode = code


class Peers:
    """A scripted other node: each answer is an attribute the test sets."""

    timeout = 5.0

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.abort_reason: str | None = None
        self.failure_message: str | None = None
        self.success = self.everyone_done = self.everyone_stopped = False
        self.broken = False

    def _call(self, *call):
        if self.broken:
            raise PeerError("node 1's launcher did not answer within 5 s")
        self.calls.append(call)

    def aborted(self):
        self._call("aborted")
        return self.abort_reason

    def failure(self, attempt):
        self._call("failure", attempt)
        return self.failure_message

    def succeeded(self, attempt):
        self._call("succeeded", attempt)
        return self.success

    def all_done(self, attempt):
        self._call("all_done", attempt)
        return self.everyone_done

    def all_stopped(self, attempt):
        self._call("all_stopped", attempt)
        return self.everyone_stopped

    def __getattr__(self, name):  # report_failure, report_done, report_stopped, report_succeeded, ...
        if not name.startswith(("report_", "abort")):
            raise AttributeError(name)
        return lambda *args: self._call(name, *args)


@pytest.fixture
def plan(tmp_path):
    logs = tmp_path / "logs"
    tasks = tuple(SimpleNamespace(task=TaskId("worker", i), log_path=str(logs / f"worker-{i}.log")) for i in (0, 1))
    return SimpleNamespace(tasks=tasks, log_dir=str(logs), node_rank=0, strategy="",  # the default, allreduce
                           checkpoint_dir=str(tmp_path / "checkpoints"))


def make(plan, peers=None, **kwargs):
    err = io.StringIO()
    kwargs.setdefault("policy", RestartPolicy(max_restarts=3, delay=0.5, delay_cap=4.0))
    sup = Supervisor(plan, out=io.StringIO(), err=err, peers=peers, poll=0.001, peer_poll=0.0, **kwargs)
    return sup, err


def workers(plan, *codes, kinds=("worker", "worker")):
    return tuple(FakeTask(k, i, plan.log_dir, c) for i, (k, c) in enumerate(zip(kinds, codes, strict=True)))


# -- st.Starting ---------------------------------------------------------------------------------------


def test_starting_starts_every_task_and_notes_the_latest_checkpoint(plan, monkeypatch, tmp_path):
    CheckpointManager(tmp_path / "checkpoints", fsync=False).save(40, {})  # a sealed step, as the chief writes
    (tmp_path / "logs").mkdir()
    stale = tmp_path / "logs" / "worker-1.failure.json"
    stale.write_text("{}")
    started = []
    fake = SimpleNamespace(start=lambda launch, attempt, console: started.append(attempt) or FakeTask(
        launch.task.type, launch.task.index, plan.log_dir))
    monkeypatch.setattr(supervisor_module, "RunningTask", fake)
    sup, err = make(plan)
    state = sup._starting(st.Starting(2))
    assert isinstance(state, st.Running) and state.attempt == 2 and state.start_step == 40
    assert [t.name for t in state.tasks] == ["worker:0", "worker:1"] and started == [2, 2]
    assert not stale.exists()  # an earlier attempt's report must not describe this one
    assert "attempt 2: started worker:0 pid 1000, worker:1 pid 1001" in err.getvalue()


# -- st.Running ----------------------------------------------------------------------------------------


def test_running_stays_running_while_the_tasks_run(plan):
    sup, _ = make(plan)
    state = st.Running(0, workers(plan, None, 0), None)
    assert sup._running(state) is state


def test_running_fails_when_a_task_exits_non_zero(plan):
    sup, _ = make(plan)
    state = sup._running(st.Running(1, workers(plan, None, 3), 7))
    assert state == st.Failed(1, 7, "task", st.TaskExit("worker:1", 3, f"{plan.log_dir}/worker-1.log"))


def test_running_lingers_once_every_worker_exited_zero(plan):
    sup, _ = make(plan)
    tasks = workers(plan, 0, 0, None, kinds=("worker", "worker", "ps"))
    state = sup._running(st.Running(0, tasks, None))
    assert isinstance(state, st.Lingering) and state.tasks == tasks and not state.reported


def test_running_with_a_chief_lingers_when_the_chief_exits_zero_and_tells_the_peers(plan):
    peers = Peers()
    sup, _ = make(plan, peers)
    state = sup._running(st.Running(0, workers(plan, 0, None, kinds=("chief", "worker")), None))
    assert isinstance(state, st.Lingering) and ("report_succeeded", 0) in peers.calls


def test_running_without_a_chief_on_several_nodes_waits_for_the_others_trained(plan):
    peers = Peers()
    sup, _ = make(plan, peers)
    state = sup._running(st.Running(0, workers(plan, 0, 0), None))
    assert isinstance(state, st.Running) and state.trained and ("report_trained", 0) in peers.calls
    peers.success = True
    assert isinstance(sup._running(state), st.Lingering)


def test_running_fails_with_a_peers_failure(plan):
    peers = Peers()
    peers.failure_message = "worker:3 exited with status 1 on node 1 (log: x there)"
    sup, _ = make(plan, peers)
    state = sup._running(st.Running(4, workers(plan, None, None), None))
    assert state == st.Failed(4, None, "peer", message=peers.failure_message)


@pytest.mark.parametrize("how", ["aborted", "unreachable"])
def test_running_fails_for_good_when_another_node_aborted_or_cannot_be_reached(plan, how):
    peers = Peers()
    peers.abort_reason, peers.broken = ("node 1's launcher was stopped by SIGINT", False) if how == "aborted" else (
        None, True)
    sup, _ = make(plan, peers)
    state = sup._running(st.Running(0, workers(plan, None, None), None))
    assert isinstance(state, st.Failed) and state.kind == "final"
    assert ("SIGINT" if how == "aborted" else "did not answer") in state.message


def test_running_is_interrupted_by_a_signal_and_tells_the_peers(plan):
    peers = Peers()
    sup, _ = make(plan, peers)
    sup._signals.received.append(signal.SIGTERM)
    assert sup._running(st.Running(2, workers(plan, None, 1), None)) == st.Interrupted(2, signal.SIGTERM)
    assert ("abort", "node 0's launcher was stopped by SIGTERM") in peers.calls


# -- st.Lingering (succeeded, servers still running) ---------------------------------------------------


def test_lingering_waits_for_the_servers_then_is_done(plan):
    sup, _ = make(plan, linger=60.0)
    tasks = workers(plan, 0, None, kinds=("worker", "ps"))
    state = st.Lingering(0, tasks, None, since=time.monotonic())
    assert sup._lingering(state) is state
    tasks[1].exit(0)
    assert sup._lingering(state) == st.Done(0)


def test_lingering_too_long_stops_the_servers(plan):
    sup, err = make(plan, linger=0.0)
    state = st.Lingering(0, workers(plan, 0, None, kinds=("worker", "ps")), None, since=0.0)
    assert sup._lingering(state) == st.Done(0)
    assert "ps:1 still running 0 s after every training task finished; stopping it" in err.getvalue()


def test_lingering_on_several_nodes_reports_done_then_waits_for_every_node(plan):
    peers = Peers()
    sup, _ = make(plan, peers)
    state = sup._lingering(st.Lingering(3, workers(plan, 0, 0), None, since=0.0))
    assert isinstance(state, st.Lingering) and state.reported and ("report_done", 3) in peers.calls
    peers.everyone_done = True
    assert sup._lingering(state) == st.Done(3)


def test_lingering_ignores_a_late_task_failure_but_says_so(plan):
    sup, err = make(plan)
    assert sup._lingering(st.Lingering(0, workers(plan, 0, 1), None, since=0.0)) == st.Done(0)
    assert "worker:1 exited with status 1 after every training task finished; the job succeeded" in err.getvalue()


# -- st.Failed -----------------------------------------------------------------------------------------


def test_failed_restarts_after_the_policys_pause(plan):
    sup, err = make(plan)
    failure = st.TaskExit("worker:1", 1, f"{plan.log_dir}/worker-1.log", ("RuntimeError: boom",))
    assert sup._failed(st.Failed(0, None, "task", failure)) == st.Restarting(1, 0.5)
    assert "worker:1 exited with status 1; restarting the job from the beginning (no checkpoint yet) in 0.5 s " \
           "(restart 1 of 3)" in err.getvalue()
    assert sup._history[-1].signature == Signature("exited with status 1", "RuntimeError: boom")


def test_failed_for_good_gives_up_without_asking_the_policy(plan):
    sup, _ = make(plan)
    assert sup._failed(st.Failed(2, None, "final", message="lost node 1")) == st.GaveUp(2, None, "lost node 1")
    assert sup._history == ()


def test_failed_with_a_usage_error_gives_up_at_once(plan):
    sup, _ = make(plan)
    lines = ("usage: train.py [-h] [--epochs EPOCHS]", "train.py: error: unrecognized arguments: --epocs 1")
    state = sup._failed(st.Failed(0, None, "task", st.TaskExit("worker:0", 2, f"{plan.log_dir}/worker-0.log", lines)))
    assert isinstance(state, st.GaveUp) and "unrecognized arguments: --epocs 1" in state.message


def test_a_reported_configuration_error_on_alternating_tasks_is_one_failure(plan, tmp_path):
    """The same error, struck first by worker 1, then 0, then 1: the third time ends the job."""
    (tmp_path / "logs").mkdir()
    sup, _ = make(plan)
    report = {"format": "conveyor.failure", "version": 1, "type": "conveyor.train.checkpoint.CheckpointError",
              "message": "checkpoint step-00000010 is damaged", "usage": False}
    states = []
    for attempt, task in enumerate((1, 0, 1)):
        log = f"{plan.log_dir}/worker-{task}.log"
        (tmp_path / "logs" / f"worker-{task}.failure.json").write_text(json.dumps(report))
        states.append(sup._failed(st.Failed(attempt, None, "task", st.TaskExit(f"worker:{task}", 1, log,
                                                                          (f"rank {task} saw it",)))))
    assert isinstance(states[0], st.Restarting) and isinstance(states[1], st.Restarting)
    assert isinstance(states[2], st.GaveUp) and "the same way 3 times in a row" in states[2].message
    assert "'checkpoint step-00000010 is damaged'" in states[2].message


def test_a_peers_failure_is_weighed_by_the_signature_it_sent(plan):
    sup, _ = make(plan)
    description = ("worker:3 exited with status 1 on node 1 (log: x there)\nlast 1 lines of x:\n  | SplitError: no\n"
                   'failure signature: {"what": "SplitError", "gist": "no", "usage": true}')
    state = sup._failed(st.Failed(0, None, "peer", message=description))
    assert isinstance(state, st.GaveUp) and state.failure is None
    assert state.message.startswith("worker:3 exited with status 1 on node 1 (log: x there): a usage or configuration")


def test_failed_after_max_restarts_gives_up(plan):
    sup, _ = make(plan, policy=RestartPolicy(max_restarts=0))
    state = sup._failed(st.Failed(0, None, "task", st.TaskExit("worker:1", -9, f"{plan.log_dir}/worker-1.log")))
    assert state == st.GaveUp(0, st.TaskExit("worker:1", -9, f"{plan.log_dir}/worker-1.log"),
                           "worker:1 was killed by SIGKILL; gave up after 0 restart(s) (--max-restarts 0)")


# -- st.Restarting, and the ends -----------------------------------------------------------------------


def test_restarting_pauses_then_starts_the_next_attempt(plan):
    sup, _ = make(plan)
    assert sup._restarting(st.Restarting(2, 0.0)) == st.Starting(2)


def test_restarting_is_interrupted_by_a_signal(plan):
    sup, _ = make(plan)
    sup._signals.received.append(signal.SIGINT)
    assert sup._restarting(st.Restarting(2, 30.0)) == st.Interrupted(1, signal.SIGINT)


def test_the_end_states_give_the_job_result():
    failure = st.TaskExit("worker:1", 1, "/l")
    assert st.Done(2).result() == st.JobResult(ok=True, restarts=2)
    assert st.GaveUp(1, failure, "why").result() == st.JobResult(ok=False, restarts=1, failure=failure, message="why")
    interrupted = st.Interrupted(0, signal.SIGINT).result()
    assert interrupted.exit_code == 130 and interrupted.message == "interrupted by SIGINT"
    assert st.JobResult(ok=False, restarts=0).exit_code == 1


def test_leaving_an_attempt_stops_its_tasks_and_completes_the_failed_tasks_tail(plan, monkeypatch):
    stopped = []
    monkeypatch.setattr(supervisor_module, "stop_tasks", lambda tasks, *a: stopped.extend(tasks))
    sup, _ = make(plan)
    tasks = workers(plan, None, 1)
    sup._tasks = list(tasks)
    tasks[1].tail.extend(["a", "b"])
    state = sup._leave_attempt(st.Failed(0, None, "task", st.TaskExit("worker:1", 1, tasks[1].launch.log_path)))
    assert stopped == list(tasks) and sup._tasks == []
    assert state.failure.last_lines == ("a", "b")


def test_leaving_an_attempt_on_several_nodes_waits_until_every_node_stopped(plan, monkeypatch):
    monkeypatch.setattr(supervisor_module, "stop_tasks", lambda *a: None)
    peers = Peers()
    peers.everyone_stopped = True
    sup, _ = make(plan, peers)
    failed = st.Failed(0, None, "peer", message="worker:3 exited with status 1 on node 1")
    assert sup._leave_attempt(failed) == failed and ("report_stopped", 0) in peers.calls
    peers.everyone_stopped, peers.abort_reason = False, "lost node 1"
    assert sup._leave_attempt(failed) == st.Failed(0, None, "final", message="lost node 1")
