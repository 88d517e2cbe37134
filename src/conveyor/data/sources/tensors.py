"""`Dataset.from_tensor_slices(x)`: one element per row of `x`.

tf.data semantics: `x` is an array, or a (nested) tuple / dict of arrays that all have the same
first dimension; element `i` has the structure of `x` with every component replaced by its `i`-th
slice (a tuple stays a tuple, a dict stays a dict). Components of different lengths raise
`InvalidArgumentError`.

    Dataset.from_tensor_slices(np.arange(6).reshape(3, 2))      # [0 1], [2 3], [4 5]
    Dataset.from_tensor_slices(([1, 2], ["a", "b"]))            # (1, 'a'), (2, 'b')
    Dataset.from_tensor_slices({"x": np.zeros((2, 4)), "y": [0, 1]})

As in tf.data a Python list is *data*, not structure: a list of numbers (or of equally long rows)
becomes one numpy array, so its elements are numpy scalars or arrays; a list of `str` or of
`bytes` yields `str` / `bytes` elements. Unlike tf.data, `x` is not copied: a memory-mapped array
stays on disk and is read row by row, and changing `x` after building the dataset changes what it
yields. Rows of 2-D and larger arrays are copied as they are handed out, so code downstream may
modify an element in place without touching `x`.

State: the index of the next element. The pipeline fingerprint records the length and the
components' dtypes and row shapes, never the data.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from conveyor.data.base import Context, Iter, Node, StateField
from conveyor.data.elements import unflatten
from conveyor.data.errors import InvalidArgumentError


class TensorSlicesNode(Node):
    name = "from_tensor_slices"

    def __init__(self, x: Any):
        super().__init__()
        self.leaves: list = []
        lengths: dict[str, int] = {}
        self.spec, self.structure = _prepare(x, "x", self.leaves, lengths)
        if not lengths:
            raise InvalidArgumentError(
                "from_tensor_slices needs at least one component, got an empty structure"
            )
        if len(set(lengths.values())) > 1:
            listed = ", ".join(f"{where} has {n}" for where, n in lengths.items())
            raise InvalidArgumentError(
                f"from_tensor_slices needs components with the same first dimension: {listed}"
            )
        self.length = next(iter(lengths.values()))

    def params(self) -> dict[str, Any]:
        return {"length": self.length, "structure": self.structure}

    def known_elements(self) -> frozenset | None:
        """The rows, when they are str or bytes (a file list); other data is not listed."""
        if self.spec is not None:
            return None
        leaf = self.leaves[0]
        if isinstance(leaf, np.ndarray):
            return frozenset(leaf.tolist()) if leaf.ndim == 1 and leaf.dtype.kind in "US" else None
        return frozenset(leaf)  # a list of str or of bytes (other lists became arrays)

    def iterator(self, ctx: Context) -> Iter:
        return TensorSlicesIter(self, ctx)


def _prepare(x: Any, where: str, leaves: list, lengths: dict[str, int]) -> tuple[Any, str]:
    """Collect the components of `x` into `leaves`; return (structure spec, description)."""
    if isinstance(x, tuple):
        parts = [_prepare(v, f"{where}[{i}]", leaves, lengths) for i, v in enumerate(x)]
        return ("t", [p[0] for p in parts]), "(" + "".join(p[1] + ", " for p in parts) + ")"
    if isinstance(x, dict):
        parts = [_prepare(v, f"{where}[{k!r}]", leaves, lengths) for k, v in x.items()]
        desc = ", ".join(f"{k!r}: {p[1]}" for k, p in zip(x, parts, strict=True))
        return ("d", list(x), [p[0] for p in parts]), "{" + desc + "}"
    if isinstance(x, list) and x and all(type(v) is str for v in x):
        leaf, desc = list(x), "str"
    elif isinstance(x, list) and x and all(type(v) is bytes for v in x):
        leaf, desc = list(x), "bytes"
    else:
        if x is None or isinstance(x, (str, bytes)):
            raise InvalidArgumentError(f"from_tensor_slices cannot slice {where} = {x!r}: it is not an array")
        try:
            leaf = np.asarray(x)
        except ValueError:  # numpy refuses ragged nested lists
            raise InvalidArgumentError(_not_a_tensor(where)) from None
        if leaf.ndim == 0:
            raise InvalidArgumentError(
                f"from_tensor_slices cannot slice {where}: it is a scalar ({x!r}); wrap it in a list for a "
                f"one-element dataset"
            )
        if isinstance(x, list) and (leaf.dtype.kind == "O" or (leaf.dtype.kind in "US" and leaf.ndim == 1)):
            # an object array (None, odd objects, ...) or str mixed with numbers (all-str was handled)
            raise InvalidArgumentError(_not_a_tensor(where))
        desc = f"{leaf.dtype.str}{list(leaf.shape[1:])}"
    leaves.append(leaf)
    lengths[where] = len(leaf)
    return None, desc


def _not_a_tensor(where: str) -> str:
    return (
        f"from_tensor_slices cannot turn the list {where} into an array: it must hold numbers or equally "
        f"long rows of numbers, or only str, or only bytes (mixed or ragged lists are not tensors)"
    )


class TensorSlicesIter(Iter):
    def __init__(self, node: TensorSlicesNode, ctx: Context):
        super().__init__(node.name, ctx)
        self._spec = node.spec
        # per component: (data, whether to copy its rows: views of 2-D+ arrays would let a consumer
        # write into `x`)
        self._columns = [(v, isinstance(v, np.ndarray) and v.ndim > 1) for v in node.leaves]
        self._length = node.length
        self._next_index = 0

    def _next(self) -> Any:
        i = self._next_index
        if i >= self._length:
            raise StopIteration
        self._next_index = i + 1
        row = [leaf[i].copy() if copy else leaf[i] for leaf, copy in self._columns]
        return row[0] if self._spec is None else unflatten(self._spec, row)

    def get_state(self) -> dict[str, Any]:
        return {"next": self._next_index}

    def set_state(self, state: StateField) -> None:
        self._next_index = state.fields(("next",))["next"].as_int(0, self._length)
