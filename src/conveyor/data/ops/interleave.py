"""`interleave(map_func, cycle_length, block_length, num_parallel_calls, deterministic)`.

Opens `map_func(x)` for up to `cycle_length` input elements and takes `block_length` consecutive
elements from each in turn, in the order of tf.data's sequential kernel, exactly
(docs/tfdata-semantics.md §6).

    Dataset.range(1, 6).interleave(lambda x: Dataset.from_tensor_slices([x] * 6),
                                   cycle_length=2, block_length=4)
    # 1,1,1,1, 2,2,2,2, 1,1, 2,2, 3,3,3,3, 4,4,4,4, 3,3, 4,4, 5,5,5,5, 5,5

`cycle_length` None or AUTOTUNE means one slot per core. With `num_parallel_calls` reader threads read
ahead into per-slot buffers and the output is unchanged (any ready slot with `deterministic=False`);
errors reach the consumer where the sequential version raises them. The iterator's state resumes the
same order, even on another machine (§6 lists what it holds).
"""

from __future__ import annotations

import collections
import dataclasses
import operator
import threading
from collections.abc import Callable
from typing import Any

from conveyor.data import provenance
from conveyor.data.base import AUTOTUNE, Context, Iter, Node, StateField, call, cpu_budget, describe_fn
from conveyor.data.elements import to_json
from conveyor.data.errors import InvalidArgumentError

_WAIT = 0.05  # seconds between checks of the stop flag in every blocking wait
_JOIN_TIMEOUT = 5.0  # how long close() waits for a reader stuck inside an inner dataset's next()

_GROW_AFTER = 16  # consumer waits per added reader thread under AUTOTUNE
_MIN_READ_AHEAD = 16  # elements a slot may hold read ahead (at least two blocks)
_READ_BATCH = 16  # most elements a reader takes from one slot before handing it back

_ITEM, _END, _ERROR = 0, 1, 2
_ANY_SLOT = object()


class InterleaveNode(Node):
    name = "interleave"

    def __init__(self, input: Node, map_func: Callable[..., Node], cycle_length: int | None,
                 block_length: int, num_parallel_calls: int | None, deterministic: bool | None):
        super().__init__(input)
        if cycle_length is not None and cycle_length != AUTOTUNE:
            cycle_length = _check_positive("cycle_length", cycle_length, "or AUTOTUNE")
        block_length = _check_positive("block_length", block_length)
        if num_parallel_calls is not None and num_parallel_calls != AUTOTUNE:
            num_parallel_calls = _check_positive("num_parallel_calls", num_parallel_calls, "or AUTOTUNE")
        if deterministic is not None and not isinstance(deterministic, bool):
            raise InvalidArgumentError(f"deterministic must be True, False or None, got {deterministic!r}")
        self.map_func = map_func
        self.cycle_length = cycle_length
        self.block_length = block_length
        self.num_parallel_calls = num_parallel_calls
        self.deterministic = deterministic

    def params(self) -> dict[str, Any]:
        return {"map_func": describe_fn(self.map_func), "cycle_length": self.cycle_length,
                "block_length": self.block_length, "num_parallel_calls": self.num_parallel_calls,
                "deterministic": self.deterministic}

    def dataset_of(self, element: Any) -> Node:
        node = call(self.map_func, element)
        if not isinstance(node, Node):
            raise TypeError(
                f"interleave's map_func must return a dataset, {describe_fn(self.map_func)} returned "
                f"{type(node).__name__}"
            )
        return node

    def reread(self, source: StateField, locators: list[StateField]) -> list:
        """Provenance of an interleave: [the input element that opened the dataset, its source]."""
        parts = source.as_list(length=2)
        element = parts[0].as_element(self.inputs[0].known_elements())  # checked before map_func sees it
        return self.dataset_of(element).reread(parts[1], locators)

    def iterator(self, ctx: Context) -> Iter:
        if self.num_parallel_calls is None:
            return SequentialInterleaveIter(self, ctx)
        return ParallelInterleaveIter(self, ctx)


def _check_positive(what: str, value: Any, alternative: str = "") -> int:
    try:
        n = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        n = None
    if n is None or n < 1:
        extra = f" {alternative}" if alternative else ""
        raise InvalidArgumentError(f"interleave {what} must be a positive integer{extra}, got {value!r}")
    return n


def _resolve(n: int | None) -> int:
    """None and AUTOTUNE mean "as many as there are cores" (tf.data: based on available CPU)."""
    return cpu_budget() if n is None or n == AUTOTUNE else int(n)


class _Slot:
    """One cycle element: the inner iterator and, when parallel, what was read ahead from it."""

    __slots__ = ("element", "index", "inner", "buffer", "busy", "done", "error_pending", "orphaned", "key",
                 "inner_source", "source")

    def __init__(self, element: Any, index: int, inner: Iter | None):
        self.element = element  # the input element map_func turned into this dataset
        self.index = index  # how many input elements were opened before this one
        self.inner = inner
        self.buffer: collections.deque = collections.deque()  # (kind, value, provenance), parallel only
        self.busy = False  # a reader thread is inside next(inner)
        self.done = False  # the inner iterator ended (an _END entry is queued)
        self.error_pending = False  # an _ERROR entry is queued; reading resumes once it is returned
        self.orphaned = False  # the interleave closed while a reader was busy: the reader closes inner
        self.key: Any = None  # to_json(element), once a provenance needs it
        self.inner_source: Any = None  # the inner source that `source` wraps
        self.source: list | None = None  # [key, inner_source]: this slot's elements' provenance source

    def wrap(self, inner: tuple[Any, int] | None) -> tuple[list, int] | None:
        """The interleave's provenance of an element whose inner provenance is `inner`; one source
        object per inner source, so a saved buffer names each file once."""
        if inner is None:
            return None
        source, locator = inner
        if self.source is None or self.inner_source is not source:
            if self.key is None:
                self.key = to_json(self.element)
            self.inner_source, self.source = source, [self.key, source]
        return self.source, locator

    def state(self) -> dict[str, Any]:
        # A queued error is not saved: the resumed inner iterator retries the failing call.
        items = [(v, p) for kind, v, p in self.buffer if kind == _ITEM]
        if items and all(p is not None for _, p in items):
            buffer = provenance.encode([p for _, p in items])
        else:
            buffer = [to_json(v) for v, _ in items]
        return {
            "element": to_json(self.element),
            "index": self.index,
            "inner": None if self.done else self.inner.get_state(),
            "buffer": buffer,
            "done": self.done,
        }

    def close(self) -> None:
        inner, self.inner = self.inner, None
        if inner is not None:
            inner.close()


class _InterleaveBase(Iter):
    def __init__(self, node: InterleaveNode, ctx: Context):
        super().__init__(node.name, ctx, node.inputs[0].iterator(ctx.child(0)))
        self._input = self.inputs[0]
        self._input_node = node.inputs[0]
        self._node = node
        self._ctx = ctx
        self._map_func = node.map_func
        self._tracking = False
        self._provenance: tuple[list, int] | None = None  # of the element the last `next` returned
        self._cycle = _resolve(node.cycle_length)
        self._node_cycle = None if node.cycle_length in (None, AUTOTUNE) else node.cycle_length
        self._block = node.block_length
        self._slots: list[_Slot | None] = [None] * self._cycle
        self._ci = 0  # slot whose turn it is
        self._bi = 0  # elements taken from it in the current block
        self._num_open = 0
        self._num_opened = 0  # input elements consumed so far (names each inner iterator's context)
        self._end_of_input = False
        self.stats.extra["cycle_length"] = self._cycle

    # ---- opening slots

    def _make_inner(self, element: Any, index: int) -> Iter:
        node = self._node.dataset_of(element)
        # Inner iterators come and go (one per input element): give each its own statistics list
        # so that a long run over many files does not grow the pipeline's list without bound.
        ctx = dataclasses.replace(self._ctx.child(1).child(index), stats={})
        inner = node.iterator(ctx)
        if self._tracking:
            inner.enable_provenance()  # an inner dataset that cannot leaves its elements without one
        return inner

    def enable_provenance(self) -> bool:
        self._tracking = True
        return True

    def provenance(self) -> tuple[list, int] | None:
        return self._provenance

    def _open_next(self) -> _Slot | None:
        """Consume one input element and open its dataset; None at the end of the input."""
        try:
            element = next(self._input)
        except StopIteration:
            self._end_of_input = True
            return None
        index = self._num_opened
        self._num_opened += 1
        return _Slot(element, index, self._make_inner(element, index))

    def _advance(self) -> None:
        self._bi = 0
        self._ci = (self._ci + 1) % self._cycle

    def _after_emit(self) -> None:
        self._bi += 1
        if self._bi == self._block:
            self._advance()

    # ---- state

    def _common_state(self, slots: list[dict | None]) -> dict[str, Any]:
        return {
            "input": None if self._end_of_input else self._input.get_state(),
            "cycle_length": self._cycle,
            "ci": self._ci,
            "bi": self._bi,
            "num_opened": self._num_opened,
            "slots": slots,
        }

    _read_ahead = 0  # elements a slot may hold read ahead (in its state's "buffer")

    def set_state(self, state: StateField) -> None:
        state.fields(("input", "cycle_length", "ci", "bi", "num_opened", "slots"))
        # The saved cycle length wins over this machine's core count (AUTOTUNE), so the resumed
        # stream continues in the same order.
        cycle = state["cycle_length"].as_int(1, None if self._node_cycle is None else self._node_cycle)
        slot_fields = state["slots"].as_list(length=cycle)
        ci, bi = state["ci"].as_int(0, cycle - 1), state["bi"].as_int(0, self._block - 1)
        num_opened = state["num_opened"].as_int(0)
        if state["input"].is_none():
            self._end_of_input = True
        else:
            self._input.set_state(state["input"])
        self._cycle, self._ci, self._bi, self._num_opened = cycle, ci, bi, num_opened
        self.stats.extra["cycle_length"] = cycle
        known = self._input_node.known_elements()
        self._slots = [None if s.is_none() else self._restore_slot(s, known) for s in slot_fields]
        self._num_open = sum(s is not None for s in self._slots)

    def _restore_slot(self, s: StateField, known: frozenset | None) -> _Slot:
        s.fields(("element", "index", "inner", "buffer", "done"))
        element = s["element"].as_element(known)  # checked before map_func sees it
        index = s["index"].as_int(0, self._num_opened - 1)
        done = s["done"].as_bool()
        if done and not self._read_ahead:
            raise s["done"].error("expected false: a sequential interleave closes a slot as soon as it ends")
        buffer, provenances = self._restore_buffer(s["buffer"], element)
        slot = _Slot(element, index, None)
        if done:
            if not s["inner"].is_none():
                raise s["inner"].error("expected null for a slot whose dataset ended")
        else:
            slot.inner = self._make_inner(element, index)
            slot.inner.set_state(s["inner"])
        slot.buffer.extend((_ITEM, v, p) for v, p in zip(buffer, provenances, strict=True))
        if done:
            slot.done = True
            slot.buffer.append((_END, None, None))
        return slot

    def _restore_buffer(self, field: StateField, element: Any) -> tuple[list, list]:
        """A slot's read-ahead elements and their inner provenances (None when saved as elements)."""
        if not provenance.is_encoded(field):
            elements = field.as_elements(max_len=self._read_ahead)
            return elements, [None] * len(elements)
        if not (self._tracking and self._read_ahead):
            raise provenance.refused(field)
        return provenance.decode(field, self._node.dataset_of(element), max_len=self._read_ahead)

    def close(self) -> None:
        slots, self._slots = self._slots, [None] * self._cycle
        for slot in slots:
            if slot is not None:
                slot.close()
        super().close()


class SequentialInterleaveIter(_InterleaveBase):
    """tf.data's sequential interleave kernel, line for line (docs/tfdata-semantics.md §6)."""

    def _next(self):
        slots = self._slots
        while not self._end_of_input or self._num_open > 0:
            slot = slots[self._ci]
            if slot is not None:
                try:
                    x = next(slot.inner)
                except StopIteration:
                    pass
                else:
                    if self._tracking:
                        self._provenance = slot.wrap(slot.inner.provenance())
                    self._after_emit()
                    return x
                slot.close()
                slots[self._ci] = None
                self._num_open -= 1
                self._advance()  # move on; the slot is refilled when the cycle comes back
            elif not self._end_of_input:
                slot = self._open_next()
                if slot is not None:
                    slots[self._ci] = slot
                    self._num_open += 1
            else:
                self._advance()
        raise StopIteration

    def get_state(self) -> dict[str, Any]:
        return self._common_state([None if s is None else s.state() for s in self._slots])


class ParallelInterleaveIter(_InterleaveBase):
    """Reader threads fill per-slot buffers; the consumer runs the sequential algorithm on them.

    Locking: one lock guards every slot's `buffer`/`busy`/`done`/`error_pending` and the slot
    list. A reader claims a slot (`busy`) under the lock and calls `next(inner)` outside it, so no
    two threads ever touch one inner iterator. Every wait is a timed wait that re-checks the stop
    flag, so `close()` never hangs on a reader that is idle.
    """

    def __init__(self, node: InterleaveNode, ctx: Context):
        super().__init__(node, ctx)
        self._deterministic = node.deterministic is not False
        # AUTOTUNE starts one reader and adds one (up to a core each, at most one per slot) whenever
        # the consumer has had to wait for data `_GROW_AFTER` times: reading TFRecords is usually
        # far faster than what follows it, and idle reader threads still cost GIL switches.
        self._threads_max = max(1, min(_resolve(node.num_parallel_calls), self._cycle))
        self._autotune = node.num_parallel_calls == AUTOTUNE
        self._threads_wanted = 1 if self._autotune else self._threads_max
        self._consumer_waits = 0
        self._capacity = max(2 * self._block, _MIN_READ_AHEAD)  # per slot, in elements
        self._read_ahead = self._capacity
        self._lock = threading.Lock()
        self._data_ready = threading.Condition(self._lock)  # consumer / snapshot wait here
        self._space_ready = threading.Condition(self._lock)  # readers wait here
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self._paused = False
        self._fatal: BaseException | None = None
        self._consumer_waits_for: object = None  # a slot, _ANY_SLOT, or None
        self.stats.extra["num_parallel_calls"] = self._threads_wanted
        self.stats.extra["max_parallel_calls"] = self._threads_max

    # ---- reader threads

    def _start(self) -> None:
        for _ in range(self._threads_wanted):
            self._add_reader()

    def _add_reader(self) -> None:
        t = threading.Thread(target=self._reader, name=f"conveyor-interleave-{id(self):x}-{len(self._threads)}",
                             daemon=True)
        self._threads.append(t)
        t.start()
        self.stats.extra["num_parallel_calls"] = len(self._threads)

    def _consumer_waited(self) -> None:
        """Called with the lock held each time the consumer finds no data: AUTOTUNE's measure."""
        self._consumer_waits += 1
        self.stats.extra["consumer_waits"] = self._consumer_waits
        if self._autotune and len(self._threads) < self._threads_max and self._consumer_waits % _GROW_AFTER == 0:
            self._add_reader()

    def _pick(self) -> _Slot | None:
        """The slot most in need of reading: the one whose turn it is first, then in cycle order."""
        slots, n, cap = self._slots, self._cycle, self._capacity
        for k in range(n):
            slot = slots[(self._ci + k) % n]
            if (slot is not None and not slot.busy and not slot.done and not slot.error_pending
                    and slot.inner is not None and len(slot.buffer) < cap):
                return slot
        return None

    def _reader(self) -> None:
        try:
            while True:
                with self._lock:
                    while True:
                        if self._stopping:
                            return
                        slot = None if self._paused else self._pick()
                        if slot is not None:
                            break
                        self._space_ready.wait(_WAIT)
                    slot.busy = True
                    room = self._capacity - len(slot.buffer)
                # Read a few elements per claim (not one): fewer lock round trips and thread switches.
                inner = slot.inner
                tracking = self._tracking
                got: list = []
                kind = _ITEM
                try:
                    for _ in range(min(room, _READ_BATCH)):
                        x = next(inner)
                        got.append((_ITEM, x, inner.provenance() if tracking else None))
                        # Hand over early when someone waits: the consumer (for this slot, or
                        # for any slot when not deterministic), get_state, or close.
                        waiting = self._consumer_waits_for
                        if (waiting is slot or waiting is _ANY_SLOT or self._paused
                                or self._stopping):
                            break
                except StopIteration:
                    kind = _END
                    got.append((_END, None, None))
                    inner.close()  # release files as soon as a dataset ends
                except Exception as e:
                    kind = _ERROR
                    got.append((_ERROR, e, None))
                with self._lock:
                    slot.busy = False
                    if slot.orphaned:
                        slot.close()
                        return
                    slot.buffer.extend(got)
                    if kind == _END:
                        slot.done = True
                        slot.inner = None
                    elif kind == _ERROR:
                        slot.error_pending = True
                    self._data_ready.notify_all()
        except BaseException as e:  # a bug here must not leave the consumer waiting forever
            with self._lock:
                self._fatal = e
                self._data_ready.notify_all()

    # ---- consumer

    def _take(self) -> tuple[int, Any, Any]:
        """Wait for the next entry of the slot whose turn it is (or, when not deterministic, of any
        slot with one ready, making it the current slot)."""
        while True:
            need_open = -1
            with self._lock:
                if self._fatal is not None:
                    raise RuntimeError("interleave reader thread failed") from self._fatal
                slot = self._slots[self._ci]
                if slot.buffer:
                    return self._pop(slot)
                if not self._deterministic:
                    n = self._cycle
                    for k in range(1, n):
                        j = (self._ci + k) % n
                        other = self._slots[j]
                        if other is not None and other.buffer:
                            self._ci, self._bi = j, 0
                            return self._pop(other)
                    if not self._end_of_input:  # open empty slots early so they start reading
                        need_open = next((j for j in range(n) if self._slots[j] is None), -1)
                if need_open < 0:
                    self._consumer_waited()
                    self._consumer_waits_for = slot if self._deterministic else _ANY_SLOT
                    self._data_ready.wait(_WAIT)
                    self._consumer_waits_for = None
                    continue
            new = self._open_next()  # outside the lock: the input and map_func may be slow
            if new is not None:
                self._install(need_open, new)

    def _pop(self, slot: _Slot) -> tuple[int, Any, Any]:
        entry = slot.buffer.popleft()
        kind = entry[0]
        if kind == _ERROR:
            slot.error_pending = False  # the reader may retry the failing call, as sequential would
            self._space_ready.notify()
        elif len(slot.buffer) == self._capacity // 2:  # wake a reader once the buffer is half empty
            self._space_ready.notify()
        return entry

    def _install(self, j: int, slot: _Slot) -> None:
        with self._lock:
            self._slots[j] = slot
            self._num_open += 1
            self._space_ready.notify()

    def _next(self):
        if self._stopping:
            raise StopIteration  # closed
        if not self._threads:
            self._start()
        while not self._end_of_input or self._num_open > 0:
            slot = self._slots[self._ci]
            if slot is not None:
                kind, value, inner = self._take()
                if kind == _ITEM:
                    if self._tracking:  # _take may have moved the turn to another slot
                        self._provenance = self._slots[self._ci].wrap(inner)
                    self._after_emit()
                    return value
                if kind == _ERROR:
                    raise value  # the inner dataset's own exception, with its traceback
                with self._lock:
                    self._slots[self._ci] = None
                self._num_open -= 1
                self._advance()
            elif not self._end_of_input:
                new = self._open_next()
                if new is not None:
                    self._install(self._ci, new)
            else:
                self._advance()
        raise StopIteration

    def get_state(self) -> dict[str, Any]:
        with self._lock:
            self._paused = True
            try:
                while any(s is not None and s.busy for s in self._slots):
                    if self._fatal is not None:
                        raise RuntimeError("interleave reader thread failed") from self._fatal
                    self._data_ready.wait(_WAIT)
                slots = [None if s is None else s.state() for s in self._slots]
            finally:
                self._paused = False
                self._space_ready.notify_all()
        return self._common_state(slots)

    def close(self) -> None:
        with self._lock:
            self._stopping = True
            self._space_ready.notify_all()
            self._data_ready.notify_all()
        for t in self._threads:
            t.join(_JOIN_TIMEOUT)
        self._threads = []
        with self._lock:
            for slot in self._slots:
                if slot is not None and slot.busy:  # stuck in next(): its reader closes it on return
                    slot.orphaned = True
            self._slots = [None if s is None or s.busy else s for s in self._slots]
        super().close()
