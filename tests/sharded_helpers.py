"""What the sharded strategies' tests share (tests/strategies/test_fsdp.py, test_fsdp_reshard.py,
test_pipeline_sharded.py): the small model the fsdp tests shard, and a checkpoint step written as the Trainer does.

    model = Net(width=8, depth=3)   # embed 4 -> width, `depth` residual tanh blocks in a ModuleList, head -> 1
    write_step(job, items, manager, step)   # every rank's parts of the strategy's items, then (the chief) the step

Net has repeated blocks in a ModuleList, with a head: the shape FSDP shards block by block (the blocks are its
default). A width that does not divide by the number of ranks gives FSDP2's uneven dim-0 chunks. The workers
these tests start import this module too: their launches put this folder on PYTHONPATH (``WORKER_PATH``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["WORKER_PATH", "Net", "write_step"]

WORKER_PATH = os.pathsep.join(p for p in (str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH")) if p)


class Net(nn.Module):
    """embed (4 -> width), `depth` blocks x -> tanh(layer(x)) + x, head (width -> 1)."""

    def __init__(self, width: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(4, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = torch.tanh(layer(x)) + x
        return self.head(x)


def write_step(job: Any, items: dict[str, Any], manager: Any, step: int) -> None:
    """Checkpoint step `step` into `manager` (a CheckpointManager) through the strategy's checkpoint `items`,
    synchronously: this rank's parts, and on the chief the step folder once every expected part is there."""
    from conveyor.train.checkpoint import StepWrite, commit

    write = StepWrite(step, is_chief=bool(job.is_chief), root=manager.root)
    for name, item in items.items():
        item.save(name, write)
    commit(manager, write, timeout=60)
