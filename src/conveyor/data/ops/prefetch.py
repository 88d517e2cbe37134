"""`prefetch(buffer_size)`: run the input ahead in a background thread.

tf.data semantics: up to `buffer_size` elements (whatever an element is — `batch(20).prefetch(2)`
holds two batches) are prepared while the consumer works; order unchanged. With AUTOTUNE the
buffer starts at 2 and grows by one each time the consumer finds it empty, up to
`AUTOTUNE_MAX_BUFFER`: a pipeline that keeps up stays small, one with bursty stages gets slack.

State: the input's position plus the elements already buffered (they are part of the stream the
consumer has not seen yet). The producer is paused while the state is taken.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from conveyor.data.base import AUTOTUNE, Context, Iter, Node, StateField
from conveyor.data.elements import to_json
from conveyor.data.errors import InvalidArgumentError

AUTOTUNE_INITIAL_BUFFER = 2
AUTOTUNE_MAX_BUFFER = 8
_TICK = 0.5  # seconds: the longest any wait lasts before re-checking for stop or failure


class PrefetchNode(Node):
    name = "prefetch"
    keeps_elements = True

    def __init__(self, input: Node, buffer_size: int):
        super().__init__(input)
        if buffer_size != AUTOTUNE and (not isinstance(buffer_size, int) or buffer_size < 0):
            raise InvalidArgumentError(f"prefetch buffer_size must be >= 0 or AUTOTUNE, got {buffer_size!r}")
        self.buffer_size = buffer_size

    def params(self) -> dict[str, Any]:
        return {"buffer_size": self.buffer_size}

    def iterator(self, ctx: Context) -> Iter:
        return PrefetchIter(self, ctx, self.inputs[0].iterator(ctx.child(0)))


class PrefetchIter(Iter):
    def __init__(self, node: PrefetchNode, ctx: Context, source: Iter):
        super().__init__("prefetch", ctx, source)
        self._source = source
        self._input_node = node.inputs[0]
        self._autotune = node.buffer_size == AUTOTUNE
        self._capacity = AUTOTUNE_INITIAL_BUFFER if self._autotune else node.buffer_size
        self._buffer: deque = deque()
        self._done = False
        self._error: BaseException | None = None
        self._stop = False
        self._input_lock = threading.Lock()  # held while the input advances; get_state takes it
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self.stats.extra.update(buffer_size=self._capacity, consumer_found_empty=0)

    # ---- producer

    def _produce(self) -> None:
        while True:
            with self._cond:
                while len(self._buffer) >= self._capacity and not self._stop:
                    self._cond.wait(_TICK)
                if self._stop:
                    return
            with self._input_lock:
                t0 = time.perf_counter()
                try:
                    x = next(self._source)
                except StopIteration:
                    x, done, error = None, True, None
                except BaseException as exc:  # hand every failure to the consumer
                    x, done, error = None, True, exc
                else:
                    done, error = False, None
                self.stats.busy_seconds += time.perf_counter() - t0
                with self._cond:  # inside the input lock: a state never misses an element
                    if done:
                        self._done, self._error = True, error
                    else:
                        self._buffer.append(x)
                    self._cond.notify_all()
            if done:
                return

    # ---- consumer

    def _next(self):
        if self._capacity == 0:  # prefetch(0) is a pass-through
            return next(self._source)
        if self._thread is None and not self._done:
            self._thread = threading.Thread(target=self._produce, name="conveyor-prefetch", daemon=True)
            self._thread.start()
        with self._cond:
            if not self._buffer and not self._done:
                self.stats.extra["consumer_found_empty"] += 1
                if self._autotune and self._capacity < AUTOTUNE_MAX_BUFFER:
                    self._capacity += 1
                    self.stats.extra["buffer_size"] = self._capacity
                    self._cond.notify_all()
            while not self._buffer and not self._done:
                self._cond.wait(_TICK)
                if self._thread is not None and not self._thread.is_alive() and not self._buffer and not self._done:
                    raise RuntimeError("the prefetch thread stopped without reporting why")
            if self._buffer:
                x = self._buffer.popleft()
                self._cond.notify_all()
                return x
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            raise StopIteration

    # ---- state

    def get_state(self) -> dict[str, Any]:
        with self._input_lock, self._cond:
            return {"input": self._source.get_state(), "done": self._done and self._error is None,
                    "buffer": [to_json(x) for x in self._buffer], "capacity": self._capacity}

    def set_state(self, state: StateField) -> None:
        state.fields(("input", "done", "buffer"), optional=("capacity",))
        capacity = self._capacity
        saved = state.get("capacity")  # absent in states of older releases
        if saved is not None and self._autotune:
            capacity = saved.as_int(AUTOTUNE_INITIAL_BUFFER, AUTOTUNE_MAX_BUFFER)
        elif saved is not None:
            saved.as_int(0)
        # the producer stops at `capacity` elements, so a state never holds more
        buffer = state["buffer"].as_elements(max_len=capacity, known=self._input_node.known_elements())
        done = state["done"].as_bool()
        self._source.set_state(state["input"])
        self._buffer.extend(buffer)
        self._done = done
        self._capacity = capacity

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            # The producer may be inside the input's next(): close the input first so it returns.
            super().close()
            thread.join(timeout=5.0)
            return
        super().close()
