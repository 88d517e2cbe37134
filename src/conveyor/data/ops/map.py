"""`map(map_func, num_parallel_calls=None, deterministic=None)`: apply a function to every element.

tf.data semantics: output in input order unless `deterministic=False`; cardinality preserved;
`num_parallel_calls` is a number or AUTOTUNE (then: one call per core). Three ways to run it:

- sequentially, in the consumer's thread (no `num_parallel_calls`);
- in threads (`use_processes=False`), for functions that release the GIL;
- in forked worker processes (the default when parallel), which run Python code on every core.
  The input is cut into chunks; each chunk is one task for a worker. When a batch follows, the
  pipeline fuses the two (`MapBatchNode`): a chunk is one batch, stacked by the worker and
  handed over in shared memory, so the consumer does no per-record work at all.

In worker processes the global RNGs of `random`, numpy and torch are reseeded for every chunk
from the pipeline's seed and the chunk's number: random augmentations are reproducible and a
resumed iterator produces exactly the elements the uninterrupted one would have.

State: the input's position plus the inputs of every chunk that is in flight, so a resumed
iterator recomputes them.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

from conveyor.data.base import AUTOTUNE, Context, Iter, Node, StateField, UnaryIter, call, cpu_budget, describe_fn
from conveyor.data.elements import to_json
from conveyor.data.errors import InvalidArgumentError
from conveyor.data.workers import TASKS_PER_WORKER, WorkerPool

# Elements per task when map is not fused with batch: large enough to amortise the pipe round
# trip, small enough to keep both cores busy. Fixed, because chunk numbers seed the RNGs.
LIST_CHUNK = 16


def _parallelism(num_parallel_calls: int | None) -> int | None:
    if num_parallel_calls is None:
        return None
    if num_parallel_calls == AUTOTUNE:
        return cpu_budget()
    if not isinstance(num_parallel_calls, int) or num_parallel_calls < 1:
        raise InvalidArgumentError(
            f"num_parallel_calls must be a positive int or AUTOTUNE, got {num_parallel_calls!r}")
    return num_parallel_calls


class MapNode(Node):
    name = "map"

    def __init__(self, input: Node, map_func: Callable, num_parallel_calls: int | None,
                 deterministic: bool | None, use_processes: bool | None):
        super().__init__(input)
        if not callable(map_func):
            raise TypeError(f"map_func must be callable, got {type(map_func).__name__}")
        self.map_func = map_func
        self.num_parallel_calls = num_parallel_calls
        self.parallelism = _parallelism(num_parallel_calls)
        self.deterministic = deterministic is not False
        can_fork = sys.platform != "win32"
        self.use_processes = bool(self.parallelism) and (can_fork if use_processes is None else use_processes)

    def params(self) -> dict[str, Any]:
        return {"fn": describe_fn(self.map_func), "num_parallel_calls": self.num_parallel_calls,
                "deterministic": self.deterministic, "processes": self.use_processes}

    def fusable(self) -> bool:
        return self.use_processes

    def iterator(self, ctx: Context) -> Iter:
        source = self.inputs[0].iterator(ctx.child(0))
        if not self.parallelism:
            return SequentialMapIter(self, ctx, source)
        if self.use_processes:
            return ProcessMapIter(ctx, source, self.map_func, self.parallelism, self.deterministic,
                                  chunk_size=LIST_CHUNK, batch_mode=False, drop_remainder=False,
                                  input_node=self.inputs[0])
        return ThreadMapIter(self, ctx, source)


class MapBatchNode(Node):
    """`map(f, num_parallel_calls=...)` followed by `batch(n)`, run as one op (a pipeline rewrite)."""

    name = "map_batch"

    def __init__(self, map_node: MapNode, batch_size: int, drop_remainder: bool):
        super().__init__(*map_node.inputs)
        self.map_node = map_node
        self.batch_size = batch_size
        self.drop_remainder = drop_remainder

    def params(self) -> dict[str, Any]:
        return {**self.map_node.params(), "batch_size": self.batch_size, "drop_remainder": self.drop_remainder}

    def iterator(self, ctx: Context) -> Iter:
        m = self.map_node
        # ctx.child(0).child(0): the input sits where it would under batch(map(...)), so random ops
        # upstream draw the same numbers whether or not the pipeline was fused.
        return ProcessMapIter(ctx, self.inputs[0].iterator(ctx.child(0).child(0)), m.map_func, m.parallelism,
                              m.deterministic, chunk_size=self.batch_size, batch_mode=True,
                              drop_remainder=self.drop_remainder, input_node=self.inputs[0])


class SequentialMapIter(UnaryIter):
    def __init__(self, node: MapNode, ctx: Context, source: Iter):
        super().__init__("map", ctx, source)
        self._fn = node.map_func

    def _next(self):
        return call(self._fn, next(self._input))

    def _load_extra_state(self, state: StateField) -> None:
        if state["input"].is_none():  # it never drops its input, so its own states never say so
            raise state["input"].error("expected the input's state (a sequential map never finishes its input)")


class ThreadMapIter(Iter):
    """Parallel map in a thread pool: for functions that release the GIL (I/O, decoders, numpy)."""

    def __init__(self, node: MapNode, ctx: Context, source: Iter):
        super().__init__("map[threads]", ctx, source)
        self._fn = node.map_func
        self._source = source
        self._input_node = node.inputs[0]
        self._n = node.parallelism
        self._deterministic = node.deterministic
        self._pending: deque = deque()  # (input element, future), in input order
        self._restored: list = []  # input elements in flight when the restored state was saved
        self._input_done = False
        self._pool: ThreadPoolExecutor | None = None
        self.stats.extra["threads"] = self._n

    def _submit(self, x) -> None:
        self._pending.append((x, self._pool.submit(call, self._fn, x)))

    def _fill(self) -> None:
        while not self._input_done and len(self._pending) < 2 * self._n:
            try:
                x = next(self._source)
            except StopIteration:
                self._input_done = True
                break
            self._submit(x)

    def _next(self):
        if self._pool is None:
            self._start()
        self._fill()
        if not self._pending:
            raise StopIteration
        if self._deterministic:
            _, fut = self._pending[0]
        else:
            while True:  # bounded waits, so Ctrl-C is seen
                done, _ = wait_futures([f for _, f in self._pending], timeout=1.0, return_when=FIRST_COMPLETED)
                if done:
                    break
            fut = next(f for _, f in self._pending if f in done)
        while True:
            try:
                result = fut.result(timeout=1.0)
                break
            except TimeoutError:
                continue
        self._pending = deque(p for p in self._pending if p[1] is not fut)
        return result

    def get_state(self) -> dict[str, Any]:
        return {"input": self._source.get_state(), "input_done": self._input_done,
                "pending": [to_json(x) for x, _ in self._pending]}

    def set_state(self, state: StateField) -> None:
        state.fields(("input", "input_done", "pending"))
        input_done = state["input_done"].as_bool()
        # at most 2 * threads are in flight; the thread count (AUTOTUNE) may differ on this machine
        pending = state["pending"].as_elements(known=self._input_node.known_elements())
        self._source.set_state(state["input"])
        self._input_done = input_done
        self._restored = pending

    def _start(self) -> None:
        """The pool starts on the first `next`; elements that were in flight go first."""
        self._pool = ThreadPoolExecutor(self._n, thread_name_prefix="conveyor-map")
        for x in self._restored:
            self._submit(x)
        self._restored = []

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        super().close()


class ProcessMapIter(Iter):
    """Chunks of the input mapped in worker processes; a chunk's result is a list of elements, or
    one stacked batch in `batch_mode`."""

    def __init__(self, ctx: Context, source: Iter, fn: Callable, num_workers: int, deterministic: bool,
                 chunk_size: int, batch_mode: bool, drop_remainder: bool, input_node: Node):
        super().__init__("map_batch[processes]" if batch_mode else "map[processes]", ctx, source)
        if chunk_size < 1:
            raise InvalidArgumentError(f"batch_size must be at least 1, got {chunk_size}")
        self._source = source
        self._input_node = input_node
        self._fn = fn
        self._num_workers = num_workers
        self._deterministic = deterministic
        self._chunk_size = chunk_size
        self._batch_mode = batch_mode
        self._drop_remainder = drop_remainder
        self._seed = [ctx.root_seed, ctx.iteration, len(ctx.path), *ctx.path, len(ctx.epochs), *ctx.epochs]
        self._pool: WorkerPool | None = None
        self._next_task = 0
        self._input_done = False
        self._chunks: dict[int, list] = {}     # task id -> its input elements, until fully returned
        self._unsent: deque[int] = deque()     # task ids waiting for room in a worker
        self._results: dict[int, Any] = {}     # finished, not yet returned
        self._current: list | None = None       # list mode: outputs of the chunk being returned
        self._current_task = -1
        self._pos = 0
        self._resume_skip: tuple[int, int] | None = None
        self.stats.extra.update(workers=num_workers, chunk_size=chunk_size)

    # ---- feeding the workers

    def _start(self) -> None:
        self._pool = WorkerPool(self._fn, self._num_workers, self._batch_mode, self._seed, name="map")
        self._unsent.extend(sorted(self._chunks))  # resumed in-flight work goes out first, in order

    def _fill(self) -> None:
        """Keep every worker busy: send waiting chunks, then cut new ones from the input."""
        while self._unsent and self._pool.has_room():
            task_id = self._unsent.popleft()
            self._pool.submit(task_id, self._chunks[task_id])
        # Bound the chunks not yet returned too, not just those running: in order, finished chunks
        # wait for a slower one ahead of them, and must not pile up behind it without limit.
        limit = (TASKS_PER_WORKER + 1) * self._num_workers
        while not self._input_done and self._pool.has_room() and len(self._chunks) < limit:
            chunk = []
            try:
                for _ in range(self._chunk_size):
                    chunk.append(next(self._source))
            except StopIteration:
                self._input_done = True
                if not chunk or (self._batch_mode and self._drop_remainder):
                    break
            task_id = self._next_task
            self._next_task += 1
            self._chunks[task_id] = chunk
            self._pool.submit(task_id, chunk)

    def _collect(self) -> tuple[int, Any]:
        """The next finished chunk to return: the oldest one, or any ready one when not deterministic."""
        while True:
            if not self._chunks:
                raise StopIteration
            if self._deterministic:
                want = min(self._chunks)
                if want in self._results:
                    return want, self._results.pop(want)
            elif self._results:
                task_id = min(self._results)
                return task_id, self._results.pop(task_id)
            if self._receive_one():
                self._fill()

    def _receive_one(self) -> bool:
        got = self._pool.receive(timeout=1.0)
        if got is None:
            return False
        task_id, result, busy = got
        self._results[task_id] = result
        self.stats.busy_seconds += busy
        return True

    # ---- iteration

    def _next(self):
        if self._pool is None:
            self._start()
            if self._resume_skip is not None:
                tid, skip = self._resume_skip
                self._resume_skip = None
                while tid not in self._results:
                    self._fill()
                    self._receive_one()
                self._current, self._current_task, self._pos = self._results.pop(tid), tid, skip
        if not self._batch_mode and self._current is not None and self._pos < len(self._current):
            x = self._current[self._pos]
            self._pos += 1
            if self._pos == len(self._current):
                self._chunks.pop(self._current_task, None)
            return x
        self._fill()
        t0 = time.perf_counter()
        task_id, result = self._collect()
        self.stats.extra["wait_seconds"] = self.stats.extra.get("wait_seconds", 0.0) + time.perf_counter() - t0
        if self._batch_mode:
            self._chunks.pop(task_id)
            self._fill()
            return result
        self._current, self._current_task, self._pos = result, task_id, 0
        return self._next()

    # ---- state

    def get_state(self) -> dict[str, Any]:
        skip = {self._current_task: self._pos} if self._current is not None and self._pos < len(self._current) else {}
        return {
            "input": self._source.get_state(),
            "input_done": self._input_done,
            "next_task": self._next_task,
            "chunks": [[tid, [to_json(x) for x in self._chunks[tid]], skip.get(tid, 0)]
                       for tid in sorted(self._chunks)],
        }

    def set_state(self, state: StateField) -> None:
        state.fields(("input", "input_done", "next_task", "chunks"))
        input_done = state["input_done"].as_bool()
        next_task = state["next_task"].as_int(0, 2**63 - 1)  # sent to workers as 8 bytes
        known = self._input_node.known_elements()
        chunks, resume_skip = {}, None
        for chunk in state["chunks"].as_list():
            tid_f, xs_f, skip_f = chunk.as_list(length=3)
            tid = tid_f.as_int(0, next_task - 1)
            if tid in chunks:
                raise tid_f.error(f"chunk {tid} appears twice")
            chunks[tid] = xs_f.as_elements(max_len=self._chunk_size, known=known)
            if not chunks[tid]:
                raise xs_f.error("expected at least one element (chunks are never empty)")
            # only a list-mode chunk is returned piecemeal, and only one at a time
            skip = skip_f.as_int(0, 0 if self._batch_mode or resume_skip else len(chunks[tid]) - 1)
            if skip:  # a chunk that was partly returned: recompute it, drop what was returned
                resume_skip = (tid, skip)
        self._source.set_state(state["input"])
        self._input_done, self._next_task = input_done, next_task
        self._chunks, self._resume_skip = chunks, resume_skip

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        super().close()
