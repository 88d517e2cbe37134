"""One process's pipeline stage: torch's ``PipelineStage`` and schedule for each batch size, timed.

    runner = StageRunner(stage_module, meta_model, plan, index, group, device, microbatches=4, schedule="1f1b")
    loss = runner.train(inputs, targets, loss_fn)   # the replica's batch-mean loss on the last stage, else None
    outputs = runner.forward(inputs)                # forward only; the outputs on the last stage, else None

torch's schedules and stage communication do the work (``torch.distributed.pipelining``); this adds:

- **Shapes without pickle.** A ``PipelineStage`` built without example tensors infers the shapes that
  cross each cut at its first step by sending them with ``send_object_list`` — pickle on the wire,
  which conveyor does not accept (docs/architecture.md#no-pickle). Every stage of a replica is given
  the same batch, so each one computes every cut's shape itself from a copy of the whole model on the
  meta device (no memory, no arithmetic) and builds its stage *static*: only tensors cross.
- **A stage per batch size.** A static stage's receive buffers have the microbatch's shape; a batch
  of another size (the last of an epoch, an evaluation batch) gets its own stage and schedule,
  built once and kept.
- **Timing.** The stage's compute (each microbatch's forward and backward) is summed; the rest of a
  schedule's wall time is waiting for a neighbour's activations or gradients (and for sends to
  complete): the *measured bubble* of this stage, reported next to (S−1)/(M+S−1).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import _ScheduleForwardOnly

from conveyor.strategies.pipeline.split import SplitError, SplitPlan, check_microbatches

__all__ = ["SCHEDULES", "StageRunner", "schedule_class"]

#: the schedules conveyor runs: one stage per process
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
_MULTI = ("interleaved1f1b", "loopedbfs", "interleavedzerobubble", "zbvzerobubble", "dualpipev")


def schedule_class(name: str) -> type:
    """torch's schedule class for ``name`` (``gpipe``, ``1f1b``); SplitError naming the choices otherwise."""
    key = str(name).strip().lower().replace("-", "").replace("_", "")
    if key in SCHEDULES:
        return SCHEDULES[key]
    if key in _MULTI:
        raise SplitError(f"--schedule {name}: that schedule runs several stages in each process (virtual stages), "
                         f"which conveyor does not do yet; use --schedule 1f1b or gpipe")
    raise SplitError(f"--schedule {name!r} is not a pipeline schedule conveyor knows; use 1f1b or gpipe")


class _TimedStage(PipelineStage):
    """A ``PipelineStage`` that adds the time of every forward and backward chunk to ``clock[0]``."""

    def __init__(self, *args: Any, clock: list[float], sync: Callable[[], None] | None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._clock, self._sync = clock, sync

    def _timed(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._sync is not None:
            self._sync()
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if self._sync is not None:
                self._sync()  # CUDA kernels run asynchronously: count them where they run
            self._clock[0] += time.perf_counter() - start

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed(super().forward_one_chunk, *args, **kwargs)

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed(super().backward_one_chunk, *args, **kwargs)

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed(super().backward_weight_one_chunk, *args, **kwargs)


class StageRunner:
    """Stage ``index`` of ``plan`` in this process (module docstring); ``group`` is this replica's pipeline."""

    def __init__(self, module: nn.Module, meta_model: nn.Module, plan: SplitPlan, index: int, group: Any,
                 device: torch.device, *, microbatches: int, schedule: str) -> None:
        self.module, self.plan, self.index, self.group, self.device = module, plan, index, group, device
        self.num_stages = plan.num_stages
        self.microbatches = int(microbatches)
        self.schedule_cls = schedule_class(schedule)
        self._meta_model = meta_model
        self._meta_stages = [plan.stage_module(meta_model, i) for i in range(plan.num_stages)]
        self._built: dict[tuple[int, bool], Any] = {}
        self._loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
        self._sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
        self.clock = [0.0]  # compute seconds, summed over the run
        self.seconds = {"compute": 0.0, "schedule": 0.0, "steps": 0}

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def train(self, inputs: torch.Tensor, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor]) -> Any:
        """One schedule over ``inputs`` cut into microbatches; the mean microbatch loss on the last stage."""
        self._loss_fn = loss_fn
        schedule = self._schedule(inputs, training=True)
        losses: list[torch.Tensor] = []
        before, start = self.clock[0], time.perf_counter()
        args = (inputs,) if self.is_first else ()
        schedule.step(*args, target=targets if self.is_last else None, losses=losses if self.is_last else None,
                      return_outputs=False)
        if self._sync is not None:
            self._sync()
        self.seconds["schedule"] += time.perf_counter() - start
        self.seconds["compute"] += self.clock[0] - before
        self.seconds["steps"] += 1
        return torch.stack([loss.detach() for loss in losses]).mean() if self.is_last else None

    def forward(self, inputs: torch.Tensor) -> Any:
        """Forward only (evaluation); the merged outputs on the last stage, None on the others."""
        schedule = self._schedule(inputs, training=False)
        with torch.no_grad():
            return schedule.step(*((inputs,) if self.is_first else ()))

    def table(self, inputs: torch.Tensor) -> str:
        """The split's start-up table with each stage's activation bytes for one microbatch of ``inputs``."""
        x = inputs[: max(1, len(inputs) // self.microbatches)].to("meta")
        sizes = []
        for stage in self._meta_stages:
            size = 0
            for layer in stage.layers:
                x = layer(x)
                size += x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0
            sizes.append(size)
        return self.plan.describe(self._meta_model, sizes)

    def _schedule(self, inputs: torch.Tensor, training: bool) -> Any:
        n = int(inputs.shape[0])
        key = (n, training)
        if key not in self._built:
            self._built[key] = self._build(inputs, training)
        return self._built[key]

    def _build(self, inputs: torch.Tensor, training: bool) -> Any:
        if training:
            chunks = self.microbatches
            check_microbatches(len(inputs), chunks)
        else:  # forward only: any equal cut works, so the largest count up to M that divides the batch
            chunks = next(m for m in range(min(self.microbatches, len(inputs)), 0, -1) if len(inputs) % m == 0)
        x = inputs[: len(inputs) // chunks].to("meta")
        with torch.no_grad():
            for stage in self._meta_stages[: self.index]:
                x = stage(x)
            y = self._meta_stages[self.index](x)
        # A static stage takes requires_grad from these examples as given. Shapes computed under no_grad say
        # False, and then the next stage's received activations need no gradient, none is sent back, and the
        # previous stage's backward fails with "grad can be implicitly created only for scalar outputs"
        # (torch's dynamic inference sets it as below; reproduction in docs/architecture.md, Pipeline).
        x, y = (t.detach().requires_grad_(training and t.is_floating_point()) for t in (x, y))
        stage = _TimedStage(self.module, self.index, self.num_stages, self.device, input_args=x, output_args=y,
                            group=self.group, clock=self.clock, sync=self._sync)
        if not training:
            return _ScheduleForwardOnly(stage, chunks)
        # scale_grads: the gradients of M mean-reduced microbatch losses, divided by M, are those of the
        # batch-mean loss: the same update as the whole batch in one process.
        return self.schedule_cls(stage, chunks, loss_fn=self._call_loss, scale_grads=True)

    def _call_loss(self, output: Any, target: Any) -> torch.Tensor:
        return self._loss_fn(output, target)


def all_reduce_mean(tensors: list[torch.Tensor], group: Any, size: int) -> None:
    """Average ``tensors`` in place over ``group`` (``size`` ranks) in one flat all-reduce."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    flat.div_(size)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset: offset + t.numel()].view_as(t))
        offset += t.numel()
