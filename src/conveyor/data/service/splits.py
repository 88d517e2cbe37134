"""Splits for distributed_epoch: the pipeline's one file list, and the source that replaces it on a worker.

    split_files(node)              # the files the dispatcher hands out, or None without exactly one list
    SplitNode(next_split)          # file names from next_split() until it returns None

A file list is a `from_tensor_slices` of str or bytes in the recipe (what `list_files` and
`TFRecordDataset([...])` build); file lists an `interleave` creates while running are not in the recipe.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from conveyor.data.base import Context, Iter, Node, StateField
from conveyor.data.service.protocol import DataServiceError
from conveyor.data.sources.tensors import TensorSlicesNode


def file_lists(node: Node) -> list[TensorSlicesNode]:
    found = [node] if isinstance(node, TensorSlicesNode) and node.known_elements() is not None else []
    for child in node.inputs:
        found += file_lists(child)
    return found


def split_files(node: Node) -> list[str] | None:
    """The file list distributed_epoch splits, or None when the pipeline has not exactly one."""
    lists = file_lists(node)
    if len(lists) != 1:
        return None
    leaf = lists[0].leaves[0]
    return [x.decode() if isinstance(x, bytes) else str(x) for x in list(leaf)]


class SplitNode(Node):
    """File names from the dispatcher, one per request (the split provider of tf.data's dynamic sharding)."""

    name = "service_splits"

    def __init__(self, next_split: Callable[[], str | None]):
        super().__init__()
        self.next_split = next_split

    def iterator(self, ctx: Context) -> Iter:
        return _SplitIter(self, ctx)


class _SplitIter(Iter):
    def __init__(self, node: SplitNode, ctx: Context):
        super().__init__(node.name, ctx)
        self._next_split = node.next_split
        self._done = False

    def _next(self) -> str:
        split = None if self._done else self._next_split()
        if split is None:
            self._done = True
            raise StopIteration
        return split

    def get_state(self) -> dict[str, Any]:
        raise DataServiceError("a data worker's split source cannot be saved: the dispatcher holds the position")

    def set_state(self, state: StateField) -> None:
        raise state.error("a data worker's split source cannot be restored")
