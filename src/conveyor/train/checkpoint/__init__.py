"""Checkpoints that a reader on another machine never sees half-written, in safetensors + JSON.

    mgr = CheckpointManager(output_dir / "checkpoints")
    mgr.save_part(1000, "ps-0.safetensors", data)                  # on every other task that owns state
    mgr.save(1000, {"model": model.state_dict(), "optimizer": opt.state_dict()}, extra={"epoch": 2},
             parts=["ps-0.safetensors"], parts_timeout=60)         # on the chief
    step = mgr.resume_step()                                       # None: start fresh
    ckpt = mgr.load(verify=True)                                   # ckpt.trees["model"], ckpt.read_part(...)

What it promises: a `step-XXXXXXXX` folder appears by one atomic rename, complete with every expected
part and listed with sizes and sha256 in its `COMPLETE` manifest, or not at all; `latest` and rotation
never expose a partial folder; `resume_step()` passes over damaged steps with a warning and raises
`CheckpointError` only when every step is damaged; nothing read from the folder is trusted. The
manager stores named trees, JSON documents and parts without knowing what they are; `items` says
how a training run's state becomes them (one `Item` per name). `store` writes, finds and rotates,
`write` fills and seals one step, `read` reads one back, `policy` says when; `staging` copies state to
the host and `background` runs a save's write beside training (`stage_commit`). The layout on disk
and the reasons: `docs/training.md`, "Checkpoints on disk".
"""

from __future__ import annotations

from conveyor.train.checkpoint.background import BackgroundSaves
from conveyor.train.checkpoint.items import Item, Model, Stateful, StepWrite, commit, stage_commit
from conveyor.train.checkpoint.policy import CheckpointPolicy
from conveyor.train.checkpoint.read import (
    FORMAT,
    LATEST,
    MANIFEST,
    MANIFEST_MAX_BYTES,
    PART_NAME_MAX,
    VERSION,
    Checkpoint,
    CheckpointError,
    ResumeError,
)
from conveyor.train.checkpoint.store import CheckpointManager, CheckpointReader

__all__ = [
    "FORMAT", "LATEST", "MANIFEST", "MANIFEST_MAX_BYTES", "PART_NAME_MAX", "VERSION", "BackgroundSaves",
    "Checkpoint", "CheckpointError", "CheckpointManager", "CheckpointPolicy", "CheckpointReader", "Item", "Model",
    "ResumeError", "Stateful", "StepWrite", "commit", "stage_commit",
]
