"""What a ps task applied from each worker, so that a worker restarted alone redoes exactly what was not applied.

    log = AppliedLog()
    grads = log.applying(rank, step, grads, counters)   # a push's pieces to apply now (a redone push: the rest)
    log.committed(rank, step, position)          # the commit of (rank, step): its data position, if it sent one
    position = log.rejoin(rank, clock, mode, counters)  # a replacement of worker `rank` asks where it stands
    log.redone(rank, step, clock, counters)      # a redone step this server committed already: acknowledged, dropped

A worker's data position (the iterator state after the batch of step ``s``) travels with its commit of ``s``
(only when it changed) and is kept per worker, with the keys of the uncommitted step applied on arrival
(``ps-async``/``ps-ssp`` apply every push at once). A replacement resumes from the position of the server
with the smallest clock for its rank (servers differ by at most one commit: a worker commits a step to all
servers before it pushes the next) and redoes that step: a server that has its commit drops it, a server
that applied some of its pieces drops those. So every piece gets each batch's update exactly once.
Promises: positions are bounded by the protocol (``MAX_POSITION_BYTES``); the log is saved into the ps
task's checkpoint shard and restored with it (JSON; positions as base64). docs/ps.md, "A worker restarted alone".
"""

from __future__ import annotations

import base64
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

from conveyor.strategies.ps import protocol as wire

__all__ = ["AppliedLog"]

T = TypeVar("T")


class AppliedLog:
    """Per worker: the newest applied data position, the pieces applied for its uncommitted step, its rejoins."""

    def __init__(self) -> None:
        self.positions: dict[int, bytes] = {}  # rank -> data position after its newest applied commit
        self._step_keys: dict[int, tuple[int, set[str]]] = {}  # rank -> (uncommitted step, pieces applied for it)
        self._floor: dict[int, int] = {}  # rank -> the oldest step a replacement may redo here (set at its rejoin)

    def pushed(self, rank: int, step: int, keys: Iterable[str]) -> None:
        """Pieces ``keys`` of worker ``rank``'s step ``step`` were applied."""
        held = self._step_keys.get(rank)
        if held is None or held[0] != step:
            held = (step, set())
            self._step_keys[rank] = held
        held[1].update(keys)

    def committed(self, rank: int, step: int, position: bytes | None) -> None:
        """Worker ``rank`` committed ``step`` (with the data position after its batch, or None: unchanged)."""
        if position is not None:
            self.positions[rank] = position
        held = self._step_keys.get(rank)
        if held is not None and held[0] <= step:
            del self._step_keys[rank]

    def rejoin(self, rank: int, clock: int, mode: str = "async", counters: Counter[str] | None = None) -> bytes | None:
        """A replacement of worker ``rank`` starts (this server has ``clock`` of its steps): it may redo the step
        before (another server may lack that commit); the newest applied position (None: none was sent).
        Refused under ``ps-sync``, whose every step waits for every worker."""
        if mode == "sync":
            raise wire.Refused("'rejoin'", "rank", "arrived at a ps-sync server: a worker restarted alone cannot "
                                                   "rejoin a step the others wait for; the launcher restarts the "
                                                   "whole job from its latest checkpoint instead", reason="sync")
        if counters is not None:
            counters["rejoins"] += 1
        self._floor[rank] = max(0, clock - 1)
        return self.positions.get(rank)

    def redone(self, rank: int, step: int, clock: int, counters: Counter[str]) -> bool:
        """:meth:`duplicate`, counted as ``steps_redone_dropped``."""
        if not self.duplicate(rank, step, clock):
            return False
        counters["steps_redone_dropped"] += 1
        return True

    def applying(self, rank: int, step: int, grads: Mapping[str, T] | None,
                 counters: Counter[str]) -> dict[str, T] | None:
        """What the update rule let through of a push (None: held back, ``ps-sync``), less the pieces a rejoined
        worker's step had applied already (counted as ``pieces_redone_dropped``); recorded as applied."""
        if grads is None:
            return None
        now = self.fresh(rank, step, grads)
        counters["pieces_redone_dropped"] += len(grads) - len(now)
        self.pushed(rank, step, now)
        return now or None

    def duplicate(self, rank: int, step: int, clock: int) -> bool:
        """Whether ``step`` of a rejoined worker is one this server committed already (drop it, acknowledged)."""
        floor = self._floor.get(rank)
        return floor is not None and floor <= step < clock

    def fresh(self, rank: int, step: int, grads: Mapping[str, T]) -> dict[str, T]:
        """The pieces of a rejoined worker's push not applied for ``step`` yet (all of them for any other worker)."""
        held = self._step_keys.get(rank)
        if rank not in self._floor or held is None or held[0] != step:
            return dict(grads)
        return {k: g for k, g in grads.items() if k not in held[1]}

    def to_json(self) -> dict[str, Any]:
        """The positions, for the ps task's checkpoint shard (a full restart starts from them)."""
        return {"positions": {str(r): base64.b64encode(p).decode("ascii") for r, p in sorted(self.positions.items())}}

    def load_json(self, doc: Any, num_workers: int) -> None:
        """Positions saved by :meth:`to_json` (a shard written before this log existed has none)."""
        if not isinstance(doc, dict) or not isinstance(doc.get("positions"), dict):
            return
        positions = {}
        for rank, text in doc["positions"].items():
            if rank.isdigit() and int(rank) < num_workers and isinstance(text, str):
                positions[int(rank)] = base64.b64decode(text.encode("ascii"), validate=True)
        self.positions = positions
        self._step_keys.clear()
        self._floor.clear()
