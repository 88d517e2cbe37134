"""The fsdp strategy's checkpoint item: one part per rank, written by that rank, holding its own shards.

    items = strategy.checkpoint_items(model, optimizer)      # {"fsdp": ShardsItem(strategy, model, optimizer)}

Rank r writes part ``fsdp-rank-<r>``: its local shard of every parameter (a DTensor's ``to_local()``) and
the buffers, under the model's own names, and its optimizer state (the state of each sharded parameter
is sharded alike; its local shards are written). Nothing is gathered on one rank. The chief writes the
header tree ``fsdp`` (format, world size, blocks, part names, each sharded tensor's whole shape). On
resume every rank reads its own part back into its shards; :func:`full_model` joins every rank's
shards into the whole model in memory (``conveyor checkpoint export`` reads the same layout a tensor at a time:
``conveyor.train.checkpoint.sources``). A checkpoint of another number of ranks,
or of another strategy, is refused naming why: resharding comes with elastic resume.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from conveyor.train.checkpoint.items import Item, StepWrite
from conveyor.train.checkpoint.read import Checkpoint, ResumeError

__all__ = ["CHECKPOINT_FORMAT", "ShardsItem", "full_model"]

CHECKPOINT_FORMAT = "conveyor.fsdp.shards"


def _part(rank: int) -> str:
    return f"fsdp-rank-{rank}"


class ShardsItem(Item):
    """Every rank's shards of the model and optimizer, as parts (module docstring)."""

    def __init__(self, strategy: Any, module: nn.Module, optimizer: Any):
        self.strategy, self.module, self.optimizer = strategy, module, optimizer

    def save(self, name: str, out: StepWrite) -> None:
        job = self.strategy.job
        world, rank = int(job.world_size), int(job.rank)
        model = self.module.state_dict()
        out.part_tree(_part(rank), {"rank": rank, "world": world, "model": _local(model),
                                    "optimizer": _local(self.optimizer.state_dict())})
        if out.is_chief:
            names = [_part(r) for r in range(world)]
            sharded = {k: list(v.shape) for k, v in model.items() if isinstance(v, DTensor)}
            out.tree(name, {"format": CHECKPOINT_FORMAT, "world": world, "parts": names, "sharded": sharded,
                            "blocks": [b for b in self.strategy.sharded if b]})
            out.expect(f"{n}.{ext}" for n in names for ext in ("safetensors", "json"))

    def check(self, name: str, ckpt: Checkpoint) -> None:
        """Refuse a checkpoint of another strategy or another number of ranks, naming why."""
        world = int(self.strategy.job.world_size)
        header = ckpt.trees.get(name)
        if not (isinstance(header, dict) and header.get("format") == CHECKPOINT_FORMAT):
            raise ResumeError(f"checkpoint {ckpt.path} was not written by the fsdp strategy (it has no {name!r} "
                              f"shards): resume it with the strategy that wrote it, or start over with --no-resume; "
                              f"reading another strategy's checkpoint into shards comes with elastic resume")
        saved = int(header["world"])
        if saved != world:
            raise ResumeError(f"checkpoint {ckpt.path} holds fsdp shards of {saved} ranks and this job has {world}: "
                              f"each rank reads back its own shards, so resume with -n {saved} (resharding onto "
                              f"another number of ranks comes with elastic resume), or start over with --no-resume")

    def restore(self, name: str, ckpt: Checkpoint) -> None:
        self.check(name, ckpt)
        state = ckpt.part_tree(_part(int(self.strategy.job.rank)))
        _load_model(self.module, state["model"], ckpt)
        self.optimizer.load_state_dict(_sharded_like(self.optimizer, state["optimizer"]))


def _local(tree: Any) -> Any:
    """``tree`` with every DTensor replaced by this rank's shard of it (a plain tensor)."""
    if isinstance(tree, DTensor):
        return tree.to_local()
    if isinstance(tree, dict):
        return {k: _local(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_local(v) for v in tree)
    return tree


def _load_model(module: nn.Module, saved: dict[str, Any], ckpt: Checkpoint) -> None:
    """Copy the saved shards into this rank's shards (and the buffers into the buffers), in place."""
    mine = module.state_dict()
    local = {k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in mine.items()}
    differ = sorted(k for k in local.keys() | saved.keys()
                    if k not in local or k not in saved or tuple(local[k].shape) != tuple(saved[k].shape))
    if differ:
        raise ResumeError(f"checkpoint {ckpt.path} holds fsdp shards of another model or other blocks than this "
                          f"job's (differing: {', '.join(differ[:5])}{' ...' if len(differ) > 5 else ''}): run the "
                          f"model and --fsdp-blocks that wrote it, or start over with --no-resume")
    with torch.no_grad():
        for k, tensor in local.items():
            tensor.copy_(saved[k])


def _sharded_like(optimizer: Any, saved: dict[str, Any]) -> dict[str, Any]:
    """The saved optimizer state with each parameter's local shards made DTensors again, placed as the parameter."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for index, entry in saved.get("state", {}).items():
        param = params[int(index)]
        if isinstance(param, DTensor):
            shard = param.to_local().shape
            entry = {k: DTensor.from_local(v.to(param.device), param.device_mesh, param.placements, run_check=False,
                                           shape=param.shape, stride=param.stride())
                     if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == shard else v
                     for k, v in entry.items()}
        state[index] = entry
    return {**saved, "state": state}


def full_model(ckpt: Checkpoint, header: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The whole model's state from every rank's part: FSDP2 shards a tensor into dim-0 chunks, rank r holding
    chunk r (``torch.chunk``; later ranks may hold none), so the shards in rank order concatenate to it."""
    shards: dict[str, list[torch.Tensor]] = {}
    state: dict[str, torch.Tensor] = {}
    for rank, part in enumerate(header["parts"]):
        model = ckpt.part_tree(part)["model"]
        for k, v in model.items():
            if k in header["sharded"]:
                shards.setdefault(k, []).append(v)
            elif rank == 0:
                state[k] = v
    for k, shape in header["sharded"].items():
        whole = torch.cat(shards[k], dim=0)
        if list(whole.shape) != list(shape):
            raise ValueError(f"checkpoint {ckpt.path}: the shards of {k} join to {list(whole.shape)}, not the "
                             f"{shape} the header says: the step is damaged")
        state[k] = whole
    return state
