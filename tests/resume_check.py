"""The one shared check every op's tests use: a resumed iterator continues the stream exactly.

Save the state after k elements, push it through JSON (as a checkpoint would), load it into an
iterator of a freshly built pipeline, and compare what follows with what the original iterator
went on to yield — and, for a deterministic pipeline, with an uninterrupted run.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from itertools import islice

from conveyor.data import set_seed
from conveyor.data.elements import to_json


def canon(x) -> str:
    """A comparable, hashable form of an element (dtype and shape included)."""
    return json.dumps(to_json(x), sort_keys=True)


def take_all(it: Iterable, limit: int | None = None) -> list[str]:
    return [canon(x) for x in islice(it, limit)]


def assert_resumes(make_ds: Callable, ks: Iterable[int], limit: int | None = None,
                   deterministic: bool = True, seed: int | None = None) -> None:
    """For every k in `ks`: stream[:k] + resumed stream == uninterrupted stream.

    `limit` caps how many elements are compared (for endless pipelines). With
    `deterministic=False` the comparison is of multisets: nothing lost, nothing repeated.
    With `seed`, `set_seed(seed)` precedes every build, so unseeded random ops (and random map
    functions in worker processes) draw the same numbers in every build.
    """
    if seed is not None:
        build = make_ds

        def make_ds():
            set_seed(seed)
            try:
                return build()
            finally:
                set_seed(None)

    reference = take_all(iter(make_ds()), limit) if deterministic else None
    for k in ks:
        ds = make_ds()
        it = iter(ds)
        head = take_all(it, k)
        state = json.loads(json.dumps(it.state_dict()))
        rest_limit = None if limit is None else max(limit - len(head), 0)
        original_rest = take_all(it, rest_limit)
        it.close()

        resumed = iter(make_ds())
        resumed.load_state_dict(state)
        resumed_rest = take_all(resumed, rest_limit)
        resumed.close()

        if deterministic:
            assert resumed_rest == original_rest, f"resume after {k} elements diverged from the original"
            assert head + original_rest == reference, f"saving the state after {k} elements changed the stream"
        elif limit is None:
            full = sorted(take_all(iter(make_ds())))
            assert sorted(head + resumed_rest) == full, f"resume after {k}: elements lost or repeated"
            assert sorted(head + original_rest) == full, f"state_dict after {k} lost or repeated elements"
