"""Where buffered elements came from: a small state for buffers over re-readable sources.

A shuffle buffer of 10,000 JPEG records would put gigabytes into every checkpoint if it saved the
records. Sources that can read an element again (a TFRecord file at a record offset, `range`,
`from_tensor_slices`) instead tell their consumer where each element came from, and the buffers
(`shuffle`, the read-ahead of a parallel `interleave`) save that *provenance*; loading the state
reads the elements again.

Protocol (opt-in, so pipelines without such a buffer pay nothing):
- `Iter.enable_provenance()` asks an iterator to remember where the element its last `next`
  returned came from; it answers whether it can. Called before the first `next` (and before
  `set_state`).
- `Iter.provenance()` is then `(source, locator)` or None: `source` is a JSON-able value shared by
  many elements (a TFRecord file: `[path, size, mtime_ns]`; an interleave wraps its inner source
  with the input element that opened it), `locator` an int (byte offset, index).
- `Node.reread(source, locators)` reads them again at restore time, checking `source` and every
  locator (StateFields) as strictly as any other state field.

Ops that return their input's elements unchanged (take, skip, shard, filter, repeat, shuffle)
pass provenances through; every other op (map, batch, cache, prefetch, a generator) has none, and
buffers over them keep saving the elements themselves.

State form of a buffer: `{"sources": [source, ...], "refs": [i0, loc0, i1, loc1, ...]}` where `i`
indexes `sources`; flat ints keep 10,000 references near 120 KB of JSON.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from conveyor.data.base import Node, StateField

# Set to False to make buffers save element bytes as before (benchmarks compare the two).
enabled = True


def encode(provenances: Sequence[tuple[Any, int]]) -> dict[str, Any]:
    """The state form of a buffer whose every element has a provenance."""
    sources: list = []
    index: dict[int, int] = {}  # id(source) -> position; sources stay alive in `provenances`
    refs: list[int] = []
    for source, locator in provenances:
        i = index.get(id(source))
        if i is None:
            i = index[id(source)] = len(sources)
            sources.append(source)
        refs.append(i)
        refs.append(locator)
    return {"sources": sources, "refs": refs}


def is_encoded(field: StateField) -> bool:
    return isinstance(field.value, dict)


def decode(field: StateField, node: Node, max_len: int | None = None) -> tuple[list, list]:
    """Read again the elements that `encode` described, in their saved order; return them and their
    provenances (so that the restored buffer saves small states too).

    Every element of one source is handed to `node.reread` in one call, so a file is opened once
    and read in offset order."""
    field.fields(("sources", "refs"))
    refs = field["refs"].as_list()
    if len(refs) % 2:
        raise field["refs"].error("expected pairs of (source index, locator), got an odd number of items")
    n = len(refs) // 2
    if max_len is not None and n > max_len:
        raise field["refs"].error(f"expected at most {max_len} elements, got {n}")
    sources = field["sources"].as_list(max_len=max(n, 1))
    wanted: dict[int, list[tuple[int, StateField]]] = {}
    for k in range(n):
        i = refs[2 * k].as_int(0, len(sources) - 1)
        wanted.setdefault(i, []).append((k, refs[2 * k + 1]))
    out: list = [None] * n
    provenances: list = [None] * n
    for i, items in wanted.items():
        locators = [f for _, f in items]
        elements = node.reread(sources[i], locators)
        source = sources[i].value  # one object per source, as `encode` expects
        for (k, _), x, f in zip(items, elements, locators, strict=True):
            out[k] = x
            provenances[k] = (source, f.value)
    return out, provenances


def refused(field: StateField) -> Exception:
    """A state with provenances for a buffer whose input cannot re-read its elements."""
    return field.error("expected saved elements (a list): this buffer's input cannot re-read its elements, "
                       "so its state never holds provenances")
