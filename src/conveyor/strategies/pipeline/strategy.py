"""Pipeline model parallelism: each process holds one stage of the model; microbatches flow through.

    conveyor run -n 4 --strategy pipeline --stages 2 --microbatches 8 --schedule 1f1b train.py
    job = conveyor.init()
    model, optimizer = job.prepare(model, optimizer)        # this process's stage, and an optimizer over it
    train = data.shard(*job.data_shard)                     # the replica's shard: every stage reads it
    loss = job.train_step(model, optimizer, loss_fn, x, y)  # or conveyor.Trainer

``N`` processes with ``S`` stages make ``N / S`` pipeline replicas (pipeline × data parallel); rank
``r`` runs stage ``r % S`` of replica ``r // S``, and rank 0 (the chief) is replica 0's first stage.
Every stage of a replica reads the replica's shard (``job.data_shard``). ``prepare`` keeps this
stage's layers (the others go to the meta device) and rebuilds the optimizer over them (a model that
is not an nn.Sequential: at its first batch, when its split is traced, ``traced.py``); a step runs
torch's schedule over the microbatches, averages each stage's gradients over its replicas, and equals
one process training the whole model on the replicas' combined batch. Rank layout, data, splits and
the numbers: ``docs/architecture.md``, "Pipeline parallelism".
"""

from __future__ import annotations

import inspect
import json
import os
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from conveyor.cluster.variables import PIPELINE_VARS
from conveyor.comm.process_group import collective_guard
from conveyor.strategies.base import Strategy, check_optimizer
from conveyor.strategies.pipeline.checkpoint import StagesItem
from conveyor.strategies.pipeline.figures import pipeline_figures
from conveyor.strategies.pipeline.runner import StageRunner, all_reduce_mean, schedule_class
from conveyor.strategies.pipeline.split import (
    SplitError,
    SplitPlan,
    TracedPlan,
    meta_copy,
    plan_split,
)
from conveyor.strategies.pipeline.traced import TracedRunner, TracedSplit, TracedStage
from conveyor.train.checkpoint.items import Item

__all__ = ["ENV", "PipelineStrategy"]

#: the variables ``conveyor run --stages/--microbatches/--schedule/--split`` set
ENV = PIPELINE_VARS


class PipelineStrategy(Strategy):
    """Pipeline × data parallelism (module docstring); arguments left None come from ``PIPELINE_VARS``."""

    name = "pipeline"

    def __init__(self, stages: int | None = None, microbatches: int | None = None, schedule: str | None = None,
                 split: Sequence[str] | None = None) -> None:
        super().__init__()
        self.stages = stages if stages is not None else _env_int(ENV["stages"])
        self.microbatches = microbatches if microbatches is not None else _env_int(ENV["microbatches"])
        self.schedule = schedule or os.environ.get(ENV["schedule"], "").strip() or "1f1b"
        text = os.environ.get(ENV["split"], "").strip()
        self.split = list(split) if split is not None else ([s.strip() for s in text.split(",")] if text else None)
        schedule_class(self.schedule)  # a bad name fails here, before any process group
        self.stage = self.replica = 0
        self.replicas = 1
        self.plan: SplitPlan | TracedPlan | None = None
        self.runner: StageRunner | None = None
        self.module: Any = None  # a split.StageModule, or a traced.TracedStage
        self._optimizer: Any = None
        self._restored: dict[str, Any] | None = None  # a traced stage's checkpoint part, loaded at its first batch
        self._pipe_group: Any = None
        self._stage_group: Any = None
        self._comm = 0.0
        self._announced = False  # the split's table is printed at the first step

    # -- setup ------------------------------------------------------------------------------------

    def setup(self, job: Any) -> None:
        super().setup(job)
        world, stages = int(job.world_size), self.stages
        if stages is None and self.split:
            stages = self.stages = len(self.split) + 1
        if stages is None:
            raise SplitError("strategy 'pipeline' needs the number of stages: conveyor run --stages S (or "
                             "CONVEYOR_PIPELINE_STAGES), or split points (--split NAME,NAME)")
        if stages < 2:
            raise SplitError(f"--stages {stages}: a pipeline has at least 2 stages; for one stage per process use "
                             f"--strategy allreduce (or local)")
        if world % stages:
            lower, upper = stages * max(1, world // stages), stages * (world // stages + 1)
            raise SplitError(f"conveyor run -n {world} --stages {stages}: the number of processes must be a multiple "
                             f"of the stages (each replica runs all {stages}); use -n {lower} or -n {upper}")
        if getattr(job.device, "type", "cpu") == "cuda" and getattr(job, "backend", "nccl") != "nccl":
            raise ValueError("pipeline stages on shared GPUs: their process group is gloo (NCCL refuses two ranks "
                             "on one GPU), and gloo cannot send CUDA tensors between stages; run one stage per GPU "
                             "(at most as many tasks per machine as GPUs, without --share-gpus)")
        if self.microbatches is None:
            self.microbatches = 2 * stages
        if self.microbatches < 1:
            raise SplitError(f"--microbatches {self.microbatches}: expected a whole number >= 1")
        self.replicas, self.stage, self.replica = world // stages, job.rank % stages, job.rank // stages
        self._make_groups(job, stages)

    def _make_groups(self, job: Any, stages: int) -> None:
        """Every rank creates every group, in the same order (torch requires it), and keeps its own two."""
        timeout = timedelta(seconds=float(job.timeout))
        with collective_guard(job, "pipeline process groups"):
            for r in range(self.replicas):
                group = dist.new_group([r * stages + s for s in range(stages)], timeout=timeout)
                if r == self.replica:
                    self._pipe_group = group
            for s in range(stages):
                group = dist.new_group([r * stages + s for r in range(self.replicas)], timeout=timeout)
                if s == self.stage:
                    self._stage_group = group

    def data_shard(self) -> tuple[int, int]:
        """(replicas, this replica): every stage of a replica reads the replica's shard."""
        return self.replicas, self.replica

    # -- prepare ----------------------------------------------------------------------------------

    def prepare(self, model: nn.Module, optimizer: Any, split: Sequence[str] | None = None) -> tuple[nn.Module, Any]:
        job = self.job
        check_optimizer(model, optimizer)
        points = list(split) if split is not None else self.split
        self.plan = plan = plan_split(model, stages=self.stages, split_points=points)
        if isinstance(plan, TracedPlan):
            return self._prepare_traced(model, optimizer, plan)
        meta_model = meta_copy(model)
        for i in range(plan.num_stages):  # this process keeps only its own stage's tensors
            if i != self.stage:
                plan.stage_module(model, i).to("meta")
        self.module = module = plan.stage_module(model, self.stage).to(job.device)
        self._broadcast_stage()
        self.runner = StageRunner(module, meta_model, plan, self.stage, self._pipe_group, job.device,
                                  microbatches=int(self.microbatches), schedule=self.schedule)
        return module, _stage_optimizer(optimizer, module)

    def _prepare_traced(self, model: nn.Module, optimizer: Any, plan: TracedPlan) -> tuple[nn.Module, Any]:
        """The whole model and an optimizer over all of it, until the first batch decides the stage (traced.py)."""
        self.module = module = TracedStage(model)
        self._optimizer = stage_optimizer = _stage_optimizer(optimizer, model)
        self.runner = TracedRunner(module, TracedSplit(model, plan), self.stage, self._pipe_group, self.job.device,
                                   microbatches=int(self.microbatches), schedule=self.schedule,
                                   adopted=self._adopted)
        return module, stage_optimizer

    def _adopted(self) -> None:
        """A traced stage's first batch: the optimizer keeps its parameters (empty groups stay, so that an LR
        scheduler's per-group lists still line up), replicas start from replica 0, a restored part is loaded."""
        own = {id(p) for p in self.module.parameters()}
        for group in self._optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in own]
        if not any(group["params"] for group in self._optimizer.param_groups):
            raise SplitError("this pipeline stage has no parameter the optimizer updates; move a split point so that "
                             "every stage holds trainable layers")
        self._broadcast_stage()
        if self._restored is not None:
            self._load_part(self._restored, self._optimizer)
            self._restored = None

    def _broadcast_stage(self) -> None:
        if self.replicas > 1:  # replicas of a stage start from replica 0's values, as DDP does
            with collective_guard(self.job, "pipeline stage broadcast from replica 0"):
                for tensor in [*self.module.parameters(), *self.module.buffers()]:
                    dist.broadcast(tensor.data, src=self.stage, group=self._stage_group)

    def check_prepared(self, model: nn.Module) -> None:
        if self.module is None or model is not self.module:
            raise ValueError("the model is not this process's pipeline stage: pass the model and optimizer that "
                             "`job.prepare(model, optimizer)` returned")

    # -- the step ---------------------------------------------------------------------------------

    def train_step(self, model: nn.Module, optimizer: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
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
        if self.replicas > 1:
            start = time.perf_counter()
            with collective_guard(self.job, "pipeline gradient all-reduce"):
                params = [p for p in model.parameters() if p.requires_grad]
                for p in params:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                all_reduce_mean([p.grad for p in params], self._stage_group, self.replicas)
            self._comm += time.perf_counter() - start
        optimizer.step()
        start = time.perf_counter()
        with collective_guard(self.job, "pipeline loss exchange"):
            loss = runner.end_step(loss)
        self._comm += time.perf_counter() - start
        mark("optimizer")
        return loss

    def summary_figures(self) -> dict[str, Any] | None:
        """``summary["pipeline"]``: per-stage compute, send/receive wait, measured and theoretical bubble."""
        if self.runner is None or self.plan is None:
            return None
        mine = {"stage": self.stage, **self.runner.seconds}
        reports = [json.loads(b) for b in self.job.all_gather_bytes(json.dumps(mine).encode())]
        return {"pipeline": pipeline_figures(reports, stages=self.plan.num_stages, microbatches=int(self.microbatches),
                                             schedule=self.schedule, split=self.runner.layers())}

    # -- checkpoints: one part per stage (replica 0's), the chief's header names them -------------

    def checkpoint_items(self, module: nn.Module, optimizer: Any) -> dict[str, Item]:
        """Every stage's model and optimizer state as a part of its own (``pipeline/checkpoint.py``)."""
        return {"optimizer": StagesItem(self, optimizer)}

    def _load_part(self, state: Any, optimizer: Any) -> None:
        self.module.load_model_state_dict(dict(state["model"]))
        optimizer.load_state_dict(state["optimizer"])

    def _plan(self) -> SplitPlan | TracedPlan:
        if self.plan is None or self.module is None:
            raise RuntimeError("strategy 'pipeline': call job.prepare(model, optimizer) first")
        return self.plan

    def counted_samples(self, samples: int) -> int:
        """Only the first stage counts a batch's samples: every stage of a replica sees the same batch."""
        return samples if self.stage == 0 else 0

    def comm_seconds(self) -> float:
        """Seconds in the replicas' gradient all-reduce and the loss exchange after the optimizer step, which
        waits for the pipeline's slowest stage (sends and receives are part of the schedule: see
        ``summary_figures``)."""
        return self._comm

    def eval_forward(self, module: nn.Module, inputs: Any) -> Any:
        """Forward only through every stage; the outputs on the last stage, None on the others."""
        with collective_guard(self.job, "pipeline evaluation (forward only)"):
            return self._runner().forward(inputs)

    def _runner(self) -> StageRunner:
        if self.runner is None:
            raise RuntimeError("strategy 'pipeline': call job.prepare(model, optimizer) before training")
        return self.runner


def _stage_optimizer(optimizer: Any, module: nn.Module) -> Any:
    """The user's optimizer class and hyperparameters over this stage's parameters only."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"strategy 'pipeline' rebuilds the optimizer over each stage's parameters and needs a "
                        f"torch.optim.Optimizer; got a {type(optimizer).__name__}")
    if optimizer.state:
        raise ValueError("the optimizer already has state (it stepped, or a state was loaded): pass a fresh one to "
                         "job.prepare() and restore state afterwards through a checkpoint")
    own = {id(p) for p in module.parameters()}
    groups = []
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if id(p) in own]
        if params:
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    if not groups:
        raise SplitError("this pipeline stage has no parameter the optimizer updates; move a split point so that "
                         "every stage holds trainable layers")
    # Only the defaults the constructor takes: some classes record more (torch's AdamW records
    # decoupled_weight_decay, which AdamW() refuses); every group carries its values anyway.
    accepted = inspect.signature(type(optimizer)).parameters
    return type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})


def _env_int(name: str) -> int | None:
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    if not text.isdigit():
        raise SplitError(f"{name}={text!r}; expected a whole number")
    return int(text)
