"""The two ops of a leftover pipeline: the rest of an interrupted epoch, handed to one worker of a new world.

`conveyor.data.redistribute` builds them; users never do.

- `LeftoverNode(record_node, sources, refs)` stands where the pipeline's record level was (a range,
  from_tensor_slices, TFRecordDataset or interleave): it yields the records named by `refs` (pairs of
  source index and locator, the provenance form of `conveyor.data.provenance`), re-read through
  `record_node.reread` a chunk at a time, in that order, each with its provenance, so that a shuffle
  above it saves small states. State: the index of the next record.
- `PrependNode(input, depth, elements)` yields `elements` (saved with `elements.to_json`; they carry
  no provenance) before its input's: what an op of the old world held at that depth of the pipeline
  (a shuffle buffer saved as elements, a map's chunks in flight, prefetched batches). State: how many
  were handed out, plus the input's state.

Neither fingerprint holds the data nor the world size: a leftover pipeline saved by a worker and
rebuilt from the same share matches it.
"""

from __future__ import annotations

from typing import Any

from conveyor.data.base import Context, Iter, Node, StateField, UnaryIter
from conveyor.data.elements import from_json

_CHUNK = 256  # records re-read per call: a TFRecord file is opened once per chunk, not per record


class LeftoverNode(Node):
    name = "leftover"

    def __init__(self, record_node: Node, sources: list, refs: list[int]):
        super().__init__()
        self.record_node = record_node
        self.sources = sources
        self.refs = refs
        self.length = len(refs) // 2

    def params(self) -> dict[str, Any]:
        return {"record_node": self.record_node.name}

    def reread(self, source: StateField, locators: list[StateField]) -> list:
        return self.record_node.reread(source, locators)

    def iterator(self, ctx: Context) -> Iter:
        return LeftoverIter(self, ctx)


class LeftoverIter(Iter):
    def __init__(self, node: LeftoverNode, ctx: Context):
        super().__init__(node.name, ctx)
        self._node = node
        self._next_index = 0
        self._chunk: list = []  # records [chunk_start, chunk_start + len) re-read ahead
        self._chunk_start = 0
        self._last: tuple[Any, int] | None = None

    def enable_provenance(self) -> bool:
        return True

    def provenance(self) -> tuple[Any, int] | None:
        return self._last

    def _next(self) -> Any:
        i = self._next_index
        if i >= self._node.length:
            raise StopIteration
        if not self._chunk_start <= i < self._chunk_start + len(self._chunk):
            self._read(i)
        refs, sources = self._node.refs, self._node.sources
        self._next_index = i + 1
        self._last = (sources[refs[2 * i]], refs[2 * i + 1])
        return self._chunk[i - self._chunk_start]

    def _read(self, start: int) -> None:
        """Re-read records [start, start + _CHUNK), one `reread` call per source, in share order."""
        node = self._node
        stop = min(start + _CHUNK, node.length)
        by_source: dict[int, list[int]] = {}
        for i in range(start, stop):
            by_source.setdefault(node.refs[2 * i], []).append(i)
        chunk: list = [None] * (stop - start)
        for s, items in by_source.items():
            where = f"leftover share: record source {s}"
            got = node.reread(StateField(node.sources[s], where),
                              [StateField(node.refs[2 * i + 1], where) for i in items])
            for i, x in zip(items, got, strict=True):
                chunk[i - start] = x
        self._chunk, self._chunk_start = chunk, start

    def get_state(self) -> dict[str, Any]:
        return {"next": self._next_index}

    def set_state(self, state: StateField) -> None:
        self._next_index = state.fields(("next",))["next"].as_int(0, self._node.length)


class PrependNode(Node):
    name = "prepend"
    keeps_elements = True  # a shuffle above re-reads only its input's records (held elements have no provenance)

    def __init__(self, input: Node, depth: int, elements: list):
        super().__init__(input)
        self.depth = depth
        self.elements = elements

    def params(self) -> dict[str, Any]:
        return {"depth": self.depth}

    def iterator(self, ctx: Context) -> Iter:
        return PrependIter(self, ctx)


class PrependIter(UnaryIter):
    passes_elements = True
    _STATE_KEYS = ("pos",)

    def __init__(self, node: PrependNode, ctx: Context):
        super().__init__(node.name, ctx, node.inputs[0].iterator(ctx.child(0)))
        self._elements = node.elements
        self._pos = 0
        self._held = False  # the last element returned was one of `elements`

    def _next(self) -> Any:
        if self._pos < len(self._elements):
            self._pos += 1
            self._held = True
            return from_json(self._elements[self._pos - 1])
        self._held = False
        if self._input is None:
            raise StopIteration
        try:
            return next(self._input)
        except StopIteration:
            self._finish()
            raise

    def provenance(self) -> tuple[Any, int] | None:
        return None if self._held else super().provenance()

    def _extra_state(self) -> dict[str, Any]:
        return {"pos": self._pos}

    def _load_extra_state(self, state: StateField) -> None:
        self._pos = state["pos"].as_int(0, len(self._elements))
