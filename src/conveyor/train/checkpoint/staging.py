"""Staging: copying a state tree to the host, so that training may change the original while it is written.

    staged = stage_tree("model", model.state_dict())   # in the training loop: flatten, copy every tensor
    staged.ready()                                       # in the writer: wait for the copies from a GPU
    save_tensors(path, staged.tensors); staged.meta      # the tree as `state_io.flatten_state` splits it

What it promises: after `stage_tree` returns, nothing the caller does to the tensors of `tree` (an
optimizer step, a `load_state_dict`) changes what is written. A CPU tensor is cloned; a CUDA tensor is
copied into pinned host memory without blocking (`non_blocking=True`) and an event is recorded after the
copies on each device's current stream: later kernels on that stream run after the copy, so the
training loop need not wait, and `ready()` (the writer, before it reads the copies) does. This is the
part of an asynchronous save that blocks the loop (`conveyor.train.checkpoint.background`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from conveyor.train.state_io import flatten_state

__all__ = ["HostBuffers", "StagedTree", "host_copies", "stage_tree"]


@dataclass(frozen=True)
class StagedTree:
    """One tree staged for writing: its tensors (host copies) and its JSON description (`flatten_state`'s)."""

    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]
    ready: Callable[[], None] = field(default=lambda: None)


class HostBuffers:
    """Host memory that one save's copies reuse from the save before: no page faults, no pinned allocation per
    save (a fresh 150 MB copy is mostly the kernel zeroing pages). Only for saves whose writes never overlap —
    the write of the save before has read its copies when the next is staged, as `BackgroundSaves` ensures."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._previous: dict[str, torch.Tensor] = {}

    def start(self) -> None:
        """A new save: buffers it does not ask for are let go once it is staged (a model that changed its state)."""
        self._previous, self._buffers = self._buffers, {}

    def get(self, key: str, like: torch.Tensor) -> torch.Tensor:
        """A host tensor shaped like `like` (pinned when `like` is on a GPU), the one the save before had if it fits."""
        pinned = like.device.type == "cuda"
        buf = self._previous.pop(key, None)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype or (pinned and not buf.is_pinned()):
            buf = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=pinned)
        self._buffers[key] = buf
        return buf

    def done(self) -> None:
        self._previous = {}


def stage_tree(name: str, tree: Any, copy: bool = True, buffers: HostBuffers | None = None) -> StagedTree:
    """`tree` split by `flatten_state` (`TypeError` naming tree `name` if it holds what cannot be stored), every
    tensor copied to the host (into `buffers` where given; `copy=False`: the tensors as they are, for a write that
    follows at once)."""
    try:
        tensors, meta = flatten_state(tree)
    except TypeError as e:
        raise TypeError(f"{name} state: {e}") from e
    if not copy:
        return StagedTree(tensors, meta)
    copies, ready = host_copies(tensors, buffers, prefix=f"{name}/")
    return StagedTree(copies, meta, ready)


def host_copies(tensors: Mapping[str, torch.Tensor], buffers: HostBuffers | None = None, prefix: str = ""
                ) -> tuple[dict[str, torch.Tensor], Callable[[], None]]:
    """Host copies of `tensors` (module docstring) and the function that waits for those still on their way;
    `buffers` (keys `prefix` + name) gives the memory they are copied into."""
    copies: dict[str, torch.Tensor] = {}
    devices: set[torch.device] = set()
    for name, t in tensors.items():
        t = t.detach()
        if t.device.type == "cuda":
            host = buffers.get(prefix + name, t) if buffers is not None else \
                torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            copies[name] = host.copy_(t, non_blocking=True)
            devices.add(t.device)
        elif t.device.type == "cpu":
            copies[name] = buffers.get(prefix + name, t).copy_(t) if buffers is not None else t.clone()
        else:  # another accelerator: a blocking copy, which is a copy all the same
            copies[name] = t.to("cpu")
    events = []
    for device in devices:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append(event)

    def ready() -> None:
        for event in events:
            event.synchronize()

    return copies, ready
