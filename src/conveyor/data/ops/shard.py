"""`shard(num_shards, index)`: the elements whose position modulo `num_shards` equals `index`.

tf.data semantics (docs/tfdata-semantics.md §3): deterministic; uneven shards are allowed.

    Dataset.range(10).shard(3, 0)   # 0, 3, 6, 9
    Dataset.range(10).shard(3, 1)   # 1, 4, 7
    Dataset.range(10).shard(3, 2)   # 2, 5, 8

`num_shards < 1` or an `index` outside `[0, num_shards)` raises `InvalidArgumentError`. Shard
before any random op, and early (on file names) so a worker does not read what it then drops;
after `list_files` that needs `shuffle=False` or the same seed on every worker. The other shards'
elements are still read from the input (there is no way to skip them without reading them), so
sharding the file list is much cheaper than sharding records.

State: whether the first element has been returned, plus the input's state.
"""

from __future__ import annotations

import numbers
from typing import Any

from conveyor.data.base import Context, Iter, Node, StateField, UnaryIter
from conveyor.data.errors import InvalidArgumentError


class ShardNode(Node):
    name = "shard"
    keeps_elements = True

    def __init__(self, input: Node, num_shards: int, index: int):
        super().__init__(input)
        if isinstance(num_shards, bool) or not isinstance(num_shards, numbers.Integral) or num_shards < 1:
            raise InvalidArgumentError(
                f"shard: num_shards must be a positive integer (the number of workers), got {num_shards!r}"
            )
        if isinstance(index, bool) or not isinstance(index, numbers.Integral) or not 0 <= index < num_shards:
            raise InvalidArgumentError(
                f"shard: index must be an integer in [0, {num_shards - 1}] (this worker's rank), "
                f"got {index!r}"
            )
        self.num_shards = int(num_shards)
        self.index = int(index)

    def params(self) -> dict[str, Any]:
        return {"num_shards": self.num_shards, "index": self.index}

    def iterator(self, ctx: Context) -> Iter:
        return ShardIter(self, ctx)


class ShardIter(UnaryIter):
    _STATE_KEYS = ("started",)

    def __init__(self, node: ShardNode, ctx: Context):
        super().__init__(node.name, ctx, node.inputs[0].iterator(ctx.child(0)))
        self._num_shards = node.num_shards
        self._index = node.index
        self._started = False  # False: the next element is input #index; True: num_shards further on

    def _next(self) -> Any:
        it = self._input
        if it is None:
            raise StopIteration
        drop = self._num_shards - 1 if self._started else self._index
        try:
            for _ in range(drop):
                next(it)
            x = next(it)
        except StopIteration:
            self._finish()
            raise
        self._started = True
        return x

    def _extra_state(self) -> dict[str, Any]:
        return {"started": self._started}

    def _load_extra_state(self, state: StateField) -> None:
        self._started = state["started"].as_bool()
