"""The two halves of every dataset op: a stateless recipe and a resumable iterator.

A `Node` is an immutable description ("read these files", "map this function over that input").
`Node.iterator(ctx)` builds an `Iter`, the stateful half, which yields elements and can save and
restore its position with `get_state()` / `set_state()`. Each op in `ops/` and `sources/` is one
such pair. `DatasetIterator` is what `iter(dataset)` returns: it owns the tree of `Iter`s, times
the consumer's waits, and wraps the tree's state with a version and a fingerprint of the pipeline
so that a state is never loaded into a different pipeline.

Contract for op authors:
- `Iter.set_state` is only ever called on a freshly built iterator, before its first `next`. Its
  state is untrusted (checkpoints may be writable by others): read every field through the
  `StateField` it gets, which checks types and ranges and names the field in its `StateError`, and
  check saved elements against `Node.known_elements()`, before opening or allocating anything.
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

from conveyor.data.elements import from_json
from conveyor.data.errors import StateError, StateMismatchError

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


_NO_KEY = object()


class StateField:
    """One field of a saved state being loaded, with checked reads that name the field when it is wrong.

    States come from checkpoints that others may be able to write, so nothing in them is trusted:
    every read checks the type and range, and a bad value raises `StateError` naming its path,
    e.g. `state["state"]["input"]["offset"]: expected int >= 0, got 'x'`. Used only in `set_state`,
    never while iterating.
    """

    __slots__ = ("value", "where")

    def __init__(self, value: Any, where: str = "state"):
        self.value = value
        self.where = where

    def error(self, problem: str) -> StateError:
        return StateError(
            f"{self.where}: {problem}. The iterator state is damaged or does not belong to this pipeline: "
            f"restore the checkpoint it came from, or start without the data state (--no-resume)", self.where)

    def _expected(self, what: str) -> StateError:
        return self.error(f"expected {what}, got {_show(self.value)}")

    def fields(self, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> StateField:
        """Check that this is a dict with exactly these keys (`optional` ones may be absent)."""
        if not isinstance(self.value, dict):
            raise self._expected("a dict with keys " + ", ".join(map(repr, required)))
        missing = [k for k in required if k not in self.value]
        unknown = [k for k in self.value if k not in required and k not in optional]
        if missing or unknown:
            raise self.error(f"expected the keys {list(required)}, but {_show(missing)} are missing and "
                             f"{_show(unknown)} are unknown")
        return self

    def __getitem__(self, key: str | int) -> StateField:
        value = self.value.get(key, _NO_KEY) if isinstance(self.value, dict) else _NO_KEY
        if value is _NO_KEY:
            raise self._expected(f"a dict with the key {key!r}")
        return StateField(value, f'{self.where}["{key}"]')

    def get(self, key: str) -> StateField | None:
        """The field `key`, or None when the dict does not have it (a state from an older release)."""
        return self[key] if isinstance(self.value, dict) and key in self.value else None

    def is_none(self) -> bool:
        return self.value is None

    def as_int(self, lo: int | None = 0, hi: int | None = None) -> int:
        """An int in [lo, hi] (bools are not ints here)."""
        v = self.value
        if type(v) is not int or (lo is not None and v < lo) or (hi is not None and v > hi):
            bounds = " and ".join(b for b in (lo is not None and f">= {lo}", hi is not None and f"<= {hi}") if b)
            raise self._expected(f"int {bounds}".strip())
        return v

    def as_bool(self) -> bool:
        if type(self.value) is not bool:
            raise self._expected("true or false")
        return self.value

    def as_str(self) -> str:
        if type(self.value) is not str:
            raise self._expected("a str")
        return self.value

    def as_dict(self) -> dict:
        if not isinstance(self.value, dict):
            raise self._expected("a dict")
        return self.value

    def as_list(self, max_len: int | None = None, length: int | None = None) -> list[StateField]:
        """The items of a list, each as a field; checks the length before touching any item."""
        v = self.value
        if not isinstance(v, list):
            raise self._expected("a list")
        if length is not None and len(v) != length:
            raise self.error(f"expected a list of {length} items, got {len(v)}")
        if max_len is not None and len(v) > max_len:
            raise self.error(f"expected a list of at most {max_len} items, got {len(v)}")
        return [StateField(x, f"{self.where}[{i}]") for i, x in enumerate(v)]

    def as_element(self, known: frozenset | None = None) -> Any:
        """A dataset element saved with `elements.to_json`; with `known` (every element the input can
        produce, see `Node.known_elements`) it must be one of them."""
        try:
            x = from_json(self.value)
        except (ValueError, TypeError, KeyError, AttributeError, OverflowError, RecursionError, MemoryError):
            raise self._expected("an element saved by elements.to_json") from None
        if known is not None and not (isinstance(x, (str, bytes)) and x in known):
            raise self.error(f"{_show(x)} is not an element of this pipeline's input (e.g. not in its file list)")
        return x

    def as_elements(self, max_len: int | None = None, known: frozenset | None = None) -> list:
        return [f.as_element(known) for f in self.as_list(max_len)]


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


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

    def set_state(self, state: StateField) -> None:
        """Restore a position from untrusted `state`: check every field (via `StateField`) before
        opening, starting or allocating anything."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop background work, then close the inputs. Safe to call twice."""
        for it in self.inputs:
            it.close()


class UnaryIter(Iter):
    """An op with one input, which it closes and drops once it is "finished" (exhausted, or done).

    State: the op's own fields (`_extra_state`, whose keys are `_STATE_KEYS`) followed by the
    input's state under "input", which is None once finished. `set_state` checks the keys, loads the
    op's fields (`_load_extra_state`, which validates them and may call `_finish()` itself), then
    finishes the input or restores it.
    """

    _STATE_KEYS: tuple[str, ...] = ()

    def __init__(self, name: str, ctx: Context, source: Iter | None):
        super().__init__(name, ctx, *(() if source is None else (source,)))
        self._input: Iter | None = source

    def _finish(self) -> None:
        if self._input is not None:
            self._input.close()  # stays in `inputs`: closing twice is safe
            self._input = None

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _load_extra_state(self, state: StateField) -> None:
        pass

    def get_state(self) -> dict[str, Any]:
        return {**self._extra_state(), "input": None if self._input is None else self._input.get_state()}

    def set_state(self, state: StateField) -> None:
        state.fields(self._STATE_KEYS + ("input",))
        self._load_extra_state(state)
        if state["input"].is_none() or self._input is None:
            self._finish()
        else:
            self._input.set_state(state["input"])


class Node:
    """The stateless half of an op: a recipe that builds `Iter`s.

    `name` and `params` make up the pipeline fingerprint; `inputs` are the upstream nodes.
    """

    name: str = "node"
    keeps_elements = False  # every output element is an input element (shuffle, take, ...)

    def __init__(self, *inputs: Node):
        self.inputs: tuple[Node, ...] = inputs

    def params(self) -> dict[str, Any]:
        return {}

    def known_elements(self) -> frozenset | None:
        """Every str/bytes element this dataset can produce (a file list), or None when that set is
        not known. Loading a state checks saved elements (buffered file names, the file a reader is
        in) against it, so a tampered state cannot make the pipeline open a file it does not list.
        Computed when a state is loaded, never while iterating."""
        return self.inputs[0].known_elements() if self.keeps_elements else None

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
        """Continue from `state_dict()` output. The state is untrusted (checkpoints may be writable by
        others): it is checked against this pipeline before any file is opened, and a bad one raises
        `StateError` (`StateMismatchError` for another pipeline or changed files) naming the field."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise StateMismatchError("not a conveyor.data iterator state (missing format marker)")
        if state.get("version") != STATE_VERSION:
            raise StateMismatchError(
                f"iterator state has version {_short(state.get('version'))}, this conveyor reads version "
                f"{STATE_VERSION}; resume with the conveyor release that saved it"
            )
        saved = state.get("pipeline")
        if saved != self._fingerprint:
            raise StateMismatchError(
                "iterator state was saved from a different pipeline; rebuild the same pipeline "
                f"(same ops and arguments) to resume it.\n  saved:   {_short(saved)}\n  current: "
                f"{_short(self._fingerprint)}"
            )
        top = StateField(state).fields(("format", "version", "pipeline", "root_seed", "iteration", "exhausted",
                                        "state"))
        root_seed, iteration = top["root_seed"].as_int(0, 2**64 - 1), top["iteration"].as_int(0, 2**63 - 1)
        exhausted = top["exhausted"].as_bool()
        if not exhausted and top["state"].is_none():
            raise top["state"].error("expected the pipeline's state (it is null, but 'exhausted' is false)")
        before = (self._ctx.root_seed, self._ctx.iteration)
        self.close()
        self._build(root_seed, iteration)
        if exhausted:
            self._exhausted = True
            return
        try:
            self._root.set_state(top["state"])
        except BaseException:
            self.close()  # no half-restored iterator (nor its threads) survives a refused state
            self._build(*before)
            raise

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
