"""Pipeline model parallelism: each process holds one stage of the model; microbatches flow through.

    conveyor run -n 4 --strategy pipeline --stages 2 --microbatches 8 --schedule 1f1b train.py
    job = conveyor.init()
    model, optimizer = job.prepare(model, optimizer)        # this process's stage, and an optimizer over it
    train = data.shard(*job.data_shard)                     # the replica's shard: every stage reads it
    loss = job.train_step(model, optimizer, loss_fn, x, y)  # job.strategy.step (step.py), or conveyor.Trainer

``N`` processes with ``S`` stages make ``N / S`` pipeline replicas (pipeline × data parallel); rank
``r`` runs stage ``r % S`` of replica ``r // S``, and rank 0 (the chief) is replica 0's first stage.
Every stage of a replica reads the replica's shard (``job.data_shard``). ``prepare`` keeps this
stage's layers (the others go to the meta device) and rebuilds the optimizer over them (a model that
is not an nn.Sequential: at its first batch, when its split is traced, ``traced.py``); a step
(``step.py``) runs torch's schedule over the microbatches, averages each stage's gradients over its
replicas, and equals one process training the whole model on the replicas' combined batch. With
``--shard-stages`` (``shard_stages=True``) each stage is sharded with FSDP2 across its replicas instead of
replicated (``sharded.py``: pipeline × FSDP, torchtitan's order). Settings
left None come from the job's (``job.settings``). Rank layout, data, splits and the numbers:
``docs/strategies.md``, "Pipeline parallelism".
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from conveyor.cluster.validate import replicas_for_shards
from conveyor.comm.process_group import collective_guard
from conveyor.strategies.base import Strategy, check_optimizer
from conveyor.strategies.pipeline.checkpoint import StagesItem
from conveyor.strategies.pipeline.figures import pipeline_figures
from conveyor.strategies.pipeline.runner import StageRunner, check_schedule, schedule_class
from conveyor.strategies.pipeline.sharded import shard_stage, stage_mesh
from conveyor.strategies.pipeline.split import (
    SplitError,
    SplitPlan,
    TracedPlan,
    default_microbatches,
    meta_copy,
    plan_split,
)
from conveyor.strategies.pipeline.step import PipelineStep
from conveyor.strategies.pipeline.traced import TracedRunner, TracedSplit, TracedStage
from conveyor.train.checkpoint.items import Item

__all__ = ["PipelineStrategy"]



class PipelineStrategy(Strategy):
    """Pipeline × data parallelism (module docstring); arguments left None come from the job's pipeline settings
    at ``setup`` (``conveyor run --stages/--microbatches/--schedule/--split``)."""

    name = "pipeline"

    def __init__(self, stages: int | None = None, microbatches: int | None = None, schedule: str | None = None,
                 split: Sequence[str] | None = None, shard_stages: bool | None = None) -> None:
        super().__init__()
        self.stages, self.microbatches, self.schedule = stages, microbatches, schedule
        self.shard_stages = shard_stages  # pipeline × FSDP (sharded.py); None: the job's --shard-stages
        self.split = list(split) if split is not None else None
        if schedule is not None:
            schedule_class(schedule)  # a bad name fails here, before any process group
        self.stage = self.replica = 0
        self.replicas = 1
        self.plan: SplitPlan | TracedPlan | None = None
        self.runner: StageRunner | None = None
        self.module: Any = None  # a split.StageModule, or a traced.TracedStage
        self._optimizer: Any = None
        self._restored: dict[str, Any] | None = None  # a traced stage's checkpoint part, loaded at its first batch
        self._pipe_group: Any = None
        self._stage_group: Any = None
        self._mesh: Any = None  # with shard_stages: this stage's replicas as FSDP2's DeviceMesh

    # -- setup ------------------------------------------------------------------------------------

    def _take_settings(self, job: Any) -> None:
        """Fill the arguments left None from the job's settings (the launcher's flags)."""
        given = job.settings  # the launcher's flags, read once by conveyor.init (JobSettings)
        self.stages = self.stages if self.stages is not None else given.stages
        self.microbatches = self.microbatches if self.microbatches is not None else given.microbatches
        self.schedule = self.schedule or given.schedule or "1f1b"
        self.split = self.split if self.split is not None else (list(given.split) if given.split else None)
        if self.shard_stages is None:
            self.shard_stages = bool(getattr(given, "shard_stages", False))
        schedule_class(self.schedule)

    def setup(self, job: Any) -> None:
        super().setup(job)
        self._take_settings(job)
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
        if self.microbatches is not None and self.microbatches < 1:  # None: fitted to the first batch (runner.py)
            raise SplitError(f"--microbatches {self.microbatches}: expected a whole number >= 1")
        if self.microbatches is not None:  # refused before any process group, not at the first step
            check_schedule(schedule_class(self.schedule), self.microbatches, stages)
        self.replicas, self.stage, self.replica = world // stages, job.rank % stages, job.rank // stages
        if self.shard_stages:
            try:
                replicas_for_shards(self.replicas, stages, world)
            except ValueError as e:
                raise SplitError(str(e)) from None
        self._make_groups(job, stages)
        if self.shard_stages:
            self._mesh = stage_mesh(job, self._stage_group)
        self.step = PipelineStep(job, name=self.name, stage=self.stage, replicas=self.replicas,
                                 stage_group=self._stage_group, sharded=bool(self.shard_stages))

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

    def prepare(self, model: nn.Module, optimizer: Any, *, split: Sequence[str] | None = None
                ) -> tuple[nn.Module, Any]:
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
        stage_optimizer = _stage_optimizer(optimizer, module)
        if self.shard_stages:  # split first, then shard each stage (torchtitan's order; sharded.py)
            shard_stage(job, module, stage_optimizer, self._mesh)
        self.runner = StageRunner(module, meta_model, plan, self.stage, self._pipe_group, job.device,
                                  microbatches=self.microbatches, schedule=self.schedule)
        self._give_step()
        return module, stage_optimizer

    def _prepare_traced(self, model: nn.Module, optimizer: Any, plan: TracedPlan) -> tuple[nn.Module, Any]:
        """The whole model and an optimizer over all of it, until the first batch decides the stage (traced.py)."""
        if self.shard_stages:
            raise SplitError(f"--shard-stages shards the stages of an nn.Sequential; this {type(model).__name__} is "
                             f"cut by tracing at its first batch, which sharding does not follow yet: write the model "
                             f"as an nn.Sequential (cut with --stages or --split), or drop --shard-stages")
        self.module = module = TracedStage(model)
        self._optimizer = stage_optimizer = _stage_optimizer(optimizer, model)
        self.runner = TracedRunner(module, TracedSplit(model, plan), self.stage, self._pipe_group, self.job.device,
                                   microbatches=self.microbatches, schedule=self.schedule,
                                   adopted=self._adopted)
        self._give_step()
        return module, stage_optimizer

    def _give_step(self) -> None:
        """The step trains this process's stage (``prepare`` runs after ``setup``, which built the step)."""
        if not isinstance(self.step, PipelineStep):
            raise RuntimeError("strategy 'pipeline' is not set up: get it from conveyor.init() (job.strategy), or "
                               "call strategy.setup(job) first")
        self.step.runner, self.step.module = self.runner, self.module

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

    def report(self, summary: dict[str, Any]) -> dict[str, Any] | None:
        """``summary["pipeline"]``: per-stage compute, send/receive wait, measured and theoretical bubble."""
        if self.runner is None or self.plan is None:
            return None
        mine = {"stage": self.stage, **self.runner.seconds}
        reports = [json.loads(b) for b in self.job.all_gather_bytes(json.dumps(mine).encode())]
        microbatches = self.runner.microbatches or default_microbatches(self.plan.num_stages)
        return {"pipeline": pipeline_figures(reports, stages=self.plan.num_stages, microbatches=microbatches,
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
