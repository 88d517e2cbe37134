"""The two halves of every dataset op: a stateless recipe and a resumable iterator.

A `Node` is an immutable description ("read these files", "map this function over that input").
`Node.iterator(ctx)` builds an `Iter`, the stateful half, which yields elements and can save and
restore its position with `get_state()` / `set_state()`. Each op in `ops/` and `sources/` is one
such pair. `DatasetIterator` is what `iter(dataset)` returns: it owns the tree of `Iter`s, times
the consumer's waits, and wraps the tree's state with a version and a fingerprint of the pipeline
so that a state is never loaded into a different pipeline.

Contract for op authors:
- `Iter.set_state` is only ever called on a freshly built iterator, before its first `next`.
- Background work (threads, processes) starts lazily, on the first `next`, and stops in `close`.
- `get_state` is called from the consumer's thread between two `next` calls and must describe
  exactly the elements not yet returned: work that is in flight is part of the state.
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from conveyor.data.errors import StateMismatchError

AUTOTUNE = -1
STATE_FORMAT = "conveyor.data.iterator"
STATE_VERSION = 1


def cpu_budget() -> int:
    """Cores this process may run on (what AUTOTUNE divides)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def describe_fn(fn: Callable) -> str:
    """A stable name for a user function, for pipeline fingerprints (not its identity)."""
    return getattr(fn, "__qualname__", None) or type(fn).__name__


@dataclass(frozen=True)
class Context:
    """What an iterator needs to know about where it sits.

    `path` is the iterator's position in the pipeline tree (and, for datasets that an interleave
    creates, which input element made them); `epochs` lists the repetition counters of the
    enclosing `repeat`s. Random ops derive their seeds from both, so a rebuilt iterator draws the
    same numbers as the original one.
    """

    root_seed: int
    iteration: int
    path: tuple[int, ...] = ()
    epochs: tuple[int, ...] = ()
    stats: dict = field(default_factory=dict, compare=False, repr=False)

    def child(self, index: int = 0) -> Context:
        return Context(self.root_seed, self.iteration, self.path + (index,), self.epochs, self.stats)

    def with_epoch(self, epoch: int) -> Context:
        return Context(self.root_seed, self.iteration, self.path, self.epochs + (epoch,), self.stats)

    def rng(self, seed: int | None, reshuffle_each_iteration: bool) -> np.random.Generator:
        """A generator for a random op at this position.

        With `reshuffle_each_iteration` the stream also depends on which iteration of the dataset
        and which epoch of every enclosing `repeat` this is, as in tf.data.
        """
        # An op seed stands alone (as in tf.data, equal seeds give equal streams); without one the
        # stream comes from the dataset's seed and the op's position in the pipeline.
        entropy = [seed, 0] if seed is not None else [self.root_seed, len(self.path), *self.path]
        if reshuffle_each_iteration:
            entropy += [self.iteration, len(self.epochs), *self.epochs]
        return np.random.Generator(np.random.PCG64(np.random.SeedSequence([e & 0xFFFFFFFF for e in entropy])))


class StageStats:
    """Counters one stage keeps: how many elements it produced and the time it spent working."""

    __slots__ = ("name", "elements", "busy_seconds", "started", "extra")

    def __init__(self, name: str):
        self.name = name
        self.elements = 0
        self.busy_seconds = 0.0
        self.started = time.perf_counter()
        self.extra: dict[str, Any] = {}

    def as_dict(self) -> dict[str, Any]:
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        out = {"stage": self.name, "elements": self.elements, "elements_per_second": self.elements / elapsed}
        if self.busy_seconds:
            out["busy_seconds"] = self.busy_seconds
        out.update(self.extra)
        return out


class Iter:
    """The stateful half of an op. Subclasses implement `_next`, `get_state`, `set_state`."""

    def __init__(self, name: str, ctx: Context, *inputs: Iter):
        # One entry per stage and position: the iterators a repeat rebuilds every epoch keep
        # counting where the previous epoch's left off.
        self.stats = ctx.stats.get((name, ctx.path))
        if self.stats is None:
            self.stats = ctx.stats[(name, ctx.path)] = StageStats(name)
        self.inputs: list[Iter] = list(inputs)

    def __iter__(self):
        return self

    def __next__(self):
        x = self._next()  # raises StopIteration at the end
        self.stats.elements += 1
        return x

    def _next(self):
        raise NotImplementedError

    def get_state(self) -> dict[str, Any]:
        raise NotImplementedError

    def set_state(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Stop background work, then close the inputs. Safe to call twice."""
        for it in self.inputs:
            it.close()


class UnaryIter(Iter):
    """An op with one input, which it closes and drops once it is "finished" (exhausted, or done).

    State: the op's own fields (`_extra_state`) followed by the input's state under "input", which
    is None once finished. `set_state` loads the op's fields first (`_load_extra_state`, which may
    validate them or call `_finish()` itself), then finishes the input or restores it.
    """

    def __init__(self, name: str, ctx: Context, source: Iter | None):
        super().__init__(name, ctx, *(() if source is None else (source,)))
        self._input: Iter | None = source

    def _finish(self) -> None:
        if self._input is not None:
            self._input.close()  # stays in `inputs`: closing twice is safe
            self._input = None

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        pass

    def get_state(self) -> dict[str, Any]:
        return {**self._extra_state(), "input": None if self._input is None else self._input.get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        self._load_extra_state(state)
        if state["input"] is None or self._input is None:
            self._finish()
        else:
            self._input.set_state(state["input"])


class Node:
    """The stateless half of an op: a recipe that builds `Iter`s.

    `name` and `params` make up the pipeline fingerprint; `inputs` are the upstream nodes.
    """

    name: str = "node"

    def __init__(self, *inputs: Node):
        self.inputs: tuple[Node, ...] = inputs

    def params(self) -> dict[str, Any]:
        return {}

    def iterator(self, ctx: Context) -> Iter:
        raise NotImplementedError

    def with_inputs(self, inputs: tuple[Node, ...]) -> Node:
        """A copy of this recipe reading from other inputs (used by pipeline rewrites)."""
        clone = copy.copy(self)
        clone.inputs = tuple(inputs)
        return clone

    def fingerprint(self) -> list:
        """A JSON-able description of this pipeline, compared when a saved state is loaded."""
        return [self.name, self.params(), [n.fingerprint() for n in self.inputs]]


class DatasetIterator:
    """What `iter(dataset)` returns: elements, statistics and a resumable state.

    `state_dict()` is JSON-serialisable; `load_state_dict()` continues exactly where the saved
    iterator was, and refuses a state saved from a different pipeline.
    """

    def __init__(self, node: Node, root_seed: int, iteration: int):
        self._node = node
        self._fingerprint = node.fingerprint()
        self._build(root_seed, iteration)

    def _build(self, root_seed: int, iteration: int) -> None:
        self._ctx = Context(root_seed=root_seed, iteration=iteration)
        self._root = self._node.iterator(self._ctx)
        self._wait_seconds = 0.0
        self._elements = 0
        self._started = time.perf_counter()
        self._exhausted = False

    def __iter__(self):
        return self

    def __next__(self):
        if self._exhausted:
            raise StopIteration
        t0 = time.perf_counter()
        try:
            x = next(self._root)
        except StopIteration:
            self._exhausted = True
            self.close()
            raise
        finally:
            self._wait_seconds += time.perf_counter() - t0
        self._elements += 1
        return x

    # ---- state

    def state_dict(self) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "pipeline": self._fingerprint,
            "root_seed": self._ctx.root_seed,
            "iteration": self._ctx.iteration,
            "exhausted": self._exhausted,
            "state": None if self._exhausted else self._root.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise StateMismatchError("not a conveyor.data iterator state (missing format marker)")
        if state.get("version") != STATE_VERSION:
            raise StateMismatchError(
                f"iterator state has version {state.get('version')}, this conveyor reads version "
                f"{STATE_VERSION}; resume with the conveyor release that saved it"
            )
        saved = state.get("pipeline")
        if saved != self._fingerprint:
            raise StateMismatchError(
                "iterator state was saved from a different pipeline; rebuild the same pipeline "
                f"(same ops and arguments) to resume it.\n  saved:   {_short(saved)}\n  current: "
                f"{_short(self._fingerprint)}"
            )
        self.close()
        self._build(int(state["root_seed"]), int(state["iteration"]))
        if state.get("exhausted"):
            self._exhausted = True
        else:
            self._root.set_state(state["state"])

    # ---- statistics

    def stats(self) -> dict[str, Any]:
        """Per-stage counts and rates, and how long the consumer waited for elements."""
        elapsed = max(time.perf_counter() - self._started, 1e-9)
        return {
            "elements": self._elements,
            "elapsed_seconds": elapsed,
            "wait_seconds": self._wait_seconds,
            "wait_fraction": min(1.0, self._wait_seconds / elapsed),
            "stages": [s.as_dict() for s in self._ctx.stats.values()],
        }

    # ---- lifetime

    def close(self) -> None:
        root = getattr(self, "_root", None)
        if root is not None:
            root.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _short(fp: Any) -> str:
    text = str(fp)
    return text if len(text) < 300 else text[:297] + "..."


def call(fn: Callable, x: Any) -> Any:
    """Call a user function on an element; a tuple element is unpacked into arguments (tf.data)."""
    return fn(*x) if type(x) is tuple else fn(x)


_global_seed: list = [None, 0]  # [seed, how many root seeds were drawn from it]


def set_seed(seed: int | None) -> None:
    """Make every pipeline reproducible, like `tf.random.set_seed`.

    Ops without their own seed (and map functions in worker processes, whose RNGs are reseeded
    per chunk) then draw from seeds derived from this one and the order in which datasets are
    built. `None` goes back to fresh random seeds.
    """
    _global_seed[0] = None if seed is None else int(seed)
    _global_seed[1] = 0


def new_root_seed() -> int:
    """The seed of one Dataset object's iterations (saved in its iterators' states)."""
    if _global_seed[0] is None:
        return int.from_bytes(os.urandom(4), "little")
    _global_seed[1] += 1
    words = np.random.SeedSequence([_global_seed[0] & 0xFFFFFFFF, _global_seed[1]]).generate_state(1)
    return int(words[0])
