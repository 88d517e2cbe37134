"""One process, no communication: the strategy of a script run with plain ``python train.py``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from conveyor.strategies.base import Strategy, check_optimizer

__all__ = ["LocalStrategy"]


class LocalStrategy(Strategy):
    """Moves the model to the job's device and returns both objects unchanged; its step is the plain one."""

    name = "local"
    distributed = False

    def prepare(self, model: nn.Module, optimizer: Any, *, split: Sequence[str] | None = None
                ) -> tuple[nn.Module, Any]:
        check_optimizer(model, optimizer)
        return model.to(self.job.device), optimizer
