"""`shuffle(buffer_size, seed, reshuffle_each_iteration)`: sample uniformly from a sliding buffer.

tf.data's kernel (docs/tfdata-semantics.md §4): before each output, fill the buffer up to `buffer_size` elements
from the input; pick one slot uniformly at random, emit it and move the last slot into the hole.
When the input ends the buffer drains in random order. Output k (0-based) therefore comes from
inputs [0, k + buffer_size), and `buffer_size >= len(input)` gives a uniform permutation.

    Dataset.range(10).shuffle(4, seed=0)   # a permutation of 0..9; the first output is one of 0..3

The random numbers come from `Context.rng`, so a rebuilt iterator draws the same sequence and,
with `reshuffle_each_iteration`, every `iter()` and every epoch of an enclosing `repeat` draws a
new one. Draws are made in blocks (one numpy call per `_BLOCK` outputs); the state stores the
generator's state *before* the current block and the position inside it, so resuming regenerates
the block instead of saving it.
"""

from __future__ import annotations

import operator
from typing import Any

from conveyor.data.base import AUTOTUNE, Context, Iter, Node, StateField
from conveyor.data.elements import to_json
from conveyor.data.errors import InvalidArgumentError

_BLOCK = 1024  # random numbers drawn per numpy call
_RANGE = 1 << 62  # draws are uniform in [0, _RANGE); modulo bias for a buffer of n is < n / 2**62


class ShuffleNode(Node):
    name = "shuffle"
    keeps_elements = True

    def __init__(self, input: Node, buffer_size: int, seed: int | None, reshuffle_each_iteration: bool):
        super().__init__(input)
        if buffer_size == AUTOTUNE:
            raise InvalidArgumentError(
                "shuffle does not accept AUTOTUNE as buffer_size: pick the number of elements to mix "
                "(memory grows with it; len(dataset) gives a full shuffle)"
            )
        size = _as_int(buffer_size)
        if size is None or size < 1:
            raise InvalidArgumentError(f"shuffle buffer_size must be a positive integer, got {buffer_size!r}")
        if seed is not None and _as_int(seed) is None:
            raise InvalidArgumentError(f"shuffle seed must be an integer or None, got {seed!r}")
        self.buffer_size = size
        self.seed = None if seed is None else _as_int(seed)
        self.reshuffle_each_iteration = bool(reshuffle_each_iteration)

    def params(self) -> dict[str, Any]:
        return {"buffer_size": self.buffer_size, "seed": self.seed,
                "reshuffle_each_iteration": self.reshuffle_each_iteration}

    def iterator(self, ctx: Context) -> Iter:
        return ShuffleIter(self, ctx)


def _as_int(x: Any) -> int | None:
    """`x` as a Python int if it is an integer (numpy ones included, bool excluded), else None."""
    if isinstance(x, bool):
        return None
    try:
        return operator.index(x)
    except TypeError:
        return None


class ShuffleIter(Iter):
    def __init__(self, node: ShuffleNode, ctx: Context):
        super().__init__(node.name, ctx, node.inputs[0].iterator(ctx.child(0)))
        self._input = self.inputs[0]
        self._input_node = node.inputs[0]
        self._size = node.buffer_size
        self._rng = ctx.rng(node.seed, node.reshuffle_each_iteration)
        self._buffer: list = []
        self._input_done = False
        self._block: list[int] = []
        self._block_rng_state: dict | None = None  # generator state before `_block` was drawn
        self._pos = 0  # next unused draw in `_block`

    def _draw(self) -> int:
        if self._pos == len(self._block):
            self._block_rng_state = self._rng.bit_generator.state
            self._block = self._rng.integers(0, _RANGE, size=_BLOCK, dtype="int64").tolist()
            self._pos = 0
        r = self._block[self._pos]
        self._pos += 1
        return r

    def _next(self):
        buf = self._buffer
        if not self._input_done and len(buf) < self._size:
            it = self._input
            try:
                while len(buf) < self._size:
                    buf.append(next(it))
            except StopIteration:
                self._input_done = True
        if not buf:
            raise StopIteration
        i = self._draw() % len(buf)
        x = buf[i]
        last = buf.pop()
        if i < len(buf):
            buf[i] = last
        return x

    def get_state(self) -> dict[str, Any]:
        return {
            "input": None if self._input_done else self._input.get_state(),
            "buffer": [to_json(x) for x in self._buffer],
            "rng": self._block_rng_state if self._block else self._rng.bit_generator.state,
            "draws_used": self._pos if self._block else 0,
        }

    def set_state(self, state: StateField) -> None:
        state.fields(("input", "buffer", "rng", "draws_used"))
        buffer = state["buffer"].as_elements(max_len=self._size, known=self._input_node.known_elements())
        rng = _rng_state(state["rng"])
        used = state["draws_used"].as_int(0, _BLOCK)
        if state["input"].is_none():
            self._input_done = True
        else:
            self._input.set_state(state["input"])
        self._buffer = buffer
        self._rng.bit_generator.state = rng
        self._block, self._pos = [], 0
        if used:
            self._draw()
            self._pos = used


def _rng_state(field: StateField) -> dict:
    """A saved PCG64 state (the generator `Context.rng` makes), checked field by field."""
    field.fields(("bit_generator", "state", "has_uint32", "uinteger"))
    if field["bit_generator"].value != "PCG64":
        raise field["bit_generator"].error("expected 'PCG64'")
    inner = field["state"].fields(("state", "inc"))
    return {"bit_generator": "PCG64",
            "state": {"state": inner["state"].as_int(0, 2**128 - 1), "inc": inner["inc"].as_int(0, 2**128 - 1)},
            "has_uint32": field["has_uint32"].as_int(0, 1), "uinteger": field["uinteger"].as_int(0, 2**32 - 1)}
