"""Stop the steps at a checkpoint when an elastic job re-forms to take a node in: no step is undone.

    drain = Drain.open(job, coord)    # None unless this is the chief of an elastic job's round (CONVEYOR_ROUND)
    drain.look()                      # before each step: asked? then every worker saves after the next step
    drain.park(saves)                 # after a save: sealed, then wait (bounded) for the launcher to stop the tasks

When a node waits to join, node 0's coordinator (``launch/elastic.py``) writes ``<output>/logs/drain``
(``{"round": r}``, :func:`conveyor.recovery.drain_path`) and re-forms the job at the next new checkpoint. The
chief of round ``r`` reads it (a ``stat`` at most every ``LOOK_SECONDS``), asks every worker through the step's
agreement to save after the next step (``Coordinator.request_save``), waits for that save's write, and then takes
no further step: the others wait in the next step's agreement. The coordinator sees the checkpoint and stops
every task, and the next round resumes from the step they stopped at. Without it the job would run on until the
launchers' SIGTERM, and every step past the checkpoint would be undone by the new round. The chief goes on by
itself when the request is withdrawn (the waiting node left) or after ``timeout / 2`` (the others' agreement waits
at most ``timeout``). Workers that run apart (ps-async, ps-ssp) cannot be asked: the job re-forms at their next
checkpoint as before. Why: docs/launcher.md, "Elastic membership".
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from conveyor.cluster.variables import ROUND_VAR
from conveyor.recovery import drain_path

__all__ = ["LOOK_SECONDS", "Drain"]

LOOK_SECONDS = 0.2
_PARK_POLL = 0.05


class Drain:
    """The chief's side of a drain (module docstring)."""

    def __init__(self, path: Path, round_number: int, coord: Any, timeout: float) -> None:
        self.path, self.round, self.coord, self.timeout = path, round_number, coord, timeout
        self.requested = False  # every worker was asked to save after the next step
        self._next_look = 0.0

    @classmethod
    def open(cls, job: Any, coord: Any) -> Drain | None:
        text = os.environ.get(ROUND_VAR, "")
        if not job.is_chief or not text.isdigit():
            return None
        return cls(drain_path(job.output_dir), int(text), coord, float(job.timeout))

    def asked(self) -> bool:
        """Whether node 0's launcher asks this round to stop (the file names this round)."""
        try:
            return int(json.loads(self.path.read_text(encoding="utf-8")).get("round", -1)) == self.round
        except (OSError, ValueError, TypeError, AttributeError):
            return False

    def look(self) -> None:
        if self.requested:
            return
        now = time.monotonic()
        if now < self._next_look:
            return
        self._next_look = now + LOOK_SECONDS
        if self.path.exists() and self.asked():
            self.requested = self.coord.request_save()

    def park(self, saves: Any) -> None:
        """After the save that answered the request: its write sealed, then no step until the launcher's SIGTERM,
        the request's withdrawal, or ``timeout / 2``."""
        if not self.requested:
            return
        saves.wait()
        print(f"[conveyor] a node waits to join: stopped at this checkpoint until round {self.round + 1} starts",
              flush=True)
        deadline = time.monotonic() + self.timeout / 2
        while self.asked() and time.monotonic() < deadline:
            time.sleep(_PARK_POLL)
        self.requested = False
        self._next_look = time.monotonic() + LOOK_SECONDS
