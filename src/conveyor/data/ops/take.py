"""`take(count)`: at most the first `count` elements of the input.

tf.data semantics (docs/tfdata-semantics.md §10): `-1` (tf.data: any negative count) or a count larger than the
input yields everything; `0` yields nothing and never reads the input.

    Dataset.range(10).take(3)     # 0, 1, 2
    Dataset.range(10).take(-1)    # 0 .. 9

The input is closed as soon as the `count`-th element has been returned, so background work
upstream (prefetch, parallel map) stops even if the consumer never asks again.

State: how many elements have been taken, plus the input's state (None once finished).
"""

from __future__ import annotations

import numbers
from typing import Any

from conveyor.data.base import Context, Iter, Node, StateField, UnaryIter
from conveyor.data.errors import InvalidArgumentError


class TakeNode(Node):
    name = "take"
    keeps_elements = True

    def __init__(self, input: Node, count: int):
        super().__init__(input)
        if isinstance(count, bool) or not isinstance(count, numbers.Integral):
            raise InvalidArgumentError(f"take count must be an integer (-1 for all), got {count!r}")
        self.count = -1 if count < 0 else int(count)

    def params(self) -> dict[str, Any]:
        return {"count": self.count}

    def iterator(self, ctx: Context) -> Iter:
        return TakeIter(self, ctx)


class TakeIter(UnaryIter):
    _STATE_KEYS = ("taken",)

    def __init__(self, node: TakeNode, ctx: Context):
        super().__init__(node.name, ctx, None)
        self._count = node.count
        self._taken = 0
        if node.count != 0:  # built after this op, so its stats stage comes after take's
            self._input = node.inputs[0].iterator(ctx.child(0))
            self.inputs = [self._input]

    def _next(self) -> Any:
        if self._input is None:
            raise StopIteration
        try:
            x = next(self._input)
        except StopIteration:
            self._finish()
            raise
        self._taken += 1
        if self._taken == self._count:
            self._finish()
        return x

    def _extra_state(self) -> dict[str, Any]:
        return {"taken": self._taken}

    def _load_extra_state(self, state: StateField) -> None:
        taken = state["taken"].as_int(0, None if self._count < 0 else self._count)
        self._taken = taken
        if taken == self._count:
            self._finish()
