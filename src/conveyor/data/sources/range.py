"""`Dataset.range(*args)`: the integers of Python's `range(stop)`, `range(start, stop)` or
`range(start, stop, step)`.

    Dataset.range(5)          # 0, 1, 2, 3, 4
    Dataset.range(2, 5)       # 2, 3, 4
    Dataset.range(1, 5, 2)    # 1, 3
    Dataset.range(5, 1, -2)   # 5, 3

tf.data yields int64 scalars; here elements are Python ints (`batch` turns them into int64
arrays). A step of 0 raises `InvalidArgumentError`, as tf.data does. State: the index of the next
element, so resuming is O(1).
"""

from __future__ import annotations

import operator
from typing import Any

from conveyor.data.base import Context, Iter, Node, StateField
from conveyor.data.errors import InvalidArgumentError


class RangeNode(Node):
    name = "range"

    def __init__(self, *args: int):
        if not 1 <= len(args) <= 3:
            raise TypeError(f"range expects 1 to 3 integer arguments (start, stop, step), got {len(args)}")
        values = []
        for a in args:
            if isinstance(a, bool):
                raise TypeError(f"range arguments must be integers, got {a!r}")
            try:
                values.append(operator.index(a))
            except TypeError:
                raise TypeError(f"range arguments must be integers, got {type(a).__name__} {a!r}") from None
        if len(values) == 3 and values[2] == 0:
            raise InvalidArgumentError("range step must not be 0")
        super().__init__()
        self.range = range(*values)
        r = self.range  # len(range) overflows past sys.maxsize; Dataset.range(2**63) is a fine counter
        self.length = max(0, (r.stop - r.start + r.step - 1) // r.step if r.step > 0
                          else (r.start - r.stop - r.step - 1) // -r.step)

    def params(self) -> dict[str, Any]:
        r = self.range
        return {"start": r.start, "stop": r.stop, "step": r.step}

    def iterator(self, ctx: Context) -> Iter:
        return RangeIter(self, ctx)


class RangeIter(Iter):
    def __init__(self, node: RangeNode, ctx: Context):
        super().__init__(node.name, ctx)
        self._range = node.range
        self._length = node.length
        self._next_index = 0

    def _next(self) -> int:
        i = self._next_index
        if i >= self._length:
            raise StopIteration
        self._next_index = i + 1
        return self._range[i]

    def get_state(self) -> dict[str, Any]:
        return {"next": self._next_index}

    def set_state(self, state: StateField) -> None:
        self._next_index = state.fields(("next",))["next"].as_int(0, self._length)
