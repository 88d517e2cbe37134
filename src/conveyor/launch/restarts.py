"""When a failed job starts again: how often, after what pause, and when restarting cannot help.

    policy = RestartPolicy(max_restarts=3, delay=1.0, delay_cap=30.0, same_failure_limit=3)
    streak = FailureStreak()
    streak.add((what, last_line(lines)), latest_step(checkpoint_dir))
    if streak.same >= policy.same_failure_limit: ...        # give up: it would fail the same way again
    time.sleep(policy.delay_after(streak))                  # doubles per failure without progress, capped

Progress is a new checkpoint step folder, seen by name only (this layer does not import the training
code). Why: ``docs/launcher.md``, "The supervisor: success, failure, restarts".
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["FailureStreak", "RestartPolicy", "last_line", "latest_step", "repeated_failure", "resume_point"]

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


def last_line(lines: Iterable[str]) -> str:
    """The last non-blank line of a task's output (a peer's ``  | `` quoting removed): its failure's gist."""
    for line in reversed(list(lines)):
        if line.strip():
            return line.strip().removeprefix("| ").strip()
    return ""


@dataclass
class FailureStreak:
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


@dataclass(frozen=True)
class RestartPolicy:
    """``max_restarts`` restarts at most; the first after ``delay`` seconds, doubled after each further
    failure without progress, at most ``delay_cap``; ``same_failure_limit`` identical failures in a row
    without progress end the job early."""

    max_restarts: int = 3
    delay: float = 1.0
    delay_cap: float = 30.0
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

    def delay_after(self, streak: FailureStreak) -> float:
        """The pause before the restart that follows ``streak``'s latest failure."""
        return min(self.delay_cap, self.delay * 2 ** (streak.without_progress - 1))

    def gives_up(self, streak: FailureStreak) -> bool:
        """Whether the latest failure repeated itself often enough that a restart would only hide its cause."""
        return streak.same >= self.same_failure_limit


def resume_point(step: int | None, node_rank: int) -> str:
    """Where a restarted job continues, as the launcher of node ``node_rank`` can tell."""
    if step is not None:
        return f"from its latest checkpoint (step {step})"
    if node_rank == 0:  # the chief (rank 0), the one that writes checkpoints, runs here
        return "from the beginning (no checkpoint yet)"
    return "from the chief's latest checkpoint on node 0, if it wrote one"


def repeated_failure(what: str, last: str, times: int, log_path: str | None, checkpoint_dir: str) -> str:
    """Why the job ends early: ``what`` failed the same way ``times`` times in a row without progress."""
    where = f"see {log_path}" if log_path is not None else "see that task's log"
    return (f"{what} the same way {times} times in a row without progress (no new checkpoint): {last!r}; "
            f"not restarting again, since a restart would fail the same way: fix the cause ({where}) - a "
            f"damaged checkpoint can be moved out of {checkpoint_dir} - and run the job again")
