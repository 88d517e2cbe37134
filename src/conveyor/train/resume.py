"""Resuming a training run: which checkpoint, and every item of it restored in order.

    ckpt = resume(job, checkpoints, items)     # None: a fresh start; else ckpt.step is where the run goes on

The chief picks the step (every rank loads the same one), skipping damaged steps out loud and
refusing when every step is damaged. Each item (`conveyor.train.checkpoint.items`) restores itself;
one that does not fit this job is refused naming the item and the fix.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping
from typing import Any

from conveyor.train.checkpoint import Checkpoint, CheckpointError, CheckpointManager, Item, ResumeError
from conveyor.train.position import DataPosition, optimizer_name

__all__ = ["DataPosition", "ResumeError", "announcement", "describe", "optimizer_name", "restore", "resume"]


def resume(job: Any, checkpoints: CheckpointManager, items: Mapping[str, Item]) -> Checkpoint | None:
    """Load the latest checkpoint into every one of `items` (None: nothing to resume)."""
    if not job.resume:
        return None
    step = _chiefs_latest_step(job, checkpoints)
    if step is None:
        return None
    ckpt = checkpoints.load(step)
    if job.is_chief:
        print(f"resumed from {describe(ckpt)}", file=sys.stderr, flush=True)
    restore(job, ckpt, items)
    return ckpt


def restore(job: Any, ckpt: Checkpoint, items: Mapping[str, Item]) -> None:
    """Check, then restore, every one of `items` from `ckpt`; the chief announces what was re-dealt for a job of
    another shape in one line (`announcement`)."""
    for name, item in items.items():  # first: another model is refused as such, not as a worker-count mismatch
        item.check(name, ckpt)
    for name, item in items.items():
        try:
            item.restore(name, ckpt)
        except (KeyError, TypeError, ValueError) as e:  # e.g. torch's own complaints about a state of another shape
            raise ResumeError(f"checkpoint {ckpt.path} cannot be resumed by this job: its {name!r} (written by "
                              f"strategy {ckpt.extra.get('strategy', '?')}) does not fit this job's (strategy "
                              f"{job.strategy.name}): {e}. Resume with the setup that wrote it, or "
                              + ckpt.start_over()) from e
    line = announcement(ckpt, int(job.world_size))
    if line is not None and job.is_chief:
        print(line, file=sys.stderr, flush=True)


def announcement(ckpt: Checkpoint, world: int) -> str | None:
    """"resumed step 120, written by 4 workers with 2 ps tasks, on 3 workers with 1: data and shards
    redistributed (...)" from what the items noted in `ckpt.reworld`; None when nothing was re-dealt."""
    if not ckpt.reworld:
        return None
    counts = {count: (saved, now) for count, saved, now, _, _ in ckpt.reworld}
    saved, now = counts.get("workers", (ckpt.extra.get("world_size", world), world))
    ps = counts.get("ps tasks")
    moved = " and ".join(dict.fromkeys(what for _, _, _, what, _ in ckpt.reworld))
    details = "; ".join(d for *_, d in ckpt.reworld if d)
    return (f"resumed step {ckpt.step}, written by {saved} workers{f' with {ps[0]} ps tasks' if ps else ''}, on "
            f"{now} workers{f' with {ps[1]}' if ps else ''}: {moved} redistributed"
            + (f" ({details})" if details else ""))


def describe(ckpt: Checkpoint) -> str:
    """"step N (<folder>), written <when> by a job of W worker(s), strategy S, in epoch E"."""
    extra = ckpt.extra
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ckpt.time)) if ckpt.time else "at an unknown time"
    return (f"step {ckpt.step} ({ckpt.path}), written {when} by a job of {extra.get('world_size', '?')} "
            f"worker(s), strategy {extra.get('strategy', '?')}, in epoch {extra.get('epoch', '?')}")


def _chiefs_latest_step(job: Any, checkpoints: CheckpointManager) -> int | None:
    mine = None
    if job.is_chief:
        try:  # skips damaged steps with a warning each; refuses when every step is damaged
            mine = {"step": checkpoints.resume_step()}
            # Before the broadcast, so before any task trains: an abandoned attempt's staged parts of later
            # steps must not end up in this attempt's saves of them.
            checkpoints.drop_staged_from(mine["step"])
            checkpoints.remove_leftovers()  # crashed saves' folders, once nothing can still be writing them
        except CheckpointError as e:
            mine = {"error": str(e)}
    data = json.loads(bytes(job.broadcast_bytes(json.dumps(mine).encode() if job.is_chief else None, src=0)))
    if "error" in data:  # every rank refuses, not only the chief
        raise CheckpointError(data["error"])
    return data["step"]
