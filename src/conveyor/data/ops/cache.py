"""`cache(filename="")`: record the first complete pass over the input and replay it afterwards.

tf.data semantics (TFDATA.md §11): the first iterator that reads the input *to its end* records
the elements — in memory when `filename == ""`, else in a file — and every later iterator replays
that recording without touching the input. "For the cache to be finalized, the input dataset must
be iterated through in its entirety": an iterator closed half-way records nothing. `cache` yields
exactly the same elements on every pass, so shuffle *after* it.

    ds = Dataset.from_tensor_slices(paths).map(load).cache()
    ds = ds.shuffle(1000).repeat()        # epoch 1 onwards replays from memory

- Memory: the recording lives on the recipe (shared with the copies pipeline rewrites make), so
  every iterator of the same `Dataset` — including later epochs of a `repeat` — replays it. Its
  numpy arrays are made read-only, because the same objects are handed out on every pass: code
  downstream that wrote into them would silently change later epochs; copy before modifying.
- File: elements go to `<filename>.cache`, a TFRecord file of `elements.pack_bytes` records,
  written under a temporary name and moved into place (without overwriting) only when the pass is
  complete, so a partial pass leaves no cache behind and the first complete pass wins. As in
  tf.data the file persists across runs and is replayed even if the upstream pipeline changed:
  delete it to rebuild. Give every worker its own `filename` when the workers' inputs differ.

State: while replaying, the position (memory) or the byte offset (file). While recording, the
input's state: a resumed recording pass passes elements through but no longer records — only
passes that ran from their start are candidates, and the next pass records instead. A memory
replay resumed in a new process, where the recording is gone, rebuilds it by re-running the
recording pass (same seeds, iteration and epochs, which the state keeps) and reading up to the
saved position; that reproduces the recording exactly when the input is deterministic given its
seeds, as every conveyor op is. A file replay refuses to resume if the file changed size.
"""

from __future__ import annotations

import os
import threading
import uuid
from typing import Any

import numpy as np

from conveyor.data.base import Context, Iter, Node
from conveyor.data.elements import flatten, pack_bytes, unpack
from conveyor.data.errors import StateMismatchError
from conveyor.data.records.tfrecord import TFRecordReader, TFRecordWriter


class _Recording:
    """The finished memory cache: the elements and the context of the pass that produced them."""

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

    def iterator(self, ctx: Context) -> Iter:
        return CacheIter(self, ctx)


class CacheIter(Iter):
    def __init__(self, node: CacheNode, ctx: Context):
        super().__init__(node.name, ctx)
        self._node, self._ctx = node, ctx
        self._mode = "done"  # record | pass | memory | file | done
        self._input: Iter | None = None
        self._pos = 0  # elements returned (memory replay and recording)
        self._source: dict | None = None  # the context of the recording pass (memory)
        self._regenerating = False  # rebuilding a lost memory recording after a resume
        self._fast_forward = 0  # elements to read and record before returning any
        self._recorded: list = []  # memory: the elements of this recording pass
        self._elements: list = []  # memory: the finished recording being replayed
        self._writer: TFRecordWriter | None = None
        self._tmp = ""
        self._reader: TFRecordReader | None = None
        self._offset, self._size = 0, 0
        if node.path and os.path.exists(node.path):
            self._mode, self._size = "file", os.path.getsize(node.path)
            return
        if not node.path:
            with node.recording.lock:
                elements, source = node.recording.elements, node.recording.source
            if elements is not None:
                self._mode, self._elements, self._source = "memory", elements, source
                return
        self._open_input(ctx.child(0), "record")

    def _open_input(self, ctx: Context, mode: str) -> None:
        self._mode = mode
        self._input = self._node.inputs[0].iterator(ctx)
        self.inputs = [self._input]
        self._source = {"root_seed": ctx.root_seed, "iteration": ctx.iteration, "path": list(ctx.path),
                        "epochs": list(ctx.epochs)}

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
            if mode == "record":
                self._commit()
            self._finish()
            raise
        if mode == "record":
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

    def _commit(self) -> None:
        """The pass is complete: publish the recording unless another pass got there first."""
        if not self._node.path:
            rec = self._node.recording
            with rec.lock:
                if rec.elements is None:
                    rec.elements, rec.source = self._recorded, self._source
            return
        if self._writer is None:  # an empty input: the cache is an empty file
            self._open_writer()
        self._writer.close()
        self._writer = None
        try:
            os.link(self._tmp, self._node.path)  # atomic and never overwrites
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
        if mode == "memory" or self._regenerating:
            if mode == "done":
                return {"mode": "done"}
            return {"mode": "memory", "pos": self._pos, "source": self._source}
        if mode == "file":
            offset = self._reader.offset if self._reader is not None else self._offset
            return {"mode": "file", "offset": offset, "size": self._size}
        if mode == "record" and self._pos == 0:
            return {"mode": "start"}  # nothing returned yet: a resumed iterator may start recording
        if mode in ("record", "pass"):
            return {"mode": "pass", "input": self._input.get_state()}
        return {"mode": "done"}

    def set_state(self, state: dict[str, Any]) -> None:
        mode = state["mode"]
        if mode == "start":
            return
        self._finish()
        if mode == "pass":
            self._open_input(self._ctx.child(0), "pass")
            self._input.set_state(state["input"])
        elif mode == "memory":
            self._resume_memory(int(state["pos"]), state["source"])
        elif mode == "file":
            self._resume_file(int(state["offset"]), int(state["size"]))
        elif mode != "done":
            raise StateMismatchError(f"cache state has unknown mode {mode!r}")

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
        ctx = Context(int(source["root_seed"]), int(source["iteration"]), tuple(source["path"]),
                      tuple(source["epochs"]), self._ctx.stats)
        self._open_input(ctx, "record")
        self._regenerating, self._pos, self._fast_forward = True, pos, pos

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


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
