"""Sharded data parallelism with PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``): ``--strategy fsdp``.

    job = conveyor.init("fsdp")                       # or conveyor run --strategy fsdp [--fsdp-blocks a,b]
    model, optimizer = job.prepare(model, optimizer)  # each block sharded, then the root; optimizer rebound

:mod:`.strategy` holds the strategy and its step, :mod:`.check` the start-up check that gradients are
averaged (pytorch#162338), :mod:`.checkpoint` the checkpoint item (one part per rank),
:mod:`.shards` the shard helpers it shares with pipeline × FSDP (``pipeline/sharded.py``). Imported when
asked for (``conveyor.strategies.get_strategy("fsdp")``): FSDP2 brings in DTensor at import.
"""

from __future__ import annotations

from conveyor.strategies.fsdp.check import GradientAverageError, check_gradients_averaged
from conveyor.strategies.fsdp.checkpoint import CHECKPOINT_FORMAT, ShardsItem
from conveyor.strategies.fsdp.strategy import FSDPStep, FSDPStrategy, default_blocks

__all__ = ["CHECKPOINT_FORMAT", "FSDPStep", "FSDPStrategy", "GradientAverageError", "ShardsItem",
           "check_gradients_averaged", "default_blocks"]
