"""When a failed job starts again: the restart settings, in this one place, and a pure decision per failure.

    policy = RestartPolicy.for_run(max_restarts=3, delay=1.0)     # `conveyor run`'s flags
    failure = Failure("worker:1 exited with status 2", sig, step=latest_step(d), start_step=step_at_start)
    decision = decide(failure, history, policy)     # Restart(delay, number) or Stop(reason, restarts, times)
    history = (*history, failure)                   # the failures that were restarted, oldest first

:func:`decide`'s rules, in this order: (1) a usage error (:class:`~.failures.Signature`) in an attempt that
wrote no checkpoint is never retried; (2) after ``max_restarts`` restarts the job ends; (3) the same
signature ``same_failure_limit`` times in a row without progress ends it early, whichever tasks it struck;
(4) otherwise it restarts after ``delay`` seconds, doubled per failure without progress, at most
``delay_cap``. Progress is a new checkpoint step folder, seen by name only (this layer does not import the
training code). Why: ``docs/launcher.md``, "The supervisor: success, failure, restarts".
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from conveyor.launch.failures import Signature

__all__ = ["DELAY_CAP", "Failure", "Restart", "RestartPolicy", "Stop", "decide", "latest_step", "resume_point",
           "stop_message"]

DELAY_CAP = 30.0  # seconds: the longest pause between attempts, unless the first pause is longer
_STEP_FOLDER = re.compile(r"step-(\d{8,})")


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


@dataclass(frozen=True)
class RestartPolicy:
    """``max_restarts`` restarts at most; the first after ``delay`` seconds, doubled after each further
    failure without progress, at most ``delay_cap``; ``same_failure_limit`` identical failures in a row
    without progress end the job early."""

    max_restarts: int = 3
    delay: float = 1.0
    delay_cap: float = DELAY_CAP
    same_failure_limit: int = 3

    def __post_init__(self) -> None:
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(f"max_restarts = {self.max_restarts!r}; expected a whole number >= 0")
        if not 0 <= self.delay <= self.delay_cap:
            raise ValueError(f"restart_delay = {self.delay!r}, restart_delay_cap = {self.delay_cap!r}; "
                             f"expected 0 <= restart_delay <= restart_delay_cap")
        limit = self.same_failure_limit
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"same_failure_limit = {limit!r}; expected a whole number >= 1")

    @classmethod
    def for_run(cls, max_restarts: int, delay: float) -> RestartPolicy:
        """``conveyor run --max-restarts N --restart-delay S``: pauses capped at :data:`DELAY_CAP`, or ``S``."""
        return cls(max_restarts, delay, max(DELAY_CAP, delay))

    def delay_after(self, without_progress: int) -> float:
        """The pause before the restart after the ``without_progress``-th failure in a row without progress."""
        return min(self.delay_cap, self.delay * 2 ** (without_progress - 1))


@dataclass(frozen=True)
class Failure:
    """One failed attempt, as :func:`decide` weighs it.

    ``what``: the line that names it (``worker:1 exited with status 1``; another node's adds where);
    ``step``: the latest checkpoint when it failed, ``start_step`` when its attempt started (None: none);
    ``log_path``: the failed task's log on this machine (None: another node's); ``details``: lines to show
    under the message (another node's quoted tail).
    """

    what: str
    signature: Signature
    step: int | None = None
    start_step: int | None = None
    log_path: str | None = None
    details: str = ""


@dataclass(frozen=True)
class Restart:
    """Start the job again after ``delay`` seconds; this is restart ``number`` (1 the first time)."""

    delay: float
    number: int


@dataclass(frozen=True)
class Stop:
    """End the job for good after ``restarts`` restarts: a usage error, restarts used up, or ``times``
    identical failures in a row without progress."""

    reason: Literal["usage", "exhausted", "repeated"]
    restarts: int
    times: int = 1


def decide(failure: Failure, history: Sequence[Failure], policy: RestartPolicy) -> Restart | Stop:
    """What to do after ``failure``, given the earlier failures that were restarted (``history``, oldest
    first); pure: the same arguments give the same decision. The rules: the module docstring."""
    restarts = len(history)
    if failure.signature.usage and failure.step == failure.start_step:
        return Stop("usage", restarts)
    if restarts >= policy.max_restarts:
        return Stop("exhausted", restarts)
    streak = 0  # the earlier failures since the last progress: same latest checkpoint as this one
    while streak < restarts and history[restarts - 1 - streak].step == failure.step:
        streak += 1
    same = 1
    while same <= streak and history[restarts - same].signature == failure.signature:
        same += 1
    if same >= policy.same_failure_limit:
        return Stop("repeated", restarts, same)
    return Restart(policy.delay_after(streak + 1), restarts + 1)


def stop_message(stop: Stop, failure: Failure, policy: RestartPolicy, checkpoint_dir: str) -> str:
    """Why the job ends: the decision ``stop`` about ``failure``, with the fix."""
    where = f"see {failure.log_path}" if failure.log_path is not None else "see that task's log"
    gist = failure.signature.gist
    if stop.reason == "usage":
        return (f"{failure.what}: a usage or configuration error, which a restart would meet again: {gist!r}; "
                f"not restarting: fix the command line or the configuration ({where}) and run the job again")
    if stop.reason == "repeated":
        return (f"{failure.what} the same way {stop.times} times in a row without progress (no new checkpoint): "
                f"{gist!r}; not restarting again, since a restart would fail the same way: fix the cause ({where}) "
                f"- a damaged checkpoint can be moved out of {checkpoint_dir} - and run the job again")
    why = f"gave up after {stop.restarts} restart(s) (--max-restarts {policy.max_restarts})"
    return f"{failure.what}; {why}" + (f"\n{failure.details}" if failure.details else "")


def resume_point(step: int | None, node_rank: int) -> str:
    """Where a restarted job continues, as the launcher of node ``node_rank`` can tell."""
    if step is not None:
        return f"from its latest checkpoint (step {step})"
    if node_rank == 0:  # the chief (rank 0), the one that writes checkpoints, runs here
        return "from the beginning (no checkpoint yet)"
    return "from the chief's latest checkpoint on node 0, if it wrote one"
