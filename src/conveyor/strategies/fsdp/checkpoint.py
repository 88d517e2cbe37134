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
copy: bit-identical; docs/strategies.md, "FSDP: resuming on another number of ranks"; the shard helpers:
:mod:`.shards`). Another strategy's checkpoint is refused naming why.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor

from conveyor.strategies.fsdp.shards import copy_into_shards, local_shards, resharded, sharded_like
from conveyor.train.checkpoint.items import Item, StepWrite
from conveyor.train.checkpoint.read import Checkpoint, ResumeError

__all__ = ["CHECKPOINT_FORMAT", "ShardsItem"]

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
        out.part_tree(_part(rank), {"rank": rank, "world": world, "model": local_shards(model),
                                    "optimizer": local_shards(self.optimizer.state_dict())})
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
            state = resharded([ckpt.part_tree(p) for p in header["parts"]], header["sharded"],
                              self.module.state_dict(), self.optimizer, rank, world, ckpt)
            ckpt.reworld.append(("workers", saved, world, "shards", ""))
        _load_model(self.module, state["model"], ckpt)
        self.optimizer.load_state_dict(sharded_like(self.optimizer, state["optimizer"]))


def _load_model(module: nn.Module, saved: dict[str, Any], ckpt: Checkpoint) -> None:
    """Copy the saved shards into this rank's shards (and the buffers into the buffers), in place."""
    differ = copy_into_shards(module.state_dict(), saved)
    if differ:
        raise ResumeError(f"checkpoint {ckpt.path} holds fsdp shards of another model or other blocks than this "
                          f"job's (differing: {', '.join(differ[:5])}{' ...' if len(differ) > 5 else ''}): run the "
                          f"model and --fsdp-blocks that wrote it, or start over with --no-resume")
