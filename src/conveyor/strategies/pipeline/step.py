"""A pipeline stage's training step: what ``strategy.step`` is under ``--strategy pipeline``.

    step = job.strategy.step                                   # built by setup, given its stage by prepare
    loss = step.train(model, optimizer, loss_fn, x, y, mark)   # the last stage's loss, on every stage
    outputs = step.eval_forward(model, x)                      # the outputs on the last stage, else None

A step runs torch's schedule over the microbatches (:class:`~.runner.StageRunner`), averages each stage's
gradients over its replicas (with ``--shard-stages`` FSDP2 does, within the schedule), steps the optimizer
and exchanges the loss, so that every stage returns it. Only the first stage counts a batch's samples
(every stage of a replica sees the same batch); ``comm_seconds`` is the replicas' gradient all-reduce and
the loss exchange (sends and receives are part of the schedule: see the strategy's ``report``). ``check``
refuses the model ``prepare`` did not return and training data sharded per process instead of per replica.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from conveyor.comm.process_group import collective_guard
from conveyor.strategies.base import Step
from conveyor.strategies.pipeline.runner import StageRunner, all_reduce_mean

__all__ = ["PipelineStep"]


class PipelineStep(Step):
    """Stage ``stage`` of replica-count ``replicas``; ``stage_group`` holds this stage's replicas. ``prepare``
    sets ``runner`` and ``module`` (this process's stage); until then training is refused."""

    shares_batches = True  # the stages of a replica share each batch
    # A replica without a batch runs the schedule on its last one with the loss times zero: its stages' gradients
    # are zero in the replicas' mean, as under allreduce, so a redistributed epoch's uneven shares lose nothing.
    shadows = True

    def __init__(self, job: Any, *, name: str, stage: int, replicas: int, stage_group: Any,
                 sharded: bool = False) -> None:
        self.job, self.name, self.stage, self.replicas, self.stage_group = job, name, stage, replicas, stage_group
        self.sharded = sharded  # FSDP2 reduce-scatters the stage's gradients inside the schedule (sharded.py)
        self.runner: StageRunner | None = None
        self.module: Any = None  # a split.StageModule, or a traced.TracedStage
        self._comm = 0.0
        self._announced = False  # the split's table is printed at the first step

    def train(self, model: nn.Module, optimizer: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
              inputs: Any, targets: Any, mark: Callable[[str], None]) -> torch.Tensor:
        """One schedule over the microbatches, the replicas' gradient average, the optimizer step."""
        runner = self._runner()
        if not self._announced:
            self._announced = True
            if self.job.is_chief:  # now that the shapes are known
                print(runner.table(inputs), flush=True)
        optimizer.zero_grad(set_to_none=True)
        with collective_guard(self.job, "pipeline schedule (stage sends and receives)"):
            loss = runner.train(inputs, targets, loss_fn)
        mark("forward_backward")
        if self.replicas > 1 and not self.sharded:
            start = time.perf_counter()
            with collective_guard(self.job, "pipeline gradient all-reduce"):
                params = [p for p in model.parameters() if p.requires_grad]
                for p in params:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                all_reduce_mean([p.grad for p in params], self.stage_group, self.replicas)
            self._comm += time.perf_counter() - start
        optimizer.step()
        start = time.perf_counter()
        if self.replicas > 1:
            self._broadcast_buffers()
        with collective_guard(self.job, "pipeline loss exchange"):
            loss = runner.end_step(loss)
        self._comm += time.perf_counter() - start
        mark("optimizer")
        return loss

    def _broadcast_buffers(self) -> None:
        """Every replica keeps replica 0's buffers (BatchNorm's running statistics), as DDP broadcasts rank 0's:
        each replica's own batches would move them apart, and a checkpoint holds replica 0's only."""
        buffers = list(self._runner().module.buffers())
        if buffers:
            with collective_guard(self.job, "pipeline buffer broadcast from replica 0"):
                for buffer in buffers:
                    torch.distributed.broadcast(buffer.data, src=self.stage, group=self.stage_group)

    def eval_forward(self, module: nn.Module, inputs: Any) -> Any:
        """Forward only through every stage; the outputs on the last stage, None on the others."""
        with collective_guard(self.job, "pipeline evaluation (forward only)"):
            return self._runner().forward(inputs)

    def counted_samples(self, samples: int) -> int:
        """Only the first stage counts a batch's samples: every stage of a replica sees the same batch."""
        return samples if self.stage == 0 else 0

    def comm_seconds(self) -> float:
        """Seconds in the replicas' gradient all-reduce and the loss exchange after the optimizer step, which
        waits for the pipeline's slowest stage."""
        return self._comm

    def check(self, model: nn.Module, train_data: Any) -> None:
        """A shard per process would feed each stage of a replica different samples: refuse it with the fix; and
        refuse a model that is not this process's stage."""
        world = int(self.job.world_size)
        if self.replicas != world and world > 1 and train_data.is_sharded(world):
            raise ValueError(f"train_data is sharded by the {world} processes (shard(job.world_size, job.rank)), but "
                             f"under strategy {self.name!r} the data has {self.replicas} shard(s): every stage of a "
                             f"replica must read the same batches. Shard with ds.shard(*job.data_shard), which is "
                             f"right under every strategy")
        if self.module is None or model is not self.module:
            raise ValueError("the model is not this process's pipeline stage: pass the model and optimizer that "
                             "`job.prepare(model, optimizer)` returned")

    def _runner(self) -> StageRunner:
        if self.runner is None:
            raise RuntimeError("strategy 'pipeline': call job.prepare(model, optimizer) before training")
        return self.runner
