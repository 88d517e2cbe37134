"""A worker's state for one step of the parameter-server protocol: made when the step begins, dropped at its commit.

    step = StepState(number=3, read=[2, 3], buckets=GradientBuckets(2))   # when step 2 was committed
    step.add("fc.weight", placement.split("fc.weight", grad))             # backward's hooks
    for server, push in step.take_pushes(rank):  send(server, push)       # a full bucket, and at the end
    step.read[server] = reply.version                                     # the pull that feeds it landed

:class:`~conveyor.strategies.ps.client.PSClient` keeps what lasts the whole run (the connections, the
placement, the hooks, timings, the shared step count); what one step does lives here, so its rules are
explicit: every push of step n says it was computed on the versions the last pull read (``read``,
carried over from step n-1 until step n's pull lands); a parameter pushed by a hook is not pushed again
at the commit; a gradient copy stays alive until its push is answered (it travels without a copy).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from conveyor.strategies.ps import protocol as wire
from conveyor.strategies.ps.buckets import GradientBuckets

__all__ = ["PullInFlight", "StepState"]


@dataclass
class StepState:
    """Step ``number``'s pushes: what waits in the bucket, what is in flight, which parameters were pushed."""

    number: int
    read: list[int]  # per server: the version the values this step computes on were read at
    buckets: GradientBuckets
    pushed: set[str] = field(default_factory=set)  # parameters pushed (or waiting in the bucket)
    in_flight: list[tuple[int, int]] = field(default_factory=list)  # (server, request id) of pushes sent
    keep: list[torch.Tensor] = field(default_factory=list)  # their gradient copies: unchanged until answered

    def add(self, name: str, pieces: Iterable[tuple[Any, torch.Tensor]]) -> None:
        """Parameter ``name``'s gradient as placement pieces; copied (the grad may change in place before
        the push is answered, e.g. by accumulation)."""
        for piece, values in pieces:
            self.buckets.add(piece.server, piece.key, values.clone())
        self.pushed.add(name)

    def take_pushes(self, rank: int) -> list[tuple[int, wire.Push]]:
        """One push per server of what waits in the bucket (which empties); their tensors are kept."""
        pushes = []
        for server, keys, tensors in self.buckets.take():
            pushes.append((server, wire.Push(rank, self.number, self.read[server], keys, tensors)))
            self.keep.extend(tensors)
        return pushes

    def next(self) -> StepState:
        """The step after this one, reading where this one read until its own pull lands."""
        return StepState(self.number + 1, list(self.read), GradientBuckets(len(self.read),
                                                                             self.buckets.bucket_bytes))


@dataclass
class PullInFlight:
    """The pull sent for step ``step`` (behind the previous step's commit), collected before its forward."""

    step: int
    ids: list[tuple[int, int]]  # (server, request id)
