"""The supervisor's states, one type each; :class:`~.supervisor.Supervisor` has one method per state.

    Starting(a) ─► Running ─► Lingering ─► Done                      (the job succeeded)
                   Running │ Lingering ─► Failed ─► Restarting ─► Starting(a + 1)
                                          Failed ─► GaveUp            (restarts.decide said stop)
    Running │ Lingering │ Failed │ Restarting ─► Interrupted         (SIGINT/SIGTERM to the launcher)
    Running │ Failed ─► Regroup              (elastic: the membership changes; launch/elastic.py)

``Running``: attempt ``a``'s tasks run; ``trained`` once this node's training tasks all exited 0 in a
multi-node job without a chief (it then waits for ``Peers.succeeded``). ``Lingering``: the job has
succeeded (Kubeflow TFJob's policy) and the tasks still running (parameter servers) get ``linger`` seconds
to exit; ``reported``: this node told the others it is done and waits for them. ``Failed``: a task here
(``kind="task"``) or on another node (``"peer"``) failed - ``decide`` weighs it - or the job cannot go
on (``"final"``: another node aborted, or the nodes lost touch). Leaving ``Running``/``Lingering`` stops
every task of the attempt. ``Done``, ``GaveUp``, ``Interrupted`` and ``Regroup`` end the run: :meth:`result`.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Literal

from conveyor.launch.failures import exit_status
from conveyor.launch.tasks import RunningTask

__all__ = ["Done", "Failed", "GaveUp", "Interrupted", "JobResult", "Lingering", "Regroup", "Restarting", "Running",
           "Starting", "State", "TaskExit"]


@dataclass(frozen=True)
class TaskExit:
    """How a task ended: its exit status (negative: killed by that signal) and its last output lines."""

    task: str
    returncode: int
    log_path: str
    last_lines: tuple[str, ...] = ()

    def describe(self) -> str:
        return f"{self.task} {exit_status(self.returncode)}"


@dataclass(frozen=True)
class JobResult:
    """How the job ended. ``exit_code``: 0 success, 1 failed for good, 128 + signal when interrupted."""

    ok: bool
    restarts: int
    failure: TaskExit | None = None
    signal: int | None = None
    message: str = ""
    regroup: bool = False  # elastic: not an end; the launcher re-forms the job in the next membership round

    @property
    def exit_code(self) -> int:
        if self.ok:
            return 0
        return 128 + self.signal if self.signal else 1


@dataclass(frozen=True)
class Starting:
    attempt: int


@dataclass(frozen=True, eq=False)
class Running:
    attempt: int
    tasks: tuple[RunningTask, ...]
    start_step: int | None  # the latest checkpoint when the attempt started: later ones are progress
    trained: bool = False


@dataclass(frozen=True, eq=False)
class Lingering:
    attempt: int
    tasks: tuple[RunningTask, ...]
    start_step: int | None
    since: float  # time.monotonic() when the job succeeded
    reported: bool = False


@dataclass(frozen=True)
class Failed:
    attempt: int
    start_step: int | None
    kind: Literal["task", "peer", "final"]
    failure: TaskExit | None = None  # kind "task": the task here; its last lines once the attempt is stopped
    message: str = ""  # kind "peer": the other node's description; "final": why the job cannot go on


@dataclass(frozen=True)
class Restarting:
    attempt: int  # the attempt about to start
    delay: float


@dataclass(frozen=True)
class Done:
    attempt: int

    def result(self) -> JobResult:
        return JobResult(ok=True, restarts=self.attempt)


@dataclass(frozen=True)
class GaveUp:
    attempt: int
    failure: TaskExit | None
    message: str

    def result(self) -> JobResult:
        return JobResult(ok=False, restarts=self.attempt, failure=self.failure, message=self.message)


@dataclass(frozen=True)
class Interrupted:
    attempt: int
    signum: int

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    def result(self) -> JobResult:
        return JobResult(ok=False, restarts=self.attempt, signal=self.signum, message=f"interrupted by {self.name}")


@dataclass(frozen=True)
class Regroup:
    """Elastic membership: the job is re-formed without a lost node, or with a waiting one (``reason``)."""

    attempt: int
    reason: str

    def result(self) -> JobResult:
        return JobResult(ok=False, restarts=self.attempt, message=self.reason, regroup=True)


State = Starting | Running | Lingering | Failed | Restarting | Done | GaveUp | Interrupted | Regroup
