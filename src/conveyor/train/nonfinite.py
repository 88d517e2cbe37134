"""What the Trainer does about a NaN or infinite loss: `Trainer(..., nonfinite="stop")` (the default) or "skip".

    guard = NonfiniteGuard("stop", job, module)
    loss_fn = guard.wrap(loss_fn)           # "skip": a non-finite loss becomes a zero-gradient one
    guard.after_step(step, loss)            # "stop": NonfiniteError naming the step and the worker
    out.extra["finite"] = params_finite(module)   # at each checkpoint: rotation keeps the newest finite one

"stop" raises `NonfiniteError` on the worker whose loss is not finite, right after the step, before
anything is logged or checkpointed; the run exits non-zero. "skip" drops that worker's batch: its loss
is replaced by `0 * sum(parameters)`, so its gradients are exact zeros (the other workers' still
count, the workers stay in step), and each skip is warned about; a run that skips every batch of
`max_skips` in a row stops as "stop" does. The check costs one `isfinite` of the loss per step (a
device sync on a GPU) and one of the parameters per checkpoint. Why, and what a restart does:
`docs/training.md`, "Non-finite losses".
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch

from conveyor.errors import ConveyorError

__all__ = ["POLICIES", "NonfiniteError", "NonfiniteGuard", "params_finite"]

POLICIES = ("stop", "skip")


class NonfiniteError(ConveyorError, FloatingPointError):
    """A training loss was NaN or infinite; the message names the step, the worker and the fix.

    A usage error to the launcher: a restart from the last checkpoint (the newest with finite
    parameters is always kept) replays the same batches with the same parameters, so a NaN that comes
    from the data or the settings comes back; `conveyor run` restarts only when the failed attempt
    wrote a checkpoint (progress, which a passing fault such as a flaky device would allow), never
    after an attempt that made none.
    """

    usage_error = True


def check_policy(policy: Any, shares_batches: bool) -> str:
    """`policy`, checked against `POLICIES` and the strategy's step: where several processes share each batch
    (pipeline stages), one of them cannot drop a batch alone."""
    if policy not in POLICIES:
        raise ValueError(f"nonfinite must be one of {list(POLICIES)}, got {policy!r}")
    if policy == "skip" and shares_batches:
        raise ValueError("nonfinite='skip' cannot work under this strategy (its processes share each batch, "
                         "and the last one alone sees the loss); use nonfinite='stop'")
    return policy


def params_finite(module: torch.nn.Module) -> bool:
    """Whether every floating-point parameter and buffer of `module` is finite (what a checkpoint records)."""
    with torch.no_grad():
        for t in (*module.parameters(), *module.buffers()):
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                return False
    return True


class NonfiniteGuard:
    """The policy of one `fit()` (module docstring): `wrap` the loss function, then `after_step` every step."""

    def __init__(self, policy: str, job: Any, module: torch.nn.Module, max_skips: int = 10):
        self.policy, self.job, self.module, self.max_skips = policy, job, module, max_skips
        self.skipped_in_a_row = 0
        self.skipped = 0
        self._skipped_now = False

    def wrap(self, loss_fn: Callable) -> Callable:
        """`loss_fn` as the strategy should call it: unchanged under "stop"; under "skip", a non-finite loss
        is replaced by a zero whose gradient is exactly zero for every parameter."""
        if self.policy != "skip":
            return loss_fn

        def guarded(outputs: Any, targets: Any) -> torch.Tensor:
            loss = loss_fn(outputs, targets)
            if bool(torch.isfinite(loss.detach()).all()):
                return loss
            self._skipped_now = True
            params = [p for p in self.module.parameters() if p.requires_grad]
            return sum((p.sum() * 0.0 for p in params), torch.zeros((), device=loss.device))

        return guarded

    def after_step(self, step: int, loss: torch.Tensor) -> None:
        """Apply the policy to step `step`'s loss (this worker's batch mean)."""
        skipped, self._skipped_now = self._skipped_now, False
        if skipped:
            self._skip(step)
            return
        self.skipped_in_a_row = 0
        if self.policy == "stop" and not bool(torch.isfinite(loss).all()):
            value = float(loss.detach().float().mean())
            raise NonfiniteError(self._stop_message(step, value))

    def _skip(self, step: int) -> None:
        self.skipped += 1
        self.skipped_in_a_row += 1
        if self.skipped_in_a_row >= self.max_skips:
            raise NonfiniteError(self._stop_message(step, math.nan, f" in {self.skipped_in_a_row} steps in a row"))
        warnings.warn(f"step {step}: worker {self.job.rank}'s loss is not finite; its batch is skipped "
                      f"(nonfinite='skip'; {self.skipped} skipped so far)", stacklevel=3)

    def _stop_message(self, step: int, value: float, streak: str = "") -> str:
        return (f"step {step}: worker {self.job.rank}'s training loss is {value}{streak} (not finite), so the "
                f"parameters it updates are no longer usable; training stopped (nonfinite={self.policy!r}) before "
                f"this step was checkpointed. The newest checkpoint with finite parameters is kept under "
                f"{self.job.output_dir}/checkpoints. Common causes: a learning rate too high, a bad batch (NaN or "
                f"inf in the data), a loss that takes log(0); to drop such batches and go on, "
                f"Trainer(..., nonfinite='skip')")
