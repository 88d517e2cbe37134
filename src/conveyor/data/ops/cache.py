"""`cache(filename="")`: record the first complete pass over the input and replay it afterwards.

    ds = Dataset.from_tensor_slices(paths).map(load).cache()
    ds = ds.shuffle(1000).repeat()        # epoch 1 onwards replays from memory

tf.data semantics (docs/tfdata-semantics.md §11): the first iterator that reads the input *to its end*
records the elements — in memory when `filename == ""`, else in `<filename>.cache` — and every later
iterator replays that recording without touching the input; a pass closed half-way records nothing.
Every pass yields the same elements, so shuffle *after* it. Replayed numpy arrays are read-only; a file
cache persists across runs (delete it to rebuild). Resuming is exact, inside a recording pass or a
replay, for inputs that are deterministic given their seeds (§11 says how).
"""

from __future__ import annotations

import os
import threading
import uuid
from typing import Any

import numpy as np

from conveyor.data.base import Context, Iter, Node, StateField
from conveyor.data.elements import flatten, pack_bytes, unpack
from conveyor.data.errors import StateMismatchError
from conveyor.data.records.tfrecord import TFRecordReader, TFRecordWriter


class _Recording:
    """What the first complete pass left: its context and, for a memory cache, its elements.

    `source` (root seed, iteration, path and epochs of the `Context` the input was built with) is
    set even by a complete pass that could not record (one resumed half-way): a later pass then
    rebuilds its input from that context, so it sees the same elements the completed pass did.
    """

    def __init__(self):
        self.lock = threading.Lock()
        self.elements: list | None = None
        self.source: dict | None = None


class CacheNode(Node):
    name = "cache"

    def __init__(self, input: Node, filename: str | os.PathLike = ""):
        super().__init__(input)
        if not isinstance(filename, (str, os.PathLike)):
            raise TypeError(
                f"cache filename must be a path (or '' for memory), got {type(filename).__name__}"
            )
        self.filename = os.fspath(filename)
        self.path = self.filename + ".cache" if self.filename else ""
        self.recording = _Recording()  # copy.copy (with_inputs) shares it

    def params(self) -> dict[str, Any]:
        return {"filename": self.filename}

    @property
    def keeps_elements(self) -> bool:
        # a cache file is replayed even when the input changed since it was written
        return not self.filename

    def iterator(self, ctx: Context) -> Iter:
        return CacheIter(self, ctx)


class CacheIter(Iter):
    def __init__(self, node: CacheNode, ctx: Context):
        super().__init__(node.name, ctx)
        self._node, self._ctx = node, ctx
        self._mode = "done"  # input | memory | file | done
        self._input: Iter | None = None
        self._source: dict = {}  # the context the input pass was built with (see `_Recording`)
        self._recording = False  # this input pass started at its beginning: it records
        self._fast_forward = 0  # rebuilding a lost memory recording: elements to record, not return
        self._pos = 0  # elements returned
        self._recorded: list = []  # memory: the elements of this recording pass
        self._elements: list = []  # memory: the finished recording being replayed
        self._writer: TFRecordWriter | None = None
        self._tmp = ""
        self._reader: TFRecordReader | None = None
        self._offset, self._size = 0, 0
        if node.path and os.path.exists(node.path):
            self._mode, self._size = "file", os.path.getsize(node.path)
            return
        rec = node.recording
        with rec.lock:
            elements, source = rec.elements, rec.source
        if elements is not None and not node.path:
            self._mode, self._elements, self._source = "memory", elements, source
            return
        self._open_input(source or _describe(ctx.child(0)), recording=True)

    def _open_input(self, source: dict, recording: bool) -> None:
        ctx = Context(int(source["root_seed"]), int(source["iteration"]), tuple(source["path"]),
                      tuple(source["epochs"]), self._ctx.stats)
        self._mode, self._source, self._recording = "input", source, recording
        self._input = self._node.inputs[0].iterator(ctx)
        self.inputs = [self._input]

    # ---- elements

    def _next(self) -> Any:
        mode = self._mode
        if mode == "memory":
            if self._pos >= len(self._elements):
                self._finish()
                raise StopIteration
            self._pos += 1
            return self._elements[self._pos - 1]
        if mode == "file":
            if self._reader is None:
                self._reader = TFRecordReader(self._node.path, offset=self._offset)
            try:
                return unpack(next(self._reader))
            except StopIteration:
                self._finish()
                raise
        if mode == "done":
            raise StopIteration
        it = self._input
        try:
            while self._fast_forward:
                self._record(next(it))
                self._fast_forward -= 1
            x = next(it)
        except StopIteration:
            if self._fast_forward:
                raise StateMismatchError(
                    f"cache: re-running the pass that filled the memory cache ended {self._fast_forward} "
                    f"elements before the saved position {self._pos}; an op upstream of cache() is not "
                    f"deterministic, so this state cannot be resumed in a new process (use cache(filename))"
                ) from None
            self._complete()
            self._finish()
            raise
        if self._recording:
            self._record(x)
        self._pos += 1
        return x

    def _record(self, x: Any) -> None:
        if not self._node.path:
            for leaf in flatten(x)[1]:
                if isinstance(leaf, np.ndarray):
                    leaf.flags.writeable = False
            self._recorded.append(x)
            return
        if self._writer is None:
            self._open_writer()
        self._writer.write(pack_bytes(x))

    def _open_writer(self) -> None:
        self._tmp = f"{self._node.path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.makedirs(os.path.dirname(self._tmp) or ".", exist_ok=True)
        self._writer = TFRecordWriter(self._tmp)

    def _complete(self) -> None:
        """The input pass is complete: publish it, unless a different pass completed first."""
        rec = self._node.recording
        with rec.lock:
            first = rec.source is None or rec.source == self._source
            if rec.source is None:
                rec.source = self._source
            if first and self._recording and not self._node.path and rec.elements is None:
                rec.elements = self._recorded
        if not self._node.path or not self._recording:
            return
        if self._writer is None:  # an empty input: the cache is an empty file
            self._open_writer()
        self._writer.close()
        self._writer = None
        if first:
            try:
                os.link(self._tmp, self._node.path)  # atomic, and never overwrites
            except FileExistsError:
                pass
            except OSError:  # file systems without hard links
                if not os.path.exists(self._node.path):
                    os.replace(self._tmp, self._node.path)
        _remove(self._tmp)

    def _finish(self) -> None:
        self._mode = "done"
        if self._input is not None:
            self._input.close()
            self._input = None
        if self._reader is not None:
            self._offset = self._reader.offset
            self._reader.close()
            self._reader = None

    # ---- state

    def get_state(self) -> dict[str, Any]:
        mode = self._mode
        if mode == "memory" or (mode == "input" and self._fast_forward):
            return {"mode": "memory", "pos": self._pos, "source": self._source}
        if mode == "input":
            return {"mode": "pass", "pos": self._pos, "source": self._source, "input": self._input.get_state()}
        if mode == "file":
            offset = self._reader.offset if self._reader is not None else self._offset
            return {"mode": "file", "offset": offset, "size": self._size}
        return {"mode": "done"}

    def set_state(self, state: StateField) -> None:
        mode = state["mode"].value
        keys = _STATE_KEYS.get(mode) if isinstance(mode, str) else None
        if keys is None:
            raise state["mode"].error(f"expected one of {sorted(_STATE_KEYS)}")
        state.fields(keys)
        self._finish()
        if mode == "pass":  # an input pass: it records only if nothing had been returned yet
            self._pos = state["pos"].as_int(0)
            self._open_input(_source(state["source"]), recording=self._pos == 0)
            self._input.set_state(state["input"])
        elif mode == "memory":
            self._resume_memory(state["pos"].as_int(0), _source(state["source"]))
        elif mode == "file":
            size = state["size"].as_int(0)
            self._resume_file(state["offset"].as_int(0, size), size)

    def _resume_memory(self, pos: int, source: dict) -> None:
        if self._node.path:
            raise StateMismatchError(
                f"cache state is a memory replay, but this cache writes {self._node.path}"
            )
        rec = self._node.recording
        with rec.lock:
            elements, current = rec.elements, rec.source
        if elements is not None and current == source:
            self._mode, self._elements, self._source, self._pos = "memory", elements, source, pos
            return
        # the recording is gone (a new process): rebuild it by re-running the pass that made it
        self._open_input(source, recording=True)
        self._pos = self._fast_forward = pos

    def _resume_file(self, offset: int, size: int) -> None:
        path = self._node.path
        now = os.path.getsize(path) if path and os.path.exists(path) else None
        if now != size:
            found = "missing" if now is None else f"{now} bytes"
            raise StateMismatchError(
                f"cache file {path or '(none: this is a memory cache)'} changed since the state was saved "
                f"({size} bytes then, {found} now); the saved position no longer means anything: restore "
                f"the file or start the iteration afresh"
            )
        self._mode, self._size, self._offset = "file", size, offset

    def close(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:  # an unfinished recording pass leaves nothing behind
            writer.close()
            _remove(self._tmp)
        self._finish()
        super().close()


_STATE_KEYS = {"pass": ("mode", "pos", "source", "input"), "memory": ("mode", "pos", "source"),
               "file": ("mode", "offset", "size"), "done": ("mode",)}


def _source(field: StateField) -> dict:
    """A saved context (see `_describe`), checked."""
    field.fields(("root_seed", "iteration", "path", "epochs"))
    return {"root_seed": field["root_seed"].as_int(0, 2**64 - 1), "iteration": field["iteration"].as_int(0),
            "path": [f.as_int(0) for f in field["path"].as_list()],
            "epochs": [f.as_int(0) for f in field["epochs"].as_list()]}


def _describe(ctx: Context) -> dict:
    """The JSON form of the context an input pass is built with."""
    return {"root_seed": ctx.root_seed, "iteration": ctx.iteration, "path": list(ctx.path),
            "epochs": list(ctx.epochs)}


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
