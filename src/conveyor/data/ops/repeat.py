"""`repeat(count=None)`: the input, `count` times over; forever when `count` is None or -1.

tf.data semantics (docs/tfdata-semantics.md §5): "Repeats this dataset so each original value is seen `count`
times". Every repetition starts a fresh input iterator, built with `Context.with_epoch(epoch)`, so
a random op upstream with `reshuffle_each_iteration=True` draws a new order each epoch while a
rebuilt (resumed) iterator draws the same one again.

    Dataset.range(3).repeat(2)    # 0, 1, 2, 0, 1, 2
    Dataset.range(3).repeat(0)    # nothing
    Dataset.range(3).repeat()     # 0, 1, 2, 0, 1, 2, ... forever

As in tf.data every negative count means forever, and repeating forever stops when an epoch
yields no element at all (otherwise an empty input would spin forever); a finite count runs all
its epochs even when some are empty.

State: the epoch number, whether it has produced an element yet, and the input's state.
"""

from __future__ import annotations

import numbers
from typing import Any

from conveyor.data.base import Context, Iter, Node, StateField, UnaryIter
from conveyor.data.errors import InvalidArgumentError


class RepeatNode(Node):
    name = "repeat"
    keeps_elements = True

    def __init__(self, input: Node, count: int | None = None):
        super().__init__(input)
        if count is not None and (isinstance(count, bool) or not isinstance(count, numbers.Integral)):
            raise InvalidArgumentError(f"repeat count must be an integer or None (forever), got {count!r}")
        self.count = -1 if count is None or count < 0 else int(count)

    def params(self) -> dict[str, Any]:
        return {"count": self.count}

    def iterator(self, ctx: Context) -> Iter:
        return RepeatIter(self, ctx)


class RepeatIter(UnaryIter):
    _STATE_KEYS = ("epoch", "fresh")

    def __init__(self, node: RepeatNode, ctx: Context):
        super().__init__(node.name, ctx, None)
        self._node = node
        self._ctx = ctx
        self._epoch = 0
        self._fresh = True  # the current epoch has not produced an element yet
        if node.count != 0:
            self._open(0)

    def _open(self, epoch: int) -> None:
        if self._input is not None:
            self._input.close()
        self._epoch = epoch
        self._fresh = True
        self._input = self._node.inputs[0].iterator(self._ctx.child(0).with_epoch(epoch))
        self.inputs = [self._input]

    def _next(self) -> Any:
        count = self._node.count
        while self._input is not None:
            try:
                x = next(self._input)
            except StopIteration:
                if (self._fresh and count < 0) or (count >= 0 and self._epoch + 1 >= count):
                    self._finish()
                else:
                    self._open(self._epoch + 1)
                continue
            self._fresh = False
            return x
        raise StopIteration

    def _extra_state(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "fresh": self._input is None or self._fresh}

    def _load_extra_state(self, state: StateField) -> None:
        count = self._node.count
        epoch = state["epoch"].as_int(0, None if count < 0 else max(count, 1) - 1)
        fresh = state["fresh"].as_bool()
        if state["input"].is_none():
            self._epoch = epoch  # finished: the input is closed next
        else:
            if epoch != self._epoch or self._input is None:
                self._open(epoch)
            self._fresh = fresh

