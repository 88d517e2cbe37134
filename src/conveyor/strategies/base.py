"""The interface every data-parallel strategy implements, so a training script never names one.

    strategy = get_strategy("allreduce")
    strategy.setup(job)                          # once, after the job's process group exists
    model, optimizer = strategy.prepare(model, optimizer)
    before = strategy.comm_seconds(); ...one step...; comm = strategy.comm_seconds() - before
    strategy.shutdown()

``conveyor.init()`` does the first two lines and ``job.prepare`` the third. The trainer asks the
strategy for its :meth:`~Strategy.coordinator` (how workers keep together), runs each step with
:meth:`~Strategy.train_step`, and reads ``comm_seconds()`` around it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from conveyor.strategies.coordination import Coordinator, LockstepCoordinator
from conveyor.train.checkpoint.items import Item, Model, Stateful

__all__ = ["Strategy", "check_optimizer"]


class Strategy(ABC):
    """One way of keeping several workers' models in step.

    ``name`` is the strategy's command-line name (``str(strategy)`` gives it too). ``distributed`` says
    whether it coordinates several training processes; ``conveyor.init()`` refuses a non-distributed
    strategy in a job with more than one, where each worker would silently train its own model.
    """

    name: ClassVar[str] = ""
    distributed: ClassVar[bool] = True

    def __init__(self) -> None:
        self._job: Any = None

    def setup(self, job: Any) -> None:
        """Bind to ``job`` (rank, world size, device, timeout). Called once, after the process group exists."""
        self._job = job

    @property
    def job(self) -> Any:
        if self._job is None:
            raise RuntimeError(f"strategy {self.name!r} is not set up: get it from conveyor.init() "
                               f"(job.strategy), or call strategy.setup(job) first")
        return self._job

    @abstractmethod
    def prepare(self, model: nn.Module, optimizer: Any) -> tuple[nn.Module, Any]:
        """Place ``model`` on the job's device and wrap what the strategy needs; return (model, optimizer)."""

    def shutdown(self) -> None:
        """Release what :meth:`setup`/:meth:`prepare` acquired (the process group itself belongs to the job)."""
        return None

    def comm_seconds(self) -> float:
        """Total wall time spent in gradient communication so far (seconds); see each strategy for details."""
        return 0.0

    def checkpoint_items(self, module: nn.Module, optimizer: Any) -> dict[str, Item]:
        """What the model and optimizer add to a checkpoint, by item name (:mod:`conveyor.train.checkpoint.items`):
        every rank saves and restores them in this order. Default: both stateful, written by the chief."""
        return {"model": Model(module), "optimizer": Stateful(optimizer)}

    def stats(self) -> dict[str, Any] | None:
        """Communication figures for the run's summary beyond ``comm_seconds`` (None: nothing more to say)."""
        return None

    def summary_figures(self) -> dict[str, Any] | None:
        """Entries for ``summary.json`` that need every rank's figures (collective: every rank calls it at
        the end of a run; the chief's result is written). None: nothing to add."""
        return None

    def check_prepared(self, model: nn.Module) -> None:
        """Raise when ``model`` is not what :meth:`prepare` returned and training it would go wrong silently."""
        return None

    def coordinator(self, job: Any) -> Coordinator:
        """How this strategy's workers keep together in a training loop (:mod:`conveyor.strategies.coordination`)."""
        return LockstepCoordinator(job)

    def train_step(self, model: nn.Module, optimizer: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
                   inputs: Any, targets: Any, mark: Callable[[str], None]) -> torch.Tensor:
        """One training step on one batch; returns the (detached) batch-mean loss.

        ``mark(phase)`` closes a phase of the step's time breakdown (``"forward_backward"``,
        ``"optimizer"``). The default is plain PyTorch: zero the gradients, forward, loss, backward,
        optimizer step. A strategy that runs a schedule over microbatches on several processes
        replaces it.
        """
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        mark("forward_backward")
        optimizer.step()
        mark("optimizer")
        return loss.detach()

    def data_shard(self) -> tuple[int, int]:
        """(number of shards, this process's shard) of the training data: ``(world_size, rank)`` for data
        parallelism; strategies whose processes share a batch (pipeline stages) say otherwise."""
        return int(self.job.world_size), int(self.job.rank)

    def counted_samples(self, samples: int) -> int:
        """How many of a step's ``samples`` this process counts in throughput figures (summed over ranks)."""
        return samples

    def eval_forward(self, module: nn.Module, inputs: Any) -> Any:
        """The outputs of ``module`` for ``inputs`` in evaluation (no gradients); None: this process has
        none, and leaves the batch's loss and metric to the process that has them."""
        return module(inputs)

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def check_optimizer(model: nn.Module, optimizer: Any) -> None:
    """Raise when ``optimizer`` updates tensors that are not ``model``'s parameters.

    The usual cause is an optimizer built from another copy of the model (or before a ``deepcopy``):
    training would then run without error and without learning, which is much harder to find.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"prepare(model, optimizer): model is a {type(model).__name__}; expected a torch.nn.Module")
    groups = getattr(optimizer, "param_groups", None)
    if groups is None:  # not a torch.optim.Optimizer: nothing to check
        return
    own = {id(p) for p in model.parameters()}
    foreign = sum(1 for group in groups for p in group["params"] if isinstance(p, torch.Tensor) and id(p) not in own)
    if foreign:
        raise ValueError(f"the optimizer holds {foreign} tensor(s) that are not parameters of the model passed to "
                         f"prepare(); build it from this model, e.g. torch.optim.SGD(model.parameters(), lr=...), "
                         f"and pass that same model")
