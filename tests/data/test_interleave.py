"""interleave: tf.data's exact order (docs/tfdata-semantics.md §6), the parallel versions, errors, close, resume."""

from __future__ import annotations

import threading
import time
import traceback

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.data.base import AUTOTUNE, cpu_budget
from conveyor.data.errors import InvalidArgumentError
from conveyor.data.pipeline import Dataset
from resume_check import assert_resumes

PARALLEL = [None, 1, 2, AUTOTUNE]

FILES = {"A": ["a1", "a2", "a3"], "B": ["b1"], "C": ["c1", "c2"], "D": ["d1", "d2"]}


def files_ds(cycle_length, block_length, num_parallel_calls=None, deterministic=None):
    return Dataset.from_tensor_slices(list("ABCD")).interleave(
        lambda f: Dataset.from_tensor_slices(FILES[str(f)]), cycle_length=cycle_length,
        block_length=block_length, num_parallel_calls=num_parallel_calls, deterministic=deterministic)


def reference_interleave(inners: list[list], cycle: int, block: int) -> list:
    """§6's sequential kernel, written out plainly over lists."""
    pending = list(inners)
    cur: list = [None] * cycle
    ci = bi = num_open = 0
    end_of_input = False
    out = []
    while not end_of_input or num_open > 0:
        if cur[ci] is not None:
            if cur[ci]:
                out.append(cur[ci].pop(0))
                bi += 1
                if bi == block:
                    bi, ci = 0, (ci + 1) % cycle
            else:
                cur[ci] = None
                num_open -= 1
                bi, ci = 0, (ci + 1) % cycle
        elif not end_of_input:
            if pending:
                cur[ci] = list(pending.pop(0))
                num_open += 1
            else:
                end_of_input = True
        else:
            bi, ci = 0, (ci + 1) % cycle
    return out


def inner_lists(lengths: list[int]) -> list[list[int]]:
    return [[100 * i + j for j in range(n)] for i, n in enumerate(lengths)]


def lengths_ds(lengths, cycle, block, num_parallel_calls=None, deterministic=None):
    lens = Dataset.from_tensor_slices(([i for i in range(len(lengths))], list(lengths)))
    return lens.interleave(lambda i, n: Dataset.range(100 * int(i), 100 * int(i) + int(n)), cycle_length=cycle,
                           block_length=block, num_parallel_calls=num_parallel_calls,
                           deterministic=deterministic)


def ints(ds) -> list[int]:
    return [int(x) for x in ds]


def interleave_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("conveyor-interleave")]


# ---------------------------------------------------------------- the §6 vectors


@pytest.mark.parametrize("num_parallel_calls", PARALLEL)
def test_docstring_vector(num_parallel_calls):
    ds = Dataset.range(1, 6).interleave(lambda x: Dataset.from_tensor_slices([x]).repeat(6), cycle_length=2,
                                        block_length=4, num_parallel_calls=num_parallel_calls)
    assert ints(ds) == [1, 1, 1, 1, 2, 2, 2, 2, 1, 1, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 3, 3, 4, 4,
                        5, 5, 5, 5, 5, 5]


@pytest.mark.parametrize("num_parallel_calls", PARALLEL)
def test_files_vectors(num_parallel_calls):
    assert list(files_ds(2, 1, num_parallel_calls)) == "a1 b1 a2 a3 c1 c2 d1 d2".split()
    assert list(files_ds(3, 2, num_parallel_calls)) == "a1 a2 b1 c1 c2 a3 d1 d2".split()


def test_reference_matches_the_vectors():
    assert reference_interleave([FILES[f] for f in "ABCD"], 2, 1) == "a1 b1 a2 a3 c1 c2 d1 d2".split()
    assert reference_interleave([FILES[f] for f in "ABCD"], 3, 2) == "a1 a2 b1 c1 c2 a3 d1 d2".split()


def test_cycle_length_one_is_flat_map():
    lengths = [3, 0, 2, 4]
    expected = [x for inner in inner_lists(lengths) for x in inner]
    assert ints(lengths_ds(lengths, 1, 2)) == expected
    flat = Dataset.from_tensor_slices(([0, 1, 2, 3], lengths)).flat_map(
        lambda i, n: Dataset.range(100 * int(i), 100 * int(i) + int(n)))
    assert ints(flat) == expected


def test_autotune_cycle_length_is_the_cpu_budget():
    lengths = [2, 3, 1, 4, 2, 3, 1, 2, 5]
    expected = reference_interleave(inner_lists(lengths), cpu_budget(), 1)
    assert ints(lengths_ds(lengths, None, 1)) == expected
    assert ints(lengths_ds(lengths, AUTOTUNE, 1)) == expected


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(0, 5), max_size=7), cycle=st.integers(1, 4), block=st.integers(1, 3))
def test_matches_reference_implementation(lengths, cycle, block):
    expected = reference_interleave(inner_lists(lengths), cycle, block)
    assert ints(lengths_ds(lengths, cycle, block)) == expected
    assert ints(lengths_ds(lengths, cycle, block, num_parallel_calls=2)) == expected
    assert sorted(ints(lengths_ds(lengths, cycle, block, num_parallel_calls=2, deterministic=False))) == \
        sorted(expected)


# ---------------------------------------------------------------- non-deterministic mode


def test_not_deterministic_takes_whatever_is_ready():
    def slow(x):
        time.sleep(0.2)
        return x

    ds = Dataset.from_tensor_slices(["slow", "fast"]).interleave(
        lambda f: Dataset.from_tensor_slices([f"{f}{i}" for i in range(3)]).map(
            slow if str(f) == "slow" else (lambda x: x)),
        cycle_length=2, block_length=1, num_parallel_calls=2, deterministic=False)
    out = list(ds)
    assert sorted(out) == sorted([f"slow{i}" for i in range(3)] + [f"fast{i}" for i in range(3)])
    assert out[0] == "fast0"  # the slow dataset's turn came first, but it had nothing ready


# ---------------------------------------------------------------- errors and lifetime


def explode_at_two(x):
    if int(x) == 2:
        raise ValueError(f"boom at {int(x)}")
    return x


@pytest.mark.parametrize("num_parallel_calls", PARALLEL)
def test_inner_exception_reaches_the_consumer(num_parallel_calls):
    ds = Dataset.range(3).interleave(lambda x: Dataset.range(4).map(explode_at_two), cycle_length=2,
                                     num_parallel_calls=num_parallel_calls)
    it = iter(ds)
    got = []
    with pytest.raises(ValueError, match="^boom at 2$") as excinfo:
        for x in it:
            got.append(int(x))
    it.close()
    assert got == [0, 0, 1, 1]  # everything before the failing element, in order
    frames = [f.name for f in traceback.extract_tb(excinfo.value.__traceback__)]
    assert "explode_at_two" in frames  # the original traceback is kept


def test_map_func_must_return_a_dataset():
    with pytest.raises(TypeError, match="must return a Dataset"):
        list(Dataset.range(2).interleave(lambda x: [x]))


@pytest.mark.parametrize("kwargs", [dict(cycle_length=0), dict(block_length=0), dict(num_parallel_calls=0),
                                    dict(cycle_length=-3), dict(block_length=AUTOTUNE), dict(cycle_length=1.5)])
def test_invalid_arguments(kwargs):
    with pytest.raises(InvalidArgumentError):
        Dataset.range(3).interleave(lambda x: Dataset.range(2), **kwargs)


def test_close_mid_stream_stops_the_threads():
    before = set(interleave_threads())
    ds = Dataset.range(6).interleave(lambda x: Dataset.range(1000), cycle_length=3, num_parallel_calls=3)
    it = iter(ds)
    assert [int(next(it)) for _ in range(5)] == [0, 0, 0, 1, 1]
    assert len(set(interleave_threads()) - before) == 3
    it.close()
    assert set(interleave_threads()) - before == set()


def test_close_is_prompt_while_inner_datasets_are_slow():
    def slow(x):
        time.sleep(0.05)
        return x

    before = set(interleave_threads())
    ds = Dataset.range(4).interleave(lambda x: Dataset.range(100).map(slow), cycle_length=4,
                                     num_parallel_calls=2)
    it = iter(ds)
    next(it)
    t0 = time.perf_counter()
    it.close()
    assert time.perf_counter() - t0 < 2.0
    assert set(interleave_threads()) - before == set()


def test_threads_start_lazily():
    before = set(interleave_threads())
    it = iter(Dataset.range(3).interleave(lambda x: Dataset.range(3), cycle_length=2, num_parallel_calls=2))
    assert set(interleave_threads()) - before == set()
    it.close()


# ---------------------------------------------------------------- resume


def seeded_inner(x):
    # A shuffle inside each inner dataset: its seed depends on which input element opened it, so
    # a resumed pipeline must rebuild each inner dataset with the same context.
    return Dataset.range(10 * int(x), 10 * int(x) + int(x) % 4 + 2).shuffle(3, seed=5)


def make_resumable(num_parallel_calls=None, deterministic=None):
    return Dataset.range(7).interleave(seeded_inner, cycle_length=3, block_length=2,
                                       num_parallel_calls=num_parallel_calls, deterministic=deterministic)


KS = [0, 1, 2, 5, 9, 14, 20, 25]


def test_resume_sequential():
    assert_resumes(make_resumable, ks=KS)


def test_resume_parallel_deterministic():
    assert_resumes(lambda: make_resumable(2), ks=KS)


def test_resume_parallel_not_deterministic():
    assert_resumes(lambda: make_resumable(2, deterministic=False), ks=KS, deterministic=False)


def test_resume_through_repeat_and_nested_interleave():
    def make():
        return Dataset.range(3).interleave(
            lambda x: Dataset.range(2).interleave(lambda y: Dataset.range(3), cycle_length=2,
                                                  num_parallel_calls=2),
            cycle_length=2, num_parallel_calls=2).repeat(2)

    assert_resumes(make, ks=[0, 4, 17, 18, 30])


def test_state_holds_elements_read_ahead():
    it = iter(Dataset.range(2).interleave(lambda x: Dataset.range(50), cycle_length=2, num_parallel_calls=2))
    next(it)
    deadline = time.monotonic() + 5
    while True:  # wait until the readers have run ahead
        slots = it.state_dict()["state"]["slots"]
        if sum(len(s["buffer"]) for s in slots if s) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert sum(len(s["buffer"]) for s in slots if s) >= 2
    it.close()


def test_autotune_starts_one_reader_and_adds_more_when_the_consumer_waits():
    import time as _time

    from conveyor.data import AUTOTUNE, Dataset

    def slow(x):
        _time.sleep(0.002)
        return x

    inner = lambda i: Dataset.range(i * 100, i * 100 + 40).map(slow)  # noqa: E731
    it = iter(Dataset.range(4).interleave(inner, cycle_length=4, num_parallel_calls=AUTOTUNE))
    first = next(it)
    stage = next(s for s in it.stats()["stages"] if s["stage"] == "interleave")
    assert first == 0 and stage["max_parallel_calls"] >= 1
    rest = list(it)
    stage = next(s for s in it.stats()["stages"] if s["stage"] == "interleave")
    assert sorted([first, *rest]) == sorted(x for i in range(4) for x in range(i * 100, i * 100 + 40))
    if stage["max_parallel_calls"] > 1:  # slow readers: the consumer waited, so readers were added
        assert stage["consumer_waits"] >= 16 and stage["num_parallel_calls"] > 1
