"""`batch(batch_size, drop_remainder=False)`: stack consecutive elements component-wise.

tf.data semantics (docs/tfdata-semantics.md §8): every batch holds `batch_size` consecutive elements except
possibly the last, which holds the `N % batch_size` left over, or is dropped with
`drop_remainder=True` (then every batch has the same, static size).

    Dataset.range(8).batch(3)                        # [0 1 2], [3 4 5], [6 7]
    Dataset.range(8).batch(3, drop_remainder=True)   # [0 1 2], [3 4 5]

Stacking follows `elements.stack`: the structure of the elements is kept (a tuple of arrays
becomes a tuple of batched arrays, a dict a dict), numbers and arrays gain a leading axis, and
`str` / `bytes` become 1-D numpy object arrays (a string tensor). Elements of different structure
or shape raise `ValueError` (resize them in `map` first). A parallel `map` right before `batch` is
fused with it by `pipeline._optimize`, which reads `batch_size` and `drop_remainder`.

State: the input's state; a batch is assembled within one `next`, so nothing is in flight.
"""

from __future__ import annotations

import numbers
from typing import Any

from conveyor.data.base import Context, Iter, Node, UnaryIter
from conveyor.data.elements import stack
from conveyor.data.errors import InvalidArgumentError


class BatchNode(Node):
    name = "batch"

    def __init__(self, input: Node, batch_size: int, drop_remainder: bool = False):
        super().__init__(input)
        if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
            raise InvalidArgumentError(f"batch_size must be a positive integer, got {batch_size!r}")
        self.batch_size = int(batch_size)
        self.drop_remainder = bool(drop_remainder)

    def params(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "drop_remainder": self.drop_remainder}

    def iterator(self, ctx: Context) -> Iter:
        return BatchIter(self, ctx)


class BatchIter(UnaryIter):
    def __init__(self, node: BatchNode, ctx: Context):
        super().__init__(node.name, ctx, node.inputs[0].iterator(ctx.child(0)))
        self._batch_size = node.batch_size
        self._drop_remainder = node.drop_remainder

    def _next(self) -> Any:
        it = self._input
        if it is None:
            raise StopIteration
        rows = []
        try:
            for _ in range(self._batch_size):
                rows.append(next(it))
        except StopIteration:
            self._finish()
            if not rows or self._drop_remainder:
                raise
        return stack(rows)
