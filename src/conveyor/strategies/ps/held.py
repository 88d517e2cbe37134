"""Pulls a parameter server keeps until its update rule lets it answer them, indexed so a tick costs what it answers.

    held = HeldPulls(per_peer=4, total=64)
    if not held.add(peer, step, deferred, since=now, deadline=now + hold_s):  # over a bound: answer 'wait'
        ...
    for step, deferred, since in held.take_ready(rule.ready): answer with the parameters
    for step, deferred, since in held.take_expired(now): answer 'wait'

Every update rule's ``ready(step)`` is monotone in the step (ready for s means ready for every step
before s: sync asks ``version >= s``, ssp ``s - slowest <= K``, async nothing), so the pulls are kept
by the step they wait for, with a heap of those steps: a tick asks the rule about the smallest one and
stops at the first that is not ready, and a second heap of deadlines finds the pulls whose hold ran
out. A tick with N held pulls of which none is ready or expired costs O(1), not O(N). A peer (one
connection) holds at most ``per_peer`` pulls and the server at most ``total``; beyond either, the
pull is answered 'wait' at once (the worker asks again), which honest workers, holding one pull per
server at a time, never see.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Callable
from typing import Any

__all__ = ["HeldPulls"]

Entry = tuple[int, Any, float]  # (step waited for, the request's Deferred, since when it is held)


class HeldPulls:
    """Held pulls by step (a heap of steps over a dict of buckets) and by deadline (a heap), bounded."""

    def __init__(self, *, per_peer: int, total: int) -> None:
        self.per_peer, self.total = per_peer, total
        self._by_step: dict[int, dict[int, tuple[Any, Entry]]] = {}  # step -> id -> (peer, entry)
        self._steps: list[int] = []  # heap of the steps in _by_step (and stale ones, skipped when popped)
        self._deadlines: list[tuple[float, int, int]] = []  # heap of (deadline, id, step); stale ones skipped
        self._ids = itertools.count()
        self._per_peer: Counter[Any] = Counter()
        self._live = 0
        self.touched = 0  # entries and steps looked at by take_ready/take_expired (tests count the work)

    def __len__(self) -> int:
        return self._live

    def add(self, peer: Any, step: int, deferred: Any, *, since: float, deadline: float) -> bool:
        """Hold a pull from ``peer`` for ``step`` until ``deadline``; False (nothing held) over a bound."""
        if self._live >= self.total or self._per_peer[peer] >= self.per_peer:
            return False
        key = next(self._ids)
        bucket = self._by_step.get(step)
        if bucket is None:
            bucket = self._by_step[step] = {}
            heapq.heappush(self._steps, step)
            if len(self._steps) > 2 * len(self._by_step) + 64:  # steps emptied by expiry: compact
                self._steps = list(self._by_step)
                heapq.heapify(self._steps)
        bucket[key] = (peer, (step, deferred, since))
        heapq.heappush(self._deadlines, (deadline, key, step))
        self._per_peer[peer] += 1
        self._live += 1
        return True

    def take_ready(self, ready: Callable[[int], bool]) -> list[Entry]:
        """Remove and return the pulls whose step ``ready`` allows, smallest step first."""
        out: list[Entry] = []
        while self._steps:
            step = self._steps[0]
            self.touched += 1
            if step in self._by_step and not ready(step):
                break
            heapq.heappop(self._steps)
            for peer, entry in self._by_step.pop(step, {}).values():
                self._release(peer)
                out.append(entry)
        return out

    def take_expired(self, now: float) -> list[Entry]:
        """Remove and return the pulls whose deadline is ``now`` or earlier."""
        out: list[Entry] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, key, step = heapq.heappop(self._deadlines)
            self.touched += 1
            bucket = self._by_step.get(step)
            found = bucket.pop(key, None) if bucket is not None else None
            if found is None:
                continue  # answered already (its step became ready)
            if not bucket:
                del self._by_step[step]  # its step stays in the heap until popped or compacted
            self._release(found[0])
            out.append(found[1])
        return out

    def _release(self, peer: Any) -> None:
        self._live -= 1
        self._per_peer[peer] -= 1
        if self._per_peer[peer] <= 0:
            del self._per_peer[peer]
