"""The rest of an interrupted epoch, saved by N workers, dealt over M workers: every record exactly once.

    shares = plan(dataset, [Saved(state_r, share_r) for r in range(N)], M)     # the same on every rank
    it = leftover_iterator(dataset, shares[k], root_seed, epoch)                # worker k's rest of the epoch

`dataset` is the pipeline as new worker k builds it, with `shard(M, k)`. Old worker r ran it with
`shard(N, r)` instead (its saved fingerprint must say so), or a leftover of an earlier change (`share_r`).
`plan` reads each saved state into what r had not handed out: records, by provenance, that the record
level (range, from_tensor_slices, TFRecordDataset, or an interleave of those) has still to produce or
that shuffle buffers hold, and the elements the element ops above it (batch, filter, map, shuffle,
prefetch, shard; `to_torch`'s look-ahead) hold, each at its depth; then deals them, in a fixed order, to
the least-loaded new worker. Worker k's leftover pipeline is `dataset`'s element ops without shards over
its records (re-read through the record level), its held elements handed out first at their depth
(ops/leftover.py); its shuffles draw from the saved seed: same checkpoint and M, same order.

Exactly once: each pending record and held element goes to one new worker, which hands it out once;
a held element re-enters at its depth, so it passes no map twice (a fused map+batch saved its chunk
from before the map: it is mapped again). Anything else is refused with `RedistributeError` naming the
op (from_generator, cache, repeat, take, skip, unbatch, a shard over a map, an interleave over datasets
with ops, computed file names). Shares may differ in batches: the Trainer's workers that run out take
zero-weight steps until the last one's are used (docs/training.md, "Uneven batches"). Design:
docs/data.md, "Resuming on another number of workers".
"""

from __future__ import annotations

import heapq
import json
import os
from dataclasses import dataclass, field
from typing import Any

from conveyor.data import provenance
from conveyor.data.base import Context, DatasetIterator, Node, StateField
from conveyor.data.elements import to_json
from conveyor.data.errors import RedistributeError
from conveyor.data.ops.batch import BatchNode
from conveyor.data.ops.leftover import LeftoverNode, PrependNode
from conveyor.data.ops.shard import ShardNode
from conveyor.data.pipeline import _optimize
from conveyor.data.records.tfrecord import build_index
from conveyor.data.sources.tfrecord import _as_path

__all__ = ["Saved", "leftover_iterator", "leftover_node", "plan"]

SHARE_FORMAT = "conveyor.data.leftover"
_ELEMENT_OPS = ("batch", "filter", "map", "shuffle", "prefetch", "shard", "prepend")
_RECORD_LEVELS = ("range", "from_tensor_slices", "tfrecord", "interleave", "leftover")
_TORCH_FORMAT = "conveyor.data.torch_adapter"


@dataclass(frozen=True)
class Saved:
    """One old worker's saved data: its iterator state (a `DatasetIterator`'s or `to_torch`'s; None: its
    epoch was over) and the leftover share it was running (None: it ran the pipeline itself)."""

    state: dict | None
    share: dict | None = None


@dataclass
class _Pending:
    records: list = field(default_factory=list)  # (source, locator) at the record level
    held: list = field(default_factory=list)  # (depth, element as saved by to_json)


def plan(dataset: Any, saved: list[Saved], world: int) -> list[dict]:
    """Every new worker's share of what the old workers in `saved` (index = old rank) left of the epoch."""
    node = _node_of(dataset)
    chain, _ = split(node)
    if not any(isinstance(n, ShardNode) and n.num_shards == world for n in _nodes(node)):
        raise RedistributeError(f"the training data has no shard({world}, rank) step: every worker reads all of it, "
                                f"so what the old workers read cannot be told apart and dealt")
    pending = _Pending()
    for rank, s in enumerate(saved):
        tree = _reshard(node, world, len(saved), rank) if s.share is None else leftover_node(node, s.share)
        _collect(tree, s.state, rank, pending)
    return _deal(pending, world, [n for n in chain if n.name != "shard"])


def leftover_iterator(dataset: Any, share: dict, root_seed: int, iteration: int) -> DatasetIterator:
    """The iterator of worker's `share` of an epoch's rest (module docstring)."""
    return DatasetIterator(_optimize(leftover_node(_node_of(dataset), share)), root_seed, iteration)


def leftover_node(node: Node, share: dict) -> Node:
    """`node`'s element ops without shards, over the share's records, with its held elements prepended."""
    chain, record_level = split(node)
    ops = [n for n in chain if n.name != "shard"]
    sources, refs, held = _check_share(share, len(ops))
    cur: Node = LeftoverNode(record_level, sources, refs)
    if len(ops) in held:
        cur = PrependNode(cur, len(ops), held[len(ops)])
    for depth in reversed(range(len(ops))):
        cur = ops[depth].with_inputs((cur,))
        if depth in held:
            cur = PrependNode(cur, depth, held[depth])
    return cur


def split(node: Node) -> tuple[list[Node], Node]:
    """(the element ops from the top, the record level under them); any other op is refused by name."""
    chain = []
    while node.name in _ELEMENT_OPS:
        chain.append(node)
        node = node.inputs[0]
    if node.name not in _RECORD_LEVELS:
        raise RedistributeError(f"the {node.name} op cannot be redistributed: "
                                + ("its source cannot read an element again" if not node.inputs else
                                   "its state does not say which records it has handed out"))
    return chain, node


# ---------------------------------------------------------------------------------------------- reading states


def _collect(tree: Node, state: dict | None, rank: int, out: _Pending) -> None:
    """What old worker `rank`, running `tree`, had not handed out, added to `out`."""
    if state is None:
        return
    if isinstance(state, dict) and state.get("format") == _TORCH_FORMAT:
        outer = StateField(state, f"worker {rank}'s state").fields(("format", "version", "iterator", "pending"))
        out.held += [(0, f.value) for f in outer["pending"].as_list()]
        state = state["iterator"]
    fingerprint = json.loads(json.dumps(_optimize(tree).fingerprint()))
    if not isinstance(state, dict) or state.get("pipeline") != fingerprint:
        raise RedistributeError(f"worker {rank}'s saved data state is not of this pipeline as that worker ran it "
                                f"(with its shard of the old world in place of this one's): the pipeline changed")
    top = StateField(state, f"worker {rank}'s state")
    if top["exhausted"].as_bool():
        return
    ctx = Context(root_seed=top["root_seed"].as_int(0, 2**64 - 1), iteration=top["iteration"].as_int(0, 2**63 - 1))
    _walk(tree, top["state"], ctx, out)


def _walk(node: Node, f: StateField, ctx: Context, out: _Pending) -> None:
    depth = 0  # of the stream `node` produces, counted in element ops (shards and prepends do not count)
    while node.name in _ELEMENT_OPS:
        if f.is_none():
            return  # the op had finished its input
        if node.name == "shard":
            out.records += _drain_provenances(node, f, ctx)
            return
        if node.name == "prepend":
            pos = f.fields(("pos", "input"))["pos"].as_int(0, len(node.elements))
            out.held += [(node.depth, x) for x in node.elements[pos:]]
            node, f, ctx = node.inputs[0], f["input"], ctx.child(0)
            continue
        fused = node.name == "batch" and isinstance(f.value, dict) and "chunks" in f.value
        _held(node, f, depth + 1 + fused, out)
        for _ in range(1 + fused):  # a fused map+batch is one state for two ops
            node, ctx = node.inputs[0], ctx.child(0)
            depth += 1
        f = f["input"]
    if not f.is_none():
        _records(node, f, ctx, out, depth)


def _held(node: Node, f: StateField, depth: int, out: _Pending) -> None:
    """The elements of its input that an element op holds (its saved buffers); its input state stays in f."""
    value = f.as_dict()
    if "chunks" in value:  # a map in processes: chunks of its input in flight, minus what was handed out
        for chunk in f["chunks"].as_list():
            _, xs, skip = chunk.as_list(length=3)
            out.held += [(depth, x.value) for x in xs.as_list()[skip.as_int(0):]]
    elif "pending" in value:  # a map in threads
        out.held += [(depth, x.value) for x in f["pending"].as_list()]
    elif "buffer" in value:  # shuffle, prefetch
        buffer = f["buffer"]
        if provenance.is_encoded(buffer):
            out.records += _decoded(buffer)
        else:
            out.held += [(depth, x.value) for x in buffer.as_list()]


def _decoded(f: StateField) -> list[tuple[Any, int]]:
    f.fields(("sources", "refs"))
    sources, refs = f["sources"].as_list(), f["refs"].as_list()
    return [(sources[refs[i].as_int(0, len(sources) - 1)].value, refs[i + 1].as_int(None))
            for i in range(0, len(refs) - 1, 2)]


def _drain_provenances(node: Node, f: StateField | None, ctx: Context) -> list[tuple[Any, int]]:
    """Run a restored (or fresh, f None) iterator of `node` to its end; the provenance of each element."""
    it = node.iterator(ctx)
    try:
        if not it.enable_provenance():
            raise RedistributeError(f"the {node.name} op over {node.inputs[0].name} cannot be redistributed: its "
                                    f"elements cannot be read again (shard before any map)")
        if f is not None:
            it.set_state(f)
        got = []
        for _ in it:
            p = it.provenance()
            if p is None:
                raise RedistributeError(f"the {node.name} op cannot be redistributed: an element under it has no "
                                        f"provenance (shard before any map)")
            got.append(p)
        return got
    finally:
        it.close()


def _drain(node: Node, f: StateField | None, ctx: Context) -> list:
    it = node.iterator(ctx)
    try:
        if f is not None:
            it.set_state(f)
        return list(it)
    finally:
        it.close()


def _records(node: Node, f: StateField | None, ctx: Context, out: _Pending, depth: int) -> None:
    """The records a record level still has to produce (f None: a fresh one, all of them)."""
    if node.name in ("range", "from_tensor_slices"):
        start = 0 if f is None else f.fields(("next",))["next"].as_int(0, node.length)
        out.records += [(None, i) for i in range(start, node.length)]
    elif node.name == "tfrecord":
        out.records += _tfrecord_records(node, f, ctx)
    elif node.name == "interleave":
        _interleave_records(node, f, ctx, out, depth)
    elif node.name == "leftover" and f is not None:
        start = f.fields(("next",))["next"].as_int(0, node.length)
        out.records += [(node.sources[node.refs[2 * i]], node.refs[2 * i + 1]) for i in range(start, node.length)]
    else:
        raise RedistributeError(f"the {node.name} op cannot be redistributed: an interleave's datasets must be "
                                f"record sources (range, from_tensor_slices, TFRecordDataset), without ops")


def _tfrecord_records(node: Any, f: StateField | None, ctx: Context) -> list[tuple[Any, int]]:
    if node.inputs[0].known_elements() is None:
        raise RedistributeError("the tfrecord op cannot be redistributed: its file names are computed (by a map), "
                                "so its records cannot be read again by name")
    got: list = []
    files = None
    if f is not None:
        f.fields(("files", "path", "offset"), optional=("size", "mtime_ns"))
        if not f["path"].is_none():
            saved = (f["size"].as_int(0), f["mtime_ns"].as_int(None)) if f.get("size") else None
            got += _file_records(node, f["path"].as_str(), f["offset"].as_int(0), saved)
        files = f["files"]
        if files.is_none():
            return got
    for name in _drain(node.inputs[0], files, ctx.child(0)):
        got += _file_records(node, _as_path(name), 0, None)
    return got


def _file_records(node: Any, path: str, offset: int, saved: tuple[int, int] | None) -> list[tuple[list, int]]:
    """(source, offset) of every record of `path` from `offset` on (the file is read once, verified)."""
    st = os.stat(path)
    now = (st.st_size, st.st_mtime_ns)
    if saved is not None and saved != now:
        raise RedistributeError(f"{path} changed since the checkpoint ({saved[0]} bytes then, {now[0]} now): its "
                                f"saved offsets would land in other records")
    source = [path, *now]
    index = [int(o) for o in build_index(path, node.compression_type)]
    offsets = [o for o in index if o >= offset]
    if offsets and offsets[0] != offset:
        raise RedistributeError(f"{path} has no record at the saved byte {offset} (a record spans it)")
    return [(source, o) for o in offsets]


def _interleave_records(node: Any, f: StateField | None, ctx: Context, out: _Pending, depth: int) -> None:
    """Open slots (read-ahead first, then the rest of each inner dataset), then the input elements not yet opened."""
    slots, opened, input_field = [], 0, None
    if f is not None:
        f.fields(("input", "cycle_length", "ci", "bi", "num_opened", "slots"))
        slots, opened, input_field = f["slots"].as_list(), f["num_opened"].as_int(0), f["input"]
    known = node.inputs[0].known_elements()
    for s in slots:
        if s.is_none():
            continue
        s.fields(("element", "index", "inner", "buffer", "done"))
        key, element = s["element"].value, s["element"].as_element(known)
        inner = _Pending()
        if provenance.is_encoded(s["buffer"]):
            inner.records += _decoded(s["buffer"])
        else:
            out.held += [(depth, x.value) for x in s["buffer"].as_list()]
        if not s["inner"].is_none():
            _records(node.dataset_of(element), s["inner"], ctx.child(1).child(s["index"].as_int(0)), inner, depth)
        _wrap(key, inner, out)
    if f is not None and input_field.is_none():
        return
    for j, element in enumerate(_drain(node.inputs[0], input_field, ctx.child(0))):
        inner = _Pending()
        _records(node.dataset_of(element), None, ctx.child(1).child(opened + j), inner, depth)
        _wrap(to_json(element), inner, out)


def _wrap(key: Any, inner: _Pending, out: _Pending) -> None:
    """An inner dataset's records as the interleave's: its provenance names the element that opened it."""
    wrapped: dict[int, list] = {}
    for source, locator in inner.records:
        w = wrapped.get(id(source))
        if w is None:
            w = wrapped[id(source)] = [key, source]
        out.records.append((w, locator))
    out.held += inner.held


# ---------------------------------------------------------------------------------------------- dealing


def _deal(pending: _Pending, world: int, ops: list[Node]) -> list[dict]:
    """Units to the least-loaded worker (ties: the lowest rank), held elements from the top first, then records."""
    weight = [1] * (len(ops) + 1)  # records below depth d that one element at depth d carries
    for d in reversed(range(len(ops))):
        weight[d] = weight[d + 1] * (ops[d].batch_size if isinstance(ops[d], BatchNode) else 1)
    heap = [(0, k) for k in range(world)]
    shares = [{"format": SHARE_FORMAT, "sources": [], "refs": [], "held": {}} for _ in range(world)]
    indices: list[dict[str, int]] = [{} for _ in range(world)]
    keys: dict[int, str] = {}

    def take(w: int) -> int:
        load, k = heapq.heappop(heap)
        heapq.heappush(heap, (load + w, k))
        return k

    for depth, x in sorted(pending.held, key=lambda p: p[0]):
        shares[take(weight[min(depth, len(ops))])]["held"].setdefault(str(depth), []).append(x)
    for source, locator in pending.records:
        k = take(1)
        key = keys.get(id(source))
        if key is None:
            key = keys[id(source)] = json.dumps(source, sort_keys=True)
        i = indices[k].get(key)
        if i is None:
            i = indices[k][key] = len(shares[k]["sources"])
            shares[k]["sources"].append(source)
        shares[k]["refs"] += (i, locator)
    return shares


def _check_share(share: Any, levels: int) -> tuple[list, list[int], dict[int, list]]:
    """A share read back from a checkpoint (untrusted): its shape; the records are checked when re-read."""
    f = StateField(share, "leftover share").fields(("format", "sources", "refs", "held"))
    if f["format"].value != SHARE_FORMAT:
        raise f["format"].error(f"expected {SHARE_FORMAT!r}")
    sources = [s.value for s in f["sources"].as_list()]
    refs = [r.as_int(None) for r in f["refs"].as_list()]
    if len(refs) % 2 or any(not 0 <= refs[i] < len(sources) for i in range(0, len(refs), 2)):
        raise f["refs"].error("expected pairs of (source index, locator)")
    held = {}
    for key, items in f["held"].as_dict().items():
        if not (isinstance(key, str) and key.isdigit() and int(key) <= levels and isinstance(items, list)):
            raise f["held"].error(f"expected depths 0..{levels} with lists of elements, got {key!r}")
        held[int(key)] = items
    return sources, refs, held


def _reshard(node: Node, world: int, old_world: int, rank: int) -> Node:
    """`node` with every `shard(world, i)` replaced by `shard(old_world, rank)`."""
    inputs = tuple(_reshard(n, world, old_world, rank) for n in node.inputs)
    if isinstance(node, ShardNode) and node.num_shards == world:
        return ShardNode(inputs[0], old_world, rank)
    return node if inputs == node.inputs else node.with_inputs(inputs)


def _nodes(node: Node) -> list[Node]:
    return [node] + [n for child in node.inputs for n in _nodes(child)]


def _node_of(dataset: Any) -> Node:
    return dataset if isinstance(dataset, Node) else dataset._node
