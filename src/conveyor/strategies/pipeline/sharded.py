"""Pipeline × FSDP (``--shard-stages``): each stage's module sharded with FSDP2 across the replicas of the stage.

    mesh = stage_mesh(job, stage_group)        # the stage's replicas as a 1-D DeviceMesh, gradient average checked
    shard_stage(job, module, optimizer, mesh)  # fully_shard each layer with parameters, then the stage; rebound
    save_shard(strategy, optimizer, out) / restore_shard(strategy, optimizer, header, ckpt)

torchtitan's order: the model is split into stages first (split.py), then each stage is sharded across its
replicas, with ``reshard_after_forward=False``: what a stage gathers at its first microbatch stays gathered
until its last backward, instead of one all-gather per microbatch. torch's ``PipelineStage`` drives FSDP2
when its module is an ``FSDPModule``: each microbatch's backward accumulates unsharded gradients without a
reduction (``set_requires_gradient_sync(False)``), and the schedule's last action (``perform_reduce_grad``:
``set_is_last_backward(True)``, post-backward) reduce-scatters them once per step, averaged over the stage's
replicas, and reshards. That replaces step.py's gradient all-reduce among replicas.

Checkpoints: the process of stage s and replica r writes part ``stage-<s>-shard-<r>`` (its local shards under
the whole model's names, and its optimizer state's shards); the chief's header adds ``shards`` and each
stage's sharded tensors with their whole shapes (from the meta model). A resume on another number of
replicas re-splits each stage's shards as the fsdp strategy does (``fsdp/shards.py``); a checkpoint of
unsharded stages loads into shards the same way (one saved part per stage). Export: ``checkpoint/sources.py``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from conveyor.strategies.fsdp.check import check_gradients_averaged
from conveyor.strategies.fsdp.shards import copy_into_shards, local_shards, rebind_optimizer, resharded, sharded_like
from conveyor.train.checkpoint.items import StepWrite
from conveyor.train.checkpoint.read import Checkpoint, ResumeError

__all__ = ["restore_shard", "save_shard", "shard_part", "shard_stage", "sharded_header", "stage_mesh"]


def shard_part(stage: int, shard: int) -> str:
    return f"stage-{stage}-shard-{shard}"


def stage_mesh(job: Any, group: Any) -> DeviceMesh:
    """This stage's replicas (``group``) as FSDP2's mesh; every process checks that FSDP averages over it."""
    mesh = DeviceMesh.from_group(group, job.device.type)
    check_gradients_averaged(job, mesh)
    return mesh


def shard_stage(job: Any, module: nn.Module, optimizer: Any, mesh: DeviceMesh) -> None:
    """``fully_shard`` on each of the stage's layers that holds parameters, then on the stage (the root), kept
    gathered from forward to backward; ``optimizer`` (built over the stage) is pointed at the shards."""
    names = {id(p): n for n, p in module.named_parameters()}
    options: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": False}
    if job.device.type == "cuda":  # as the fsdp strategy: bf16 compute, fp32 gradient reduction
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in module.layers:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, **options)
    fully_shard(module, **options)
    rebind_optimizer(optimizer, names, module)


def sharded_header(strategy: Any) -> dict[str, Any]:
    """What the chief adds to the pipeline header: the shards per stage and each stage's sharded tensors (every
    parameter) with their whole shapes, read off the meta model (the chief holds stage 0 only)."""
    runner = strategy.runner
    sharded = [{key: list(p.shape) for key, p in runner.meta_stage(i).model_parameters().items()}
               for i in range(runner.num_stages)]
    return {"shards": int(strategy.replicas), "sharded": sharded}


def save_shard(strategy: Any, optimizer: Any, out: StepWrite) -> None:
    """This process's part: its shards of the stage's parameters (and the buffers) and of the optimizer state."""
    s = strategy
    out.part_tree(shard_part(s.stage, s.replica), {"stage": s.stage, "shard": s.replica, "shards": s.replicas,
                                                   "model": local_shards(s.module.model_state_dict()),
                                                   "optimizer": local_shards(optimizer.state_dict())})


def restore_shard(strategy: Any, optimizer: Any, header: dict[str, Any], ckpt: Checkpoint) -> None:
    """This process's shards back; another number of shards, or unsharded stages, re-split (module docstring)."""
    s = strategy
    shards = header.get("shards")
    if shards == s.replicas:
        state = ckpt.part_tree(shard_part(s.stage, s.replica))
    else:
        if shards:
            parts = [ckpt.part_tree(shard_part(s.stage, r)) for r in range(int(shards))]
            sharded = header["sharded"][s.stage]
        else:  # written without --shard-stages: one whole part per stage
            parts = [ckpt.part_tree(f"stage-{s.stage}")]
            sharded = s.module.model_parameters()
        state = resharded(parts, sharded, s.module.model_state_dict(), optimizer, s.replica, s.replicas, ckpt)
        # said in the chief's one resume line with the data's (train/resume.py: announcement), as under fsdp
        saved = int(header.get("replicas") or shards or 1) * s.runner.num_stages
        ckpt.reworld.append(("workers", saved, int(s.job.world_size), "shards",
                             f"each stage's {shards} shards re-split into {s.replicas}" if shards else
                             f"each stage's whole part split into {s.replicas} shards"))
    _load_local(s.module, state["model"], ckpt)
    optimizer.load_state_dict(sharded_like(optimizer, state["optimizer"]))


def _load_local(module: Any, saved: dict[str, Any], ckpt: Checkpoint) -> None:
    """Copy the saved shards (whole-model names) into this process's shards and buffers, in place."""
    differ = copy_into_shards(module.model_state_dict(), saved)
    if differ:
        raise ResumeError(f"checkpoint {ckpt.path} holds stage shards of another model than this stage's layers "
                          f"{module.layer_names} (differing: {', '.join(differ[:5])}): run the model and split that "
                          f"wrote it, or start over with --no-resume")
