"""`skip(count)`: the input without its first `count` elements.

tf.data semantics (docs/tfdata-semantics.md §10): a count larger than the input yields nothing; `-1` (tf.data:
any negative count) skips everything, and then the input is not even read (so `skip(-1)` of an
endless dataset is empty, not a hang).

    Dataset.range(10).skip(7)     # 7, 8, 9
    Dataset.range(10).skip(-1)    # nothing

The skipping happens on the first `next`, by reading and dropping `count` elements.

State: whether the skip has been done, plus the input's state (None once finished).
"""

from __future__ import annotations

import numbers
from typing import Any

from conveyor.data.base import Context, Iter, Node, StateField, UnaryIter
from conveyor.data.errors import InvalidArgumentError


class SkipNode(Node):
    name = "skip"
    keeps_elements = True

    def __init__(self, input: Node, count: int):
        super().__init__(input)
        if isinstance(count, bool) or not isinstance(count, numbers.Integral):
            raise InvalidArgumentError(f"skip count must be an integer (-1 for all), got {count!r}")
        self.count = -1 if count < 0 else int(count)

    def params(self) -> dict[str, Any]:
        return {"count": self.count}

    def iterator(self, ctx: Context) -> Iter:
        return SkipIter(self, ctx)


class SkipIter(UnaryIter):
    _STATE_KEYS = ("skipped",)

    def __init__(self, node: SkipNode, ctx: Context):
        super().__init__(node.name, ctx, None)
        self._count = node.count
        self._skipped = node.count == 0
        if node.count >= 0:  # built after this op, so its stats stage comes after skip's
            self._input = node.inputs[0].iterator(ctx.child(0))
            self.inputs = [self._input]

    def _next(self) -> Any:
        it = self._input
        if it is None:
            raise StopIteration
        try:
            if not self._skipped:
                for _ in range(self._count):
                    next(it)
                self._skipped = True
            return next(it)
        except StopIteration:
            self._finish()
            raise

    def _finish(self) -> None:
        self._skipped = True
        super()._finish()

    def _extra_state(self) -> dict[str, Any]:
        return {"skipped": self._skipped}

    def _load_extra_state(self, state: StateField) -> None:
        skipped = state["skipped"].as_bool()
        if state["input"].is_none():
            return  # finished: `_finish` marks it skipped
        if self._input is None:
            raise state["input"].error("expected null: this skip(-1) never reads its input")
        self._skipped = skipped
