"""`filter(predicate)`: the input elements for which `predicate` returns True.

tf.data semantics: order is kept; a tuple element is unpacked into the predicate's arguments
(`filter(lambda x, y: ...)`), any other element is passed as one argument. The predicate must
return a scalar boolean: a Python `bool`, a numpy bool scalar or a 0-d bool array; anything else
(an int, a 1-element array, None) raises `TypeError` instead of being guessed at, as tf.data
rejects a non-bool predicate.

    Dataset.range(10).filter(lambda x: x % 3 == 0)     # 0, 3, 6, 9

State: the input's state (the predicate runs synchronously, nothing is in flight).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from conveyor.data.base import Context, Iter, Node, UnaryIter, call, describe_fn


class FilterNode(Node):
    name = "filter"
    keeps_elements = True

    def __init__(self, input: Node, predicate: Callable[..., bool]):
        super().__init__(input)
        if not callable(predicate):
            raise TypeError(f"filter expects a function returning a bool, got {type(predicate).__name__}")
        self.predicate = predicate

    def params(self) -> dict[str, Any]:
        return {"predicate": describe_fn(self.predicate)}

    def iterator(self, ctx: Context) -> Iter:
        return FilterIter(self, ctx)


class FilterIter(UnaryIter):
    def __init__(self, node: FilterNode, ctx: Context):
        super().__init__(node.name, ctx, node.inputs[0].iterator(ctx.child(0)))
        self._predicate = node.predicate

    def _next(self) -> Any:
        it = self._input
        if it is None:
            raise StopIteration
        predicate = self._predicate
        while True:
            try:
                x = next(it)
            except StopIteration:
                self._finish()
                raise
            keep = call(predicate, x)
            if keep is True or keep is np.True_:
                return x
            if keep is False or keep is np.False_:
                continue
            if isinstance(keep, np.ndarray) and keep.shape == () and keep.dtype == np.bool_:
                if keep:
                    return x
                continue
            raise TypeError(
                f"filter predicate {describe_fn(predicate)} must return a scalar bool, got "
                f"{_describe(keep)}; compare explicitly (e.g. `x > 0`, `bool(...)`, `arr.all()`)"
            )


def _describe(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"a numpy array of dtype {value.dtype} and shape {value.shape}"
    return f"{type(value).__name__} {value!r}"[:120]
