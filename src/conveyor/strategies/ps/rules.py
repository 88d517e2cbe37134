"""The parameter servers' update rules: when a gradient is applied, what is held back, when a pull may be answered.

    rule = make_rule("ssp", num_workers=2, staleness=4)     # or SyncRule(2), AsyncRule(2), SspRule(2, 4)
    now = rule.push(rank, step, read, grads)                 # gradients to apply now (None: held back)
    now = rule.commit(rank, step, read, order=keys)          # gradients to apply now (None: nothing yet)
    rule.ready(step)                                         # may a pull for ``step`` be answered?

A :class:`~conveyor.strategies.ps.server.ParameterServer` owns the optimizer and the sockets and
delegates every decision of its update rule to one :class:`UpdateRule`, which owns the workers'
clocks (steps committed), the announced plan, the version, the staleness histogram and the gradients
it holds back. Rules never see sockets or tensors' values beyond averaging them, so they are tested
alone (tests/strategies/test_ps_rules.py).

- :class:`SyncRule`: gradients wait until every worker committed the step, then their mean (in rank
  order) is applied once; a pull for step s waits until step s-1 is applied. Staleness: per commit.
- :class:`AsyncRule`: a push is applied on arrival; a pull is always answered. Staleness: per push.
- :class:`SspRule`: as async, but a pull for step s waits while s is more than K steps ahead of the
  slowest worker still training; a worker is no longer training once it said ``done`` or once the
  workers' commits reach the total it announced it stops at (waiting for it would never end).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from conveyor.strategies.ps.optim import mean_of_gradients

__all__ = ["STEP_AHEAD", "AsyncRule", "Clocks", "SspRule", "SyncRule", "UpdateRule", "make_rule"]

#: How far past its next step (its clock) a worker's push or commit may be. An honest worker pushes and
#: commits exactly its next step; anything else would be kept and never applied (sync) or poison the clock.
STEP_AHEAD = 1

Grads = Mapping[str, torch.Tensor]


class Clocks:
    """Each worker's clock (steps committed), the totals the workers announced they stop at, who said ``done``."""

    def __init__(self, num_workers: int) -> None:
        self.clock = [0] * num_workers
        self.plans: dict[int, int] = {}  # rank -> the total it announced (it stops once the total reaches it)
        self.done: set[int] = set()

    def advance(self, rank: int, step: int) -> None:
        """Worker ``rank`` committed ``step``."""
        self.clock[rank] = max(self.clock[rank], step + 1)

    def out_of_window(self, rank: int, step: int) -> str | None:
        """Why worker ``rank`` may not push or commit ``step`` (None: it may): only its next step (its clock)
        or up to :data:`STEP_AHEAD` beyond is accepted; an earlier one was committed, a later one is not due."""
        clock = self.clock[rank]
        if clock <= step <= clock + STEP_AHEAD:
            return None
        return (f"is {step}, outside worker {rank}'s window {clock}..{clock + STEP_AHEAD} (its next step is "
                f"{clock}: it committed {clock} steps); a worker pushes and commits only the step it trains")

    def announce(self, rank: int, plan: int) -> None:
        """Worker ``rank`` stops once the workers' total reaches ``plan`` (the largest it announced)."""
        self.plans[rank] = max(self.plans.get(rank, 0), plan)

    @property
    def plan(self) -> int | None:
        """The largest total announced: what a worker that could not work out its own stops at."""
        return max(self.plans.values()) if self.plans else None

    @property
    def total(self) -> int:
        """Steps committed by all workers together."""
        return sum(self.clock)

    def training(self, rank: int) -> bool:
        """Whether worker ``rank`` may still commit: it did not say ``done``, and the total has not reached
        the plan it announced (or, if it announced none, the largest one: the one it adopts)."""
        if rank in self.done:
            return False
        plan = self.plans.get(rank, self.plan)
        return plan is None or self.total < plan

    def slowest_training(self) -> int | None:
        """The smallest clock of the workers that may still commit (None: none may)."""
        live = [c for rank, c in enumerate(self.clock) if self.training(rank)]
        return min(live) if live else None


class UpdateRule(Protocol):
    """What a ps task delegates to: the update rule of ``ps-sync``, ``ps-async`` or ``ps-ssp:K``."""

    name: str
    clocks: Clocks
    staleness: Counter[int]  # (step - read) -> count, per push (async, ssp) or per commit (sync)

    @property
    def version(self) -> int:
        """What a pull reads: sync, steps applied; async and ssp, the slowest worker's clock."""

    def push(self, rank: int, step: int, read: int, grads: Grads) -> Grads | None:
        """A worker's gradients for ``step`` computed on version ``read``: those to apply now (None: held back)."""

    def commit(self, rank: int, step: int, read: int, order: Sequence[str]) -> Grads | None:
        """A worker finished ``step`` (its clock moved): the gradients of one update to apply now, keyed in
        ``order`` (None: no update now)."""

    def ready(self, step: int) -> bool:
        """Whether a pull for ``step`` may be answered now (else it waits for a commit)."""


class _Rule:
    """Clocks and the staleness histogram, which every rule keeps."""

    name = ""

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self.clocks = Clocks(num_workers)
        self.staleness: Counter[int] = Counter()

    @property
    def version(self) -> int:
        return min(self.clocks.clock)

    def _record(self, step: int, read: int) -> None:
        self.staleness[max(0, step - read)] += 1

    def push(self, rank: int, step: int, read: int, grads: Grads) -> Grads | None:
        self._record(step, read)
        return grads

    def commit(self, rank: int, step: int, read: int, order: Sequence[str]) -> Grads | None:
        self.clocks.advance(rank, step)
        return None

    def ready(self, step: int) -> bool:
        return True


class AsyncRule(_Rule):
    """``ps-async``: every push is applied on arrival; every pull is answered at once."""

    name = "async"


class SspRule(_Rule):
    """``ps-ssp:K``: as async, but a pull waits while it is more than ``bound`` steps ahead of the slowest
    worker still training (a worker that said ``done`` or reached its announced total bounds nobody)."""

    name = "ssp"

    def __init__(self, num_workers: int, bound: int) -> None:
        super().__init__(num_workers)
        if bound < 0:
            raise ValueError(f"the staleness bound of ps-ssp:K must be >= 0; got {bound}")
        self.bound = bound

    def ready(self, step: int) -> bool:
        slowest = self.clocks.slowest_training()
        return slowest is None or step - slowest <= self.bound


class SyncRule(_Rule):
    """``ps-sync``: a step's gradients are held until every worker committed it, then their mean is applied."""

    name = "sync"

    def __init__(self, num_workers: int) -> None:
        super().__init__(num_workers)
        self.applied = 0  # steps applied
        self._grads: dict[int, dict[str, dict[int, torch.Tensor]]] = {}  # step -> key -> rank -> grad
        self._commits: dict[int, set[int]] = {}

    @property
    def version(self) -> int:
        return self.applied

    def push(self, rank: int, step: int, read: int, grads: Grads) -> Grads | None:
        if step < self.applied:
            raise ValueError(f"push for step {step}, which was already applied (version {self.applied})")
        slot = self._grads.setdefault(step, {})
        for key, grad in grads.items():
            slot.setdefault(key, {})[rank] = grad  # a second push of a piece (accumulation) replaces it
        return None

    def commit(self, rank: int, step: int, read: int, order: Sequence[str]) -> Grads | None:
        self.clocks.advance(rank, step)
        self._record(step, read)
        commits = self._commits.setdefault(step, set())
        commits.add(rank)
        if len(commits) < self.num_workers or step != self.applied:
            return None
        slot = self._grads.pop(step, {})
        self._commits.pop(step, None)
        self.applied = step + 1
        averaged = {}
        for key in order:  # a fixed order, whatever the arrival order
            by_rank = slot.get(key)
            if by_rank:
                like = next(iter(by_rank.values()))
                averaged[key] = mean_of_gradients([by_rank.get(r, torch.zeros_like(like))
                                                   for r in range(self.num_workers)])
        return averaged

    def ready(self, step: int) -> bool:
        return self.applied >= step


def make_rule(mode: str, num_workers: int, staleness: int = 0) -> UpdateRule:
    """The rule of ``mode`` (``"sync"``, ``"async"``, ``"ssp"`` with bound ``staleness``)."""
    if mode == "sync":
        return SyncRule(num_workers)
    if mode == "async":
        return AsyncRule(num_workers)
    if mode == "ssp":
        return SspRule(num_workers, staleness)
    raise ValueError(f"mode = {mode!r}; expected 'sync', 'async' or 'ssp'")
