"""FSDP2 shards as plain tensors and back, and their re-split for another number of shards: shared by the fsdp
strategy (``fsdp/``) and pipeline × FSDP (``pipeline/sharded.py``).

    rebind_optimizer(optimizer, names, module)   # after fully_shard: the groups point at the DTensor parameters
    part = local_shards(state)                   # every DTensor -> this rank's shard (what a part holds)
    state = resharded(parts, sharded, mine, optimizer, rank, world, ckpt)  # saved parts -> this rank's, re-cut
    differ = copy_into_shards(mine, state["model"])                         # in place; the differing keys, if any
    optimizer.load_state_dict(sharded_like(optimizer, state["optimizer"]))  # local shards -> DTensors again

The contract: FSDP2 shards every parameter on dim 0 (``Shard(0)``) in ``torch.chunk``'s cut, so rank r of W
holds chunk r of W (later ranks may hold nothing). A part is one rank's ``local_shards`` of a model state dict
(under the names the caller chooses: the model's, or the whole model's for a pipeline stage) and of its
optimizer's state dict (a per-element state entry is sharded like its parameter; scalars such as Adam's
``step`` are the same on every rank). ``resharded`` joins each sharded tensor from all saved parts in rank
order and keeps this rank's chunk of a cut into ``world``: a copy, so bit-identical, checked against this
rank's own shard shapes; buffers and scalars come from saved part 0. Errors: ``ResumeError`` naming the
tensor, the shapes and the fix.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from conveyor.train.checkpoint.read import Checkpoint, ResumeError

__all__ = ["copy_into_shards", "local_shards", "rebind_optimizer", "resharded", "sharded_like"]


def rebind_optimizer(optimizer: Any, names: dict[int, str], module: nn.Module) -> None:
    """Point ``optimizer``'s parameter groups at the sharded parameters that replaced the ones it was built with
    (``names``: ``id(parameter) -> name`` taken before ``fully_shard``)."""
    groups = getattr(optimizer, "param_groups", None)
    if groups is None:
        return
    now = dict(module.named_parameters())
    for group in groups:
        group["params"] = [now[names[id(p)]] for p in group["params"]]


def local_shards(tree: Any) -> Any:
    """``tree`` with every DTensor replaced by this rank's shard of it (a plain tensor)."""
    if isinstance(tree, DTensor):
        return tree.to_local()
    if isinstance(tree, dict):
        return {k: local_shards(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(local_shards(v) for v in tree)
    return tree


def resharded(parts: list[Any], sharded: Any, mine: dict[str, Any], optimizer: Any, rank: int, world: int,
              ckpt: Checkpoint) -> dict[str, Any]:
    """This rank's part as a job of `world` shards would have written it (module docstring). ``parts``: the saved
    parts in rank order, each ``{"model": ..., "optimizer": ...}``; ``sharded``: the names of the sharded model
    tensors (a dict or set); ``mine``: this rank's state dict under the saved names (its DTensors give the check)."""
    model = {k: (_my_rows(ckpt, k, [p["model"][k] for p in parts], mine.get(k), rank, world)
                 if k in sharded else v) for k, v in parts[0]["model"].items()}
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


def sharded_like(optimizer: Any, saved: dict[str, Any]) -> dict[str, Any]:
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
