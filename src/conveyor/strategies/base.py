"""The interface every strategy implements, so a training script never names one: a Strategy and its Step.

    strategy = get_strategy("allreduce")
    strategy.setup(job)                                     # once, after the job's process group exists
    model, optimizer = strategy.prepare(model, optimizer)   # also leaves strategy.step ready
    step = strategy.step
    before = step.comm_seconds()
    loss = step.train(model, optimizer, loss_fn, inputs, targets, mark)
    comm = step.comm_seconds() - before
    figures = strategy.report(summary)                      # collective, at the end of a run
    strategy.shutdown()

``conveyor.init()`` does the first two lines and ``job.prepare`` the third. A :class:`Strategy` says how
workers hold the model and keep together (``setup``, ``prepare``, ``coordinator``, ``data_shard``,
``checkpoint_items``, ``report``, ``shutdown``); its :class:`Step` says how one step runs (``train``,
``eval_forward``, ``counted_samples``, ``comm_seconds``, ``check``, ``finish``). The trainer calls only these, and
never asks which strategy it runs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from conveyor.strategies.coordination import Coordinator, LockstepCoordinator
from conveyor.train.checkpoint.items import Item, Model, Stateful

__all__ = ["Step", "Strategy", "check_optimizer"]


class Step:
    """One training step the plain PyTorch way, on the whole model: the default of every strategy.

    A strategy whose steps run otherwise (a schedule over microbatches on several processes, a timed
    all-reduce) puts its own subclass in ``strategy.step``, built by ``setup`` or ``prepare``.
    """

    #: Whether several processes share each batch (pipeline stages): one of them cannot skip a batch alone.
    shares_batches: bool = False
    #: Whether a worker without a batch can take a zero-weight step with the others (same forward, backward and
    #: collectives, gradients all zero), so that a lockstep epoch ends when the last worker's batches are used.
    shadows: bool = False

    def train(self, model: nn.Module, optimizer: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
              inputs: Any, targets: Any, mark: Callable[[str], None]) -> torch.Tensor:
        """One training step on one batch; returns the (detached) batch-mean loss.

        ``mark(phase)`` closes a phase of the step's time breakdown (``"forward_backward"``,
        ``"optimizer"``): zero the gradients, forward, loss, backward, optimizer step.
        """
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        mark("forward_backward")
        optimizer.step()
        mark("optimizer")
        return loss.detach()

    def eval_forward(self, module: nn.Module, inputs: Any) -> Any:
        """The outputs of ``module`` for ``inputs`` in evaluation (no gradients); None: this process has
        none, and leaves the batch's loss and metric to the process that has them."""
        return module(inputs)

    def counted_samples(self, samples: int) -> int:
        """How many of a step's ``samples`` this process counts in throughput figures (summed over ranks)."""
        return samples

    def comm_seconds(self) -> float:
        """Total wall time spent in communication so far (seconds); read it around a step for the step's."""
        return 0.0

    def check(self, model: nn.Module, train_data: Any) -> None:
        """Raise when the trainer's ``model`` is not what ``prepare`` returned, or ``train_data`` is not read the
        way this strategy needs, and training would go wrong silently."""
        return None

    def finish(self, module: nn.Module, job: Any) -> None:
        """After a run's last training step, on every rank at once (before the final evaluation and save):
        leave in ``module`` the parameters the run ends with. Default: they are there already."""
        return None


class Strategy(ABC):
    """One way of keeping several workers' models in step.

    ``name`` is the strategy's command-line name (``str(strategy)`` gives it too). ``distributed`` says
    whether it coordinates several training processes; ``conveyor.init()`` refuses a non-distributed
    strategy in a job with more than one, where each worker would silently train its own model.
    ``step`` is how one training step runs (:class:`Step`); ``prepare`` (or ``setup``) replaces the plain
    default where the strategy runs steps its own way.
    """

    name: ClassVar[str] = ""
    distributed: ClassVar[bool] = True

    def __init__(self) -> None:
        self._job: Any = None
        self.step: Step = Step()

    def setup(self, job: Any) -> None:
        """Bind to ``job`` (rank, world size, device, timeout, ``environ``). Called once, after the process group
        exists."""
        self._job = job

    @property
    def job(self) -> Any:
        if self._job is None:
            raise RuntimeError(f"strategy {self.name!r} is not set up: get it from conveyor.init() "
                               f"(job.strategy), or call strategy.setup(job) first")
        return self._job

    @abstractmethod
    def prepare(self, model: nn.Module, optimizer: Any, *, split: Sequence[str] | None = None
                ) -> tuple[nn.Module, Any]:
        """Place ``model`` on the job's device and wrap what the strategy needs; return (model, optimizer) and
        leave ``self.step`` ready to train them. ``split``: where to cut the model into stages (strategies that
        hold the whole model ignore it, so that one script runs under every strategy)."""

    def coordinator(self, job: Any) -> Coordinator:
        """How this strategy's workers keep together in a training loop (:mod:`conveyor.strategies.coordination`)."""
        return LockstepCoordinator(job)

    def data_shard(self) -> tuple[int, int]:
        """(number of shards, this process's shard) of the training data: ``(world_size, rank)`` for data
        parallelism; strategies whose processes share a batch (pipeline stages) say otherwise."""
        return int(self.job.world_size), int(self.job.rank)

    def checkpoint_items(self, module: nn.Module, optimizer: Any) -> dict[str, Item]:
        """What the model and optimizer add to a checkpoint, by item name (:mod:`conveyor.train.checkpoint.items`):
        every rank saves and restores them in this order. Default: both stateful, written by the chief."""
        return {"model": Model(module), "optimizer": Stateful(optimizer)}

    # -- the end of a run ------------------------------------------------------------------------

    def report(self, summary: dict[str, Any]) -> dict[str, Any] | None:
        """Entries this strategy adds to the run's ``summary.json`` (its communication figures, a pipeline's
        stages), given the summary so far. Collective: every rank calls it at the end of a run and gets its
        own summary updated; the chief's is written. None: nothing to add."""
        return None

    def shutdown(self) -> None:
        """Release what :meth:`setup`/:meth:`prepare` acquired (the process group itself belongs to the job)."""
        return None

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
