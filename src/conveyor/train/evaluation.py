"""Evaluation during and after training: loss and a metric over the evaluation data, summed over workers.

    result = evaluate(module, eval_data, loss_fn, accuracy, device=job.device, job=job)   # all ranks
    evaluator = Evaluator(eval_data, every_steps=100, coordinator=coord, run=lambda collective: ...)
    if evaluator.due(step): evaluator.run(step, final=False)

Each rank evaluates its shard of ``eval_data`` with the unwrapped module (no DDP collectives, so
shards may differ in length) and the sums of loss, metric and samples are all-reduced. When to
evaluate is the :class:`Evaluator`'s; whether it is a collective is the coordinator's
(:meth:`~conveyor.strategies.coordination.Coordinator.evaluation`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from conveyor.data.torch_adapter import to_torch

__all__ = ["Evaluator", "accuracy", "batch_size", "evaluate", "split_batch"]


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The default `metric_fn`: the share of correct predictions in a batch.

    Several outputs per sample: the argmax is the prediction (logits or probabilities). One output
    per sample: a binary classifier's logit, positive meaning class 1.
    """
    if outputs.ndim >= 2 and outputs.shape[-1] > 1:
        predicted = outputs.argmax(dim=-1)
    else:
        predicted = (outputs.reshape(targets.shape) > 0).to(targets.dtype)
    return (predicted == targets).float().mean()


def evaluate(module: torch.nn.Module, data: Any, loss_fn: Callable, metric_fn: Callable, *,
             device: torch.device, job: Any = None, forward: Callable | None = None) -> dict[str, float]:
    """Loss and metric over ``data`` (a conveyor Dataset of (inputs, targets) batches); summed over the
    job's ranks when ``job`` is given, else this rank's alone. The module is left in the mode it was in.

    ``forward(module, inputs)`` gives the outputs (the strategy's ``eval_forward``; default
    ``module(inputs)``); where it returns None this rank counts nothing for the batch (a pipeline stage
    other than the last), and the rank that has the outputs counts it."""
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss * n, metric * n, n
    was_training = module.training
    module.eval()
    it = to_torch(data.iterator(iteration=0), device=device)
    try:
        with torch.no_grad():
            for batch in it:
                inputs, targets = split_batch(batch)
                outputs = module(inputs) if forward is None else forward(module, inputs)
                if outputs is None:
                    continue
                n = batch_size(targets)
                sums[0] += loss_fn(outputs, targets).detach().double() * n
                sums[1] += torch.as_tensor(metric_fn(outputs, targets), device=device).double() * n
                sums[2] += n
    finally:
        it.close()
        module.train(was_training)
    if job is not None:
        job.all_reduce(sums)
    loss_sum, metric_sum, n = sums.tolist()
    name = getattr(metric_fn, "__name__", "metric")
    if n == 0:
        return {"eval_loss": math.nan, f"eval_{name}": math.nan, "eval_samples": 0}
    return {"eval_loss": loss_sum / n, f"eval_{name}": metric_sum / n, "eval_samples": int(n)}


class Evaluator:
    """When a training run evaluates: every ``every_steps`` steps and at the end, once per step and kind."""

    def __init__(self, data: Any, every_steps: int | None, coordinator: Any,
                 run: Callable[[bool], dict[str, float]]) -> None:
        self.data = data
        self.every_steps = every_steps
        self.coordinator = coordinator
        self._run = run  # run(collective) -> result
        self._last: tuple[int, str] | None = None
        self.result: dict[str, float] = {}

    def due(self, step: int) -> bool:
        return self.data is not None and bool(self.every_steps) and step % self.every_steps == 0

    def run(self, step: int, final: bool) -> dict[str, float] | None:
        """Evaluate at ``step`` as the coordinator says (None: this worker skips, or it was done already)."""
        how = self.coordinator.evaluation(final)
        if self.data is None or how is None or self._last == (step, how):
            return None
        self._last = (step, how)
        self.result = self._run(how == "all")
        return self.result


def split_batch(batch: Any) -> tuple[Any, Any]:
    """A training batch as (inputs, targets); a clear error for anything else."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise TypeError(
        f"the Trainer needs (inputs, targets) batches, got a {type(batch).__name__}"
        f"{f' of {len(batch)}' if isinstance(batch, (tuple, list)) else ''}; map the dataset to a pair first, "
        f"e.g. ds.map(lambda d: (d['image'], d['label']))"
    )


def batch_size(targets: Any) -> int:
    """The number of samples in a batch, read off its targets."""
    if isinstance(targets, torch.Tensor):
        return int(targets.shape[0]) if targets.ndim else 1
    if isinstance(targets, Mapping):
        return batch_size(next(iter(targets.values())))
    if isinstance(targets, (tuple, list)):
        return batch_size(targets[0]) if targets and isinstance(targets[0], torch.Tensor) else len(targets)
    return 1
