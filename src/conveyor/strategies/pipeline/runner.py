"""One process's pipeline stage: torch's ``PipelineStage`` and schedule for each batch size, timed.

    runner = StageRunner(stage_module, meta_model, plan, index, group, device, microbatches=4, schedule="1f1b")
    loss = runner.train(inputs, targets, loss_fn)   # the batch-mean loss on the last stage, else None
    loss = runner.end_step(loss)                    # after the optimizer step: the loss on every stage
    outputs = runner.forward(inputs)                # forward only; the outputs on the last stage, else None

torch's schedules and stage communication do the work (``torch.distributed.pipelining``); this adds:

- **Shapes without pickle.** A ``PipelineStage`` built without example tensors infers the shapes that
  cross each cut at its first step by sending them with ``send_object_list`` — pickle on the wire,
  which conveyor does not accept (docs/architecture.md#no-pickle). Every stage of a replica is given
  the same batch, so each one computes every cut's shape itself from a copy of the whole model on the
  meta device (no memory, no arithmetic) and builds its stage *static*: only tensors cross. (A traced
  split's stage, ``traced.TracedRunner``, takes the shapes from its trace.)
- **A stage per batch size.** A static stage's receive buffers have the microbatch's shape; a batch
  of another size (the last of an epoch, an evaluation batch) gets its own stage and schedule,
  built once and kept. ``microbatches=None`` fits the count to the first training batch.
- **Timing.** The stage's compute (each microbatch's forward, loss and backward) is summed over a
  window that every stage of the pipeline shares: from the latest stage's schedule start to the
  latest one's end, found by an exchange after the optimizer step that carries the loss too. The
  rest of the window is waiting for a neighbour's activations or gradients, or for the pipeline to
  drain: the *measured bubble* of this stage, next to (S−1)/(M+S−1). Waiting for a stage that
  started late (a slower optimizer step) is counted apart, ``start_wait`` (docs/strategies.md,
  Pipeline parallelism).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import _ScheduleForwardOnly

from conveyor.strategies.pipeline.split import SplitError, SplitPlan, check_microbatches, default_microbatches

__all__ = ["SCHEDULES", "StageRunner", "check_schedule", "schedule_class"]

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


def check_schedule(schedule_cls: type, microbatches: int, stages: int, batch: int | None = None) -> None:
    """torch's 1F1B needs a microbatch per stage at least (its warm-up fills every stage); torch refuses fewer at a
    job's first step with a ValueError that names no flag, so conveyor refuses it first, naming them."""
    if issubclass(schedule_cls, Schedule1F1B) and microbatches < stages:
        cut = f"a batch of {batch} cut into {microbatches}" if batch is not None else f"--microbatches {microbatches}"
        raise SplitError(f"--schedule 1f1b on {stages} stages needs {stages} microbatches or more per batch ({cut}): "
                         f"give --microbatches {stages} or more, with a batch size that it divides, or --schedule "
                         f"gpipe, which runs any number")


class _Clock:
    """Seconds of this stage's own work, summed: what a schedule's wall time minus this is waiting."""

    def __init__(self, sync: Callable[[], None] | None) -> None:
        self.total, self._sync = 0.0, sync

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._sync is not None:
            self._sync()
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if self._sync is not None:
                self._sync()  # CUDA kernels run asynchronously: count them where they run
            self.total += time.perf_counter() - start


class _Timed:
    """Runs a stage's forward and backward chunks and end-of-step gradient reduction on ``self._clock``."""

    _clock: _Clock

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._clock.run(super().forward_one_chunk, *args, **kwargs)

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._clock.run(super().backward_one_chunk, *args, **kwargs)

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._clock.run(super().backward_weight_one_chunk, *args, **kwargs)

    def perform_reduce_grad(self, *args: Any, **kwargs: Any) -> Any:
        return self._clock.run(super().perform_reduce_grad, *args, **kwargs)


class _TimedStage(_Timed, PipelineStage):
    """A ``PipelineStage`` (static shapes, given as examples) timed on ``clock``."""

    def __init__(self, *args: Any, clock: _Clock, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._clock = clock


class StageRunner:
    """Stage ``index`` of ``plan`` in this process (module docstring); ``group`` is this replica's pipeline."""

    def __init__(self, module: nn.Module, meta_model: nn.Module, plan: SplitPlan, index: int, group: Any,
                 device: torch.device, *, microbatches: int | None, schedule: str) -> None:
        self.module, self.plan, self.index, self.group, self.device = module, plan, index, group, device
        self.num_stages = plan.num_stages
        self.microbatches = int(microbatches) if microbatches is not None else None  # None: fitted by _fit
        self.schedule_cls = schedule_class(schedule)
        self._meta_model = meta_model
        self._built: dict[tuple, Any] = {}
        self._loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
        self._sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
        self.clock = _Clock(self._sync)  # compute seconds, summed over the run
        self.seconds = {"compute": 0.0, "window": 0.0, "start_wait": 0.0, "steps": 0}
        self._left_at: float | None = None  # when the last step's end_step returned (on every stage at once)
        self._step = (0.0, 0.0, 0.0)  # this step's schedule start and end (since _left_at) and compute seconds

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def train(self, inputs: torch.Tensor, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor]) -> Any:
        """One schedule over ``inputs`` cut into microbatches; the batch-mean loss on the last stage, else None.
        The step is over after :meth:`end_step`."""
        self._loss_fn = loss_fn
        schedule = self._schedule(inputs, training=True)
        losses: list[torch.Tensor] = []
        before, start = self.clock.total, time.perf_counter()
        args = (inputs,) if self.is_first else ()
        schedule.step(*args, target=targets if self.is_last else None, losses=losses if self.is_last else None,
                      return_outputs=False)
        if self._sync is not None:
            self._sync()
        end = time.perf_counter()
        since = self._left_at if self._left_at is not None else start  # the first step: assume a common start
        self._step = (start - since, end - since, self.clock.total - before)
        # each microbatch's loss was divided by M (_call_loss): their sum is the batch mean
        return torch.stack([loss.detach() for loss in losses]).sum() if self.is_last else None

    def end_step(self, loss: torch.Tensor | None) -> torch.Tensor:
        """After the optimizer step: the last stage's loss on every stage (the chief logs it), and the step's
        timing. Every stage leaves this exchange at the same moment, so times since the previous one compare
        across processes: the step's window runs from the latest stage's schedule start to the latest end;
        a stage that started earlier waited for it (``start_wait``: a slower optimizer step or data load,
        not the schedule's doing). Placed after the optimizer, not before, so that no stage waits for
        the others' last backward before its own optimizer step (torch's loops do not either)."""
        began, ended, compute = self._step
        mine = torch.tensor([float(loss) if loss is not None else 0.0, began, ended], dtype=torch.float64,
                            device=self.device)
        every = [torch.empty_like(mine) for _ in range(self.num_stages)]
        dist.all_gather(every, mine, group=self.group)
        self._left_at = time.perf_counter()
        latest_start, latest_end = (max(float(t[i]) for t in every) for i in (1, 2))
        self.seconds["window"] += latest_end - latest_start
        self.seconds["start_wait"] += latest_start - began
        self.seconds["compute"] += compute
        self.seconds["steps"] += 1
        return loss if loss is not None else every[-1][0].float()

    def forward(self, inputs: torch.Tensor) -> Any:
        """Forward only (evaluation); the merged outputs on the last stage, None on the others."""
        schedule = self._schedule(inputs, training=False)
        with torch.no_grad():
            return schedule.step(*((inputs,) if self.is_first else ()))

    def table(self, inputs: torch.Tensor) -> str:
        """The split's start-up table with each stage's activation bytes for one microbatch of ``inputs``."""
        x = inputs[: max(1, len(inputs) // self._fit(len(inputs)))].to("meta")
        sizes = []
        for stage in self._meta_stages:
            size = 0
            for layer in stage.layers:
                x = layer(x)
                size += x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0
            sizes.append(size)
        return self.plan.describe(self._meta_model, sizes)

    def _schedule(self, inputs: torch.Tensor, training: bool) -> Any:
        key = self._key(int(inputs.shape[0]), training)
        if key not in self._built:
            self._built[key] = self._build(inputs, training)
        return self._built[key]

    def _key(self, n: int, training: bool) -> tuple:
        """What a stage and schedule are built once for: a static stage's buffers hold one batch size."""
        return (n, training)

    def _fit(self, batch: int) -> int:
        """The microbatches of every training step: as given, else fitted to the first training ``batch``."""
        if self.microbatches is None:
            self.microbatches = default_microbatches(self.num_stages, batch)
        return self.microbatches

    def _build(self, inputs: torch.Tensor, training: bool) -> Any:
        if training:
            chunks = self._fit(len(inputs))
            check_microbatches(len(inputs), chunks)
            check_schedule(self.schedule_cls, chunks, self.num_stages, len(inputs))
        else:  # forward only: any equal cut works, so the largest count up to M that divides the batch
            limit = self.microbatches or default_microbatches(self.num_stages)
            chunks = next(m for m in range(min(limit, len(inputs)), 0, -1) if len(inputs) % m == 0)
        stage = self._stage(inputs[: len(inputs) // chunks].to("meta"), training)
        if not training:
            return _ScheduleForwardOnly(stage, chunks)
        # The gradients of M mean-reduced microbatch losses, each divided by M, add up to those of the batch-mean
        # loss: the same update as the whole batch in one process. Dividing the loss (_call_loss) rather than
        # the gradients (scale_grads=True) spares a pass over every gradient at the end of each step.
        return self.schedule_cls(stage, chunks, loss_fn=self._call_loss, scale_grads=False)

    def _stage(self, x: torch.Tensor, training: bool) -> Any:
        """This stage for microbatches like ``x`` (on the meta device), its shapes computed on the meta model."""
        with torch.no_grad():
            for stage in self._meta_stages[: self.index]:
                x = stage(x)
            y = self._meta_stages[self.index](x)
        # A static stage takes requires_grad from these examples as given. Shapes computed under no_grad say
        # False, and then the next stage's received activations need no gradient, none is sent back, and the
        # previous stage's backward fails with "grad can be implicitly created only for scalar outputs"
        # (torch's dynamic inference sets it as below; reproduction in docs/strategies.md, Pipeline).
        x, y = (t.detach().requires_grad_(training and t.is_floating_point()) for t in (x, y))
        return _TimedStage(self.module, self.index, self.num_stages, self.device, input_args=x, output_args=y,
                           group=self.group, clock=self.clock)

    @functools.cached_property
    def _meta_stages(self) -> list[nn.Module]:
        return [self.plan.stage_module(self._meta_model, i) for i in range(self.num_stages)]

    def meta_stage(self, index: int) -> nn.Module:
        """Stage ``index`` of the meta copy of the whole model: every stage's shapes, in no memory."""
        return self._meta_stages[index]

    def layers(self) -> list[list[str]]:
        """Each stage's layers, for the summary."""
        return self.plan.signature()

    def _call_loss(self, output: Any, target: Any) -> torch.Tensor:
        # the schedule computes the loss between chunks; it is the last stage's work, not waiting
        return self.clock.run(lambda: self._loss_fn(output, target) / self.microbatches)


def all_reduce_mean(tensors: list[torch.Tensor], group: Any, size: int) -> None:
    """Average ``tensors`` in place over ``group`` (``size`` ranks) in one flat all-reduce."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    flat.div_(size)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset: offset + t.numel()].view_as(t))
        offset += t.numel()
