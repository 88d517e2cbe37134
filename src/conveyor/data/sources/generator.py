"""`Dataset.from_generator(fn, args)`: the elements of `fn(*args)`.

tf.data semantics: every iterator calls `fn(*args)` anew (so each `iter()` and each epoch of an
enclosing `repeat` restarts the generator) and yields what it yields, in order. tf.data requires
an `output_signature`; here elements pass through as they are.

Such a pipeline cannot save its position: a Python generator cannot be rewound or inspected, so
`get_state` raises a `TypeError` that names the alternatives (TFRecord files or
`from_tensor_slices`). The generator is started on the first `next`, not when the iterator is
built, and closed with the iterator.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from conveyor.data.base import Context, Iter, Node, StateField, describe_fn

NOT_RESUMABLE = (
    "from_generator(...) cannot save its position: a Python generator cannot be rewound. Write the data "
    "to TFRecord files (conveyor data convert) or use from_tensor_slices to make the pipeline resumable."
)


class GeneratorNode(Node):
    name = "from_generator"

    def __init__(self, fn: Callable[..., Iterable], args: tuple = ()):
        super().__init__()
        if not callable(fn):
            raise TypeError(
                f"from_generator expects a function returning an iterable (e.g. a generator function), "
                f"got {type(fn).__name__}; pass the function itself, not its result"
            )
        self.fn = fn
        self.args = tuple(args)

    def params(self) -> dict[str, Any]:
        return {"fn": describe_fn(self.fn), "num_args": len(self.args)}

    def iterator(self, ctx: Context) -> Iter:
        return GeneratorIter(self, ctx)


class GeneratorIter(Iter):
    def __init__(self, node: GeneratorNode, ctx: Context):
        super().__init__(node.name, ctx)
        self._node = node
        self._gen: Iterator | None = None
        self._done = False

    def _next(self) -> Any:
        if self._done:
            raise StopIteration
        if self._gen is None:
            out = self._node.fn(*self._node.args)
            try:
                self._gen = iter(out)
            except TypeError:
                raise TypeError(
                    f"from_generator: {describe_fn(self._node.fn)}(*args) returned {type(out).__name__}, "
                    f"which is not iterable; it must return a generator or another iterable"
                ) from None
        try:
            return next(self._gen)
        except StopIteration:
            self._done = True
            raise

    def get_state(self) -> dict[str, Any]:
        raise TypeError(NOT_RESUMABLE)

    def set_state(self, state: StateField) -> None:
        raise TypeError(NOT_RESUMABLE)

    def close(self) -> None:
        gen, self._gen = self._gen, None
        self._done = True
        close = getattr(gen, "close", None)
        if close is not None:
            close()
        super().close()
