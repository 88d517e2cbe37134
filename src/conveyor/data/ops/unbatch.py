"""`unbatch()`: split every input element along its leading axis, one element per row.

tf.data semantics: the inverse of `batch` — `ds.batch(n).unbatch()` yields the elements of `ds`
(a batch of `str`/`bytes` becomes its items, numbers become numpy scalars). Every component of a
batch must have the same leading dimension; a batch with zero rows contributes nothing.

    Dataset.range(5).batch(2).unbatch()      # 0, 1, 2, 3, 4 (as numpy int64 scalars)

State: the input's state *after* the current batch plus the rows of that batch not yet returned,
encoded with `elements.to_json` (the input cannot be asked where it was before the batch, so the
rest of the batch travels in the state; at most one batch).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from conveyor.data.base import Context, Iter, Node, StateField, UnaryIter
from conveyor.data.elements import flatten, to_json, unflatten, unstack


class UnbatchNode(Node):
    name = "unbatch"

    def iterator(self, ctx: Context) -> Iter:
        return UnbatchIter(self, ctx)


class UnbatchIter(UnaryIter):
    _STATE_KEYS = ("rest",)

    def __init__(self, node: UnbatchNode, ctx: Context):
        super().__init__(node.name, ctx, node.inputs[0].iterator(ctx.child(0)))
        self._batch: Any = None  # the current batch, and its rows
        self._rows: list = []
        self._pos = 0  # next row of `_rows` to return

    def _next(self) -> Any:
        while self._pos >= len(self._rows):
            if self._input is None:
                raise StopIteration
            try:
                batch = next(self._input)
            except StopIteration:
                self._finish()
                raise
            self._set_batch(batch)
        x = self._rows[self._pos]
        self._pos += 1
        return x

    def _set_batch(self, batch: Any) -> None:
        try:
            if any(np.ndim(leaf) == 0 for leaf in flatten(batch)[1]):
                raise ValueError("unbatch needs every component to have a leading (batch) dimension")
            self._rows = unstack(batch)
        except ValueError as e:
            raise ValueError(f"unbatch: {e} (got {_shapes(batch)})") from None
        self._batch, self._pos = batch, 0

    def _extra_state(self) -> dict[str, Any]:
        rest = None
        if self._pos < len(self._rows):
            spec, leaves = flatten(self._batch)
            rest = to_json(unflatten(spec, [np.asarray(leaf)[self._pos:] for leaf in leaves]))
        return {"rest": rest}

    def _load_extra_state(self, state: StateField) -> None:
        rest = state["rest"]
        if not rest.is_none():
            try:
                self._set_batch(rest.as_element())
            except (ValueError, TypeError) as e:
                raise rest.error(str(e)) from None


def _shapes(batch: Any) -> str:
    _, leaves = flatten(batch)
    return "component shapes " + ", ".join(str(np.shape(leaf)) for leaf in leaves)
