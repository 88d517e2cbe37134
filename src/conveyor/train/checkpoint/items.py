"""Checkpoint items: the named pieces of a checkpoint, each of which saves and restores itself.

    items = {"model": Model(module), "optimizer": Stateful(optimizer), "scheduler": Stateful(scheduler)}
    out = StepWrite(step, is_chief=job.is_chief, root=checkpoints.root)
    for name, item in items.items():
        item.save(name, out)                 # every rank, in the same order (an item may meet the others)
    commit(checkpoints, out, timeout=60)     # this rank's parts, then (the chief) the step itself
    ckpt = checkpoints.load(step)
    for name, item in items.items():
        item.restore(name, ckpt)             # every rank, in the same order

An item is *stateful* (`Stateful`: an object with `state_dict()` / `load_state_dict()`, written by
the chief as the tree `<name>`) or writes *parts* from the process that owns the state
(`StepWrite.part_tree`, read back with `Checkpoint.part_tree`: pipeline stages, parameter-server
shards). `CheckpointManager` stores what `StepWrite` collected without knowing what any of it is.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conveyor.train.checkpoint.read import Checkpoint, ResumeError
from conveyor.train.state_io import state_to_bytes

__all__ = ["Item", "Model", "Stateful", "StepWrite", "commit", "stage_commit"]


@dataclass
class StepWrite:
    """What the items of one rank contribute to checkpoint step `step` (collected here, written by `commit`).

    `root` is the checkpoint folder (tasks that write their own parts need it); `final` says the run
    ends with this save.
    """

    step: int
    is_chief: bool
    root: Path
    final: bool = False
    trees: dict[str, Any] = field(default_factory=dict)  # the chief's state trees
    docs: dict[str, Any] = field(default_factory=dict)  # the chief's JSON documents, "<group>/<name>"
    extra: dict[str, Any] = field(default_factory=dict)  # the chief's run information (state.json)
    parts: dict[str, bytes] = field(default_factory=dict)  # files this rank contributes
    expected: list[str] = field(default_factory=list)  # parts other tasks contribute that the step must hold

    def tree(self, name: str, tree: Any) -> None:
        """State tree `name` in the step (the chief's; other ranks contribute parts)."""
        if not self.is_chief:
            raise RuntimeError(f"checkpoint tree {name!r} from a rank that is not the chief; write a part instead")
        self.trees[name] = tree

    def part_tree(self, name: str, tree: Any) -> None:
        """State tree `name` from this rank, as parts `<name>.safetensors` + `<name>.json`; the chief `expect`s them."""
        tensors, meta = state_to_bytes(tree)
        self.parts[f"{name}.safetensors"], self.parts[f"{name}.json"] = tensors, meta

    def expect(self, names: Iterable[str]) -> None:
        """Parts that other tasks write into the step: the chief's save waits for them."""
        self.expected.extend(names)


def commit(checkpoints: Any, out: StepWrite, timeout: float) -> Path | None:
    """Write this rank's parts of `out`, then (the chief) the step, waiting up to `timeout` s for expected parts."""
    return stage_commit(checkpoints, out, timeout, copy=False)()


def stage_commit(checkpoints: Any, out: StepWrite, timeout: float, copy: bool = True, buffers: Any = None
                 ) -> Callable[[], Path | None]:
    """`commit` in two halves: copy what `out` holds now (the chief's trees to the host: `CheckpointManager.stage`;
    parts are bytes already) and return the write, which may run in another thread while training goes on
    (`conveyor.train.checkpoint.background`). Parts first, then the step: the chief's write waits for the
    others' parts as before. `copy=False`: the trees are not copied (the write is to follow at once); `buffers`:
    host memory to copy them into (`BackgroundSaves.buffers`)."""
    parts = dict(out.parts)
    staged = None
    if out.is_chief:
        staged = checkpoints.stage(out.step, out.trees, docs=out.docs, extra=out.extra, parts=out.expected,
                                   parts_timeout=timeout, copy=copy, buffers=buffers)

    def write() -> Path | None:
        for name, data in parts.items():
            checkpoints.save_part(out.step, name, data)
        return None if staged is None else checkpoints.write_staged(staged)

    return write


class Item(ABC):
    """One named piece of a checkpoint. Every rank calls `save` at each checkpoint and `restore` on resume,
    items in the same order; errors of `restore` that are `KeyError`, `TypeError` or `ValueError` are
    reported as a checkpoint this job cannot resume, naming the item."""

    @abstractmethod
    def save(self, name: str, out: StepWrite) -> None:
        """Add this item to the step being written."""

    @abstractmethod
    def restore(self, name: str, ckpt: Checkpoint) -> None:
        """Load this item back from `ckpt`."""

    def check(self, name: str, ckpt: Checkpoint) -> None:
        """Refuse `ckpt` before any item is restored (`ResumeError`), where this item can tell without loading
        it; resume asks every item first, so that the most telling refusal is the one said. Default: nothing."""
        return None


class Stateful(Item):
    """An object with `state_dict()` / `load_state_dict()` (an optimizer, an LR scheduler, a module): the chief
    writes its state as tree `<name>`; every rank loads it back. A checkpoint without it is refused, naming the fix."""

    def __init__(self, obj: Any):
        self.obj = obj

    def save(self, name: str, out: StepWrite) -> None:
        if out.is_chief:
            out.tree(name, self.obj.state_dict())

    def restore(self, name: str, ckpt: Checkpoint) -> None:
        self.obj.load_state_dict(ckpt.tree(name))


class Model(Stateful):
    """A module: `Stateful`, and a checkpoint of another model is refused naming what differs (before torch's
    own error would)."""

    def restore(self, name: str, ckpt: Checkpoint) -> None:
        self.check(name, ckpt)
        self.obj.load_state_dict(ckpt.tree(name))

    def check(self, name: str, ckpt: Checkpoint) -> None:
        saved_state = ckpt.tree(name)
        mine = {k: tuple(v.shape) for k, v in self.obj.state_dict().items()}
        saved = {k: tuple(getattr(v, "shape", ())) for k, v in (saved_state or {}).items()}
        missing, unexpected = sorted(mine.keys() - saved.keys()), sorted(saved.keys() - mine.keys())
        reshaped = [f"{k} {saved[k]} in the checkpoint, {mine[k]} here" for k in sorted(mine.keys() & saved.keys())
                    if mine[k] != saved[k]]
        if missing or unexpected or reshaped:
            what = [f"{label}: {_some(names)}" for label, names in (
                ("not in the checkpoint", missing), ("not in this model", unexpected), ("other shapes", reshaped))
                if names]
            # Most often another script's run in the same folder (./output is every script's default):
            # --no-resume would mix the two runs' files in one folder; a folder of its own keeps both.
            raise ResumeError(f"checkpoint {ckpt.path} holds another model than this job's ({'; '.join(what)}): "
                              f"another script's run, perhaps (the default output folder is shared by every script "
                              f"run from one folder). To train this one, start over with --no-resume "
                              f"(CONVEYOR_RESUME=0), among that run's files, or, keeping both, give it an output "
                              f"folder of its own: --output-dir {ckpt.root.parent}/<name>; to keep training that "
                              f"one, run the model that wrote it")


def _some(names: list[str], limit: int = 5) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
