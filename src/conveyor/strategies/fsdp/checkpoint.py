"""The fsdp strategy's checkpoint item: one part per rank, written by that rank, holding its own shards.

    items = strategy.checkpoint_items(model, optimizer)      # {"fsdp": ShardsItem(strategy, model, optimizer)}

Rank r writes part ``fsdp-rank-<r>``: its local shard of every parameter (a DTensor's ``to_local()``) and
the buffers, under the model's own names, and its optimizer state (the state of each sharded parameter
is sharded alike; its local shards are written). Nothing is gathered on one rank. The chief writes the
header tree ``fsdp`` (format, world size, blocks, part names, each sharded tensor's whole shape). On resume
every rank reads its own part back into its shards; ``conveyor checkpoint export`` joins every rank's shards
into the whole model a tensor at a time (``conveyor.train.checkpoint.sources``). A checkpoint of another
number of ranks is re-split on load: every rank joins each sharded tensor (parameters and their per-element
optimizer state) from all saved parts and keeps its own dim-0 chunk, as FSDP2 cuts it for this world (a
copy: bit-identical; docs/strategies.md, "FSDP: resuming on another number of ranks"). Another strategy's
checkpoint is refused naming why.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from conveyor.train.checkpoint.items import Item, StepWrite
from conveyor.train.checkpoint.read import Checkpoint, ResumeError

__all__ = ["CHECKPOINT_FORMAT", "ShardsItem", "copy_into_shards"]

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
        """Refuse a checkpoint of another strategy, naming why (another number of ranks is re-split on restore)."""
        header = ckpt.trees.get(name)
        if not (isinstance(header, dict) and header.get("format") == CHECKPOINT_FORMAT):
            raise ResumeError(f"checkpoint {ckpt.path} was not written by the fsdp strategy (it has no {name!r} "
                              f"shards): resume it with the strategy that wrote it, or start over with --no-resume; "
                              f"reading another strategy's checkpoint into shards comes with elastic resume")

    def restore(self, name: str, ckpt: Checkpoint) -> None:
        self.check(name, ckpt)
        job, header = self.strategy.job, ckpt.tree(name)
        rank, world, saved = int(job.rank), int(job.world_size), int(header["world"])
        if saved == world:
            state = ckpt.part_tree(_part(rank))
        else:
            state = _resharded([ckpt.part_tree(p) for p in header["parts"]], header, self.module, self.optimizer,
                               rank, world, ckpt)
            ckpt.reworld.append(("workers", saved, world, "shards", ""))
        _load_model(self.module, state["model"], ckpt)
        self.optimizer.load_state_dict(_sharded_like(self.optimizer, state["optimizer"]))


def _resharded(parts: list[Any], header: dict[str, Any], module: nn.Module, optimizer: Any, rank: int, world: int,
               ckpt: Checkpoint) -> dict[str, Any]:
    """This rank's part as a job of `world` ranks would have written it: each sharded tensor joined from every
    saved rank's part (dim-0 chunks in rank order) and cut again into `world` chunks, of which rank keeps its own.
    Buffers and per-parameter scalars (Adam's ``step``) are the same on every rank: saved rank 0's."""
    mine = module.state_dict()
    model = {k: (_my_rows(ckpt, k, [p["model"][k] for p in parts], mine.get(k), rank, world)
                 if k in header["sharded"] else v) for k, v in parts[0]["model"].items()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for index, entry in parts[0]["optimizer"].get("state", {}).items():
        param = params[int(index)] if int(index) < len(params) else None
        state[index] = {k: (_my_rows(ckpt, f"optimizer state {k!r} of parameter {index}",
                                     [p["optimizer"]["state"][index][k] for p in parts], param, rank, world)
                            if _sharded_state(v, param) else v) for k, v in entry.items()}
    return {"model": model, "optimizer": {**parts[0]["optimizer"], "state": state}}


def _sharded_state(value: Any, param: Any) -> bool:
    """Whether an optimizer state entry is sharded like its parameter (per element) rather than one value."""
    return (isinstance(param, DTensor) and isinstance(value, torch.Tensor) and value.dim() == param.dim() > 0
            and tuple(value.shape[1:]) == tuple(param.shape[1:]))


def _my_rows(ckpt: Checkpoint, what: str, shards: list[torch.Tensor], like: Any, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s chunk of the tensor the saved ranks' `shards` join to, checked against this rank's shard."""
    whole = torch.cat(shards, dim=0)
    chunks = torch.chunk(whole, world, dim=0)  # FSDP2's Shard(0): later ranks may hold nothing
    rows = chunks[rank] if rank < len(chunks) else whole[:0]
    local = like.to_local() if isinstance(like, DTensor) else like
    if isinstance(local, torch.Tensor) and tuple(local.shape) != tuple(rows.shape):
        raise ResumeError(f"checkpoint {ckpt.path}: {what} joins to {list(whole.shape)} from its {len(shards)} "
                          f"saved shards, and this job's rank {rank} of {world} holds {list(local.shape)} of it, not "
                          f"{list(rows.shape)}: another model, or a sharding other than FSDP2's dim-0 chunks; run the "
                          f"model that wrote it, or start over with --no-resume")
    return rows.clone()


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
    differ = copy_into_shards(module.state_dict(), saved)
    if differ:
        raise ResumeError(f"checkpoint {ckpt.path} holds fsdp shards of another model or other blocks than this "
                          f"job's (differing: {', '.join(differ[:5])}{' ...' if len(differ) > 5 else ''}): run the "
                          f"model and --fsdp-blocks that wrote it, or start over with --no-resume")


def copy_into_shards(mine: dict[str, Any], saved: dict[str, Any]) -> list[str]:
    """Copy ``saved`` (local shards and buffers) into ``mine`` (a state dict of DTensors and buffers) in place; or,
    where their keys or local shapes differ, copy nothing and return those keys."""
    local = {k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in mine.items()}
    differ = sorted(k for k in local.keys() | saved.keys()
                    if k not in local or k not in saved or tuple(local[k].shape) != tuple(saved[k].shape))
    if not differ:
        with torch.no_grad():
            for k, tensor in local.items():
                tensor.copy_(saved[k])
    return differ


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
