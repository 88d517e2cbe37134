"""When to checkpoint: every N steps and/or every T seconds (`conveyor.train.checkpoint.store` writes them)."""

from __future__ import annotations

import time


class CheckpointPolicy:
    """Save every `every_steps` steps and/or every `every_seconds` seconds, whichever comes first.

    Step-based saves land on multiples of `every_steps` (step-00001000, step-00002000, ...) so folder
    names line up across restarts. The seconds clock starts at the first `should_save` call and
    restarts at every save. `should_save` records a save when it returns True: call it once per
    step, after the optimizer step, with `step` = the number of steps done.
    """

    def __init__(self, every_steps: int | None = None, every_seconds: float | None = None):
        if every_steps is not None and (
            isinstance(every_steps, bool) or every_steps != int(every_steps) or every_steps < 1
        ):
            raise ValueError(f"every_steps must be a positive integer or None, got {every_steps!r}")
        if every_seconds is not None and not every_seconds > 0:
            raise ValueError(f"every_seconds must be positive or None, got {every_seconds!r}")
        self.every_steps = None if every_steps is None else int(every_steps)
        self.every_seconds = None if every_seconds is None else float(every_seconds)
        self._last_step: int | None = None
        self._last_time: float | None = None

    def should_save(self, step: int, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        if self._last_time is None:
            self._last_time = now
        if step == self._last_step:
            return False
        due = bool(self.every_steps and step > 0 and step % self.every_steps == 0)
        due = due or (self.every_seconds is not None and now - self._last_time >= self.every_seconds)
        if due:
            self._last_step, self._last_time = step, now
        return due
