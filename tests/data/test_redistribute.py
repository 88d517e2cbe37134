"""An epoch interrupted on N workers and finished on M (`conveyor.data.redistribute`): every record id is
handed out exactly once over the epoch, through several world changes, in a deterministic order."""

from __future__ import annotations

import collections
import os

import numpy as np
import pytest

from conveyor.data import Dataset, FixedLenFeature, TFRecordDataset, encode_example, parse_single_example
from conveyor.data.errors import RedistributeError
from conveyor.data.records import TFRecordWriter
from conveyor.data.redistribute import Saved, leftover_iterator, leftover_node, plan
from resume_check import assert_resumes

SEED = 11


def write_id_files(folder, files: int, per_file: int) -> int:
    """TFRecord files of tf.train.Examples with a unique int64 feature "id" (0..) and padding of varying length."""
    rng = np.random.default_rng(files)
    next_id = 0
    for f in range(files):
        with TFRecordWriter(os.path.join(str(folder), f"part-{f:02d}.tfrecord")) as w:
            for _ in range(per_file + f % 3):  # files of different lengths
                w.write(encode_example({"id": next_id, "pad": rng.bytes(int(rng.integers(0, 30)))}))
                next_id += 1
    return next_id


def record_id(record: bytes) -> int:
    return int(parse_single_example(record, {"id": FixedLenFeature([], "int64")})["id"])


def ids_of(element) -> list[int]:
    return [int(x) for x in np.asarray(element).reshape(-1)]


def pipelines(folder) -> dict:
    """name -> (make(world, rank) -> Dataset, number of ids)."""
    n_files = write_id_files(folder, files=7, per_file=9)
    pattern = os.path.join(str(folder), "*.tfrecord")

    def files(world, rank):
        return Dataset.list_files(pattern, shuffle=False).shard(world, rank)

    return {
        "range, shard over records": (lambda w, r: Dataset.range(101).shard(w, r).shuffle(8, seed=1).batch(3), 101),
        "from_tensor_slices, map in threads, prefetch": (
            lambda w, r: Dataset.from_tensor_slices({"id": np.arange(90)}).shard(w, r).shuffle(10, seed=2)
            .map(lambda d: d["id"], num_parallel_calls=2, use_processes=False).batch(4).prefetch(2), 90),
        "list_files, interleave read-ahead, shuffle, map in processes + batch": (
            lambda w, r: files(w, r).interleave(TFRecordDataset, cycle_length=2, num_parallel_calls=2)
            .shuffle(16, seed=0).map(record_id, num_parallel_calls=2).batch(4).prefetch(1), n_files),
        "TFRecordDataset over files, filter, shuffle after the map": (
            lambda w, r: TFRecordDataset(files(w, r)).filter(lambda x: len(x) > 0).map(record_id)
            .shuffle(5, seed=3).batch(2), n_files),
    }


def take(it, count: int | None) -> list[int]:
    got = []
    while count is None or count > 0:
        try:
            got += ids_of(next(it))
        except StopIteration:
            break
        count = None if count is None else count - 1
    return got


def run_epoch(make, worlds: list[int], stops: list[int]) -> tuple[list[int], list[list[list[int]]]]:
    """One epoch: `stops[i]` elements per worker on `worlds[i]` workers, then a checkpoint and a change of
    world; the last world runs to the end. Every id handed out, and what each worker got in each phase."""
    saved = None
    seen, phases = [], []
    for i, world in enumerate(worlds):
        if saved is None:
            its = [make(world, k).iterator(root_seed=SEED, iteration=0) for k in range(world)]
            shares = [None] * world
        else:
            shares = plan(make(world, 0), saved, world)
            assert plan(make(world, world - 1), saved, world) == shares  # every rank computes the same deal
            its = [leftover_iterator(make(world, k), shares[k], SEED, 0) for k in range(world)]
        last = i == len(worlds) - 1
        got = [take(it, None if last else stops[i]) for it in its]
        phases.append(got)
        seen += [x for g in got for x in g]
        saved = [Saved(it.state_dict(), share) for it, share in zip(its, shares, strict=True)]
        for it in its:
            it.close()
    return seen, phases


def assert_exactly_once(seen: list[int], n: int) -> None:
    counts = collections.Counter(seen)
    repeated = sorted(x for x, c in counts.items() if c > 1)
    skipped = sorted(set(range(n)) - set(counts))
    assert not repeated and not skipped, f"repeated {repeated[:10]}, skipped {skipped[:10]}"
    assert len(seen) == n


CHANGES = [([1, 3], [5]), ([3, 2], [2]), ([4, 1], [3]), ([2, 3, 1, 2], [2, 1, 3]), ([3, 1, 4], [0, 2]),
           ([2, 2], [4])]


@pytest.mark.parametrize("worlds,stops", CHANGES, ids=lambda v: "-".join(map(str, v)))
def test_every_record_is_handed_out_exactly_once_across_world_changes(tmp_path, worlds, stops):
    for name, (make, n) in pipelines(tmp_path).items():
        seen, _ = run_epoch(make, worlds, stops)
        try:
            assert_exactly_once(seen, n)
        except AssertionError as e:
            raise AssertionError(f"{name}, worlds {worlds}, stops {stops}: {e}") from None


@pytest.mark.parametrize("stop", [1, 4, 9])
def test_stopping_at_several_points_of_the_epoch(tmp_path, stop):
    make, n = pipelines(tmp_path)["list_files, interleave read-ahead, shuffle, map in processes + batch"]
    seen, phases = run_epoch(make, [2, 3], [stop])
    assert_exactly_once(seen, n)
    if stop < 5:  # 66 ids in batches of 4: after 9 batches on each of 2 workers, 2 records are left
        assert all(phases[1]), "every new worker gets part of the leftover"


def saved_after(make, world: int, count: int) -> list[Saved]:
    """The states of `world` workers of the pipeline itself after `count` elements each."""
    its = [make(world, k).iterator(root_seed=SEED, iteration=0) for k in range(world)]
    for it in its:
        take(it, count)
    saved = [Saved(it.state_dict()) for it in its]
    for it in its:
        it.close()
    return saved


def leftover_streams(make, saved: list[Saved], world: int) -> list[list[int]]:
    shares = plan(make(world, 0), saved, world)
    streams = []
    for k in range(world):
        it = leftover_iterator(make(world, k), shares[k], SEED, 0)
        streams.append(take(it, None))
        it.close()
    return streams


def test_the_leftover_order_is_deterministic_from_the_checkpoint_and_the_world(tmp_path):
    """Background readers (prefetch, parallel interleave, map processes) make the saved states depend on timing;
    from one saved set of states, every redistribution to M workers hands out the same ids in the same order."""
    for make, _ in pipelines(tmp_path).values():
        saved = saved_after(make, 2, 2)
        first = leftover_streams(make, saved, 3)
        assert leftover_streams(make, saved, 3) == first
        # ... and from the states of workers that were themselves running a leftover
        shares = plan(make(3, 0), saved, 3)
        its = [leftover_iterator(make(3, k), shares[k], SEED, 0) for k in range(3)]
        for it in its:
            take(it, 1)
        again = [Saved(it.state_dict(), share) for it, share in zip(its, shares, strict=True)]
        for it in its:
            it.close()
        assert leftover_streams(make, again, 2) == leftover_streams(make, again, 2)


@pytest.mark.parametrize("name", ["range, shard over records",
                                  "list_files, interleave read-ahead, shuffle, map in processes + batch"])
def test_a_leftover_pipeline_resumes_exactly_on_the_same_world(tmp_path, name):
    make, _ = pipelines(tmp_path)[name]
    shares = plan(make(3, 1), saved_after(make, 2, 2), 3)
    assert_resumes(lambda: Dataset(leftover_node(make(3, 1)._node, shares[1])), ks=[0, 1, 3])


def test_the_deal_is_balanced(tmp_path):
    make, n = pipelines(tmp_path)["range, shard over records"]
    last = run_epoch(make, [4, 3], [5])[1][1]
    sizes = [len(x) for x in last]
    assert max(sizes) - min(sizes) <= 1, sizes  # 101 - 4 * 5 * 3 = 41 ids over 3 workers
    assert sum(sizes) == 41


def test_file_records_are_dealt_by_file_and_offset(tmp_path):
    make, n = pipelines(tmp_path)["list_files, interleave read-ahead, shuffle, map in processes + batch"]
    shares = plan(make(3, 0), saved_after(make, 2, 1), 3)
    sources = [s for share in shares for s in share["sources"]]
    assert sources and all(isinstance(s, list) and len(s) == 2 and len(s[1]) == 3 for s in sources), sources
    names = set(Dataset.list_files(os.path.join(str(tmp_path), "*.tfrecord"), shuffle=False).iterator())
    assert {s[0] for s in sources} <= names  # [file name, [path, size, mtime]]
    its = [leftover_iterator(make(3, k), shares[k], SEED, 0) for k in range(3)]
    assert sum(len(take(it, None)) for it in its) == n - 8  # 2 workers took a batch of 4 each


def test_a_generator_source_is_refused_naming_the_op():
    def make(world, rank):
        return Dataset.from_generator(lambda: iter(range(10))).shard(world, rank).batch(2)

    with pytest.raises(RedistributeError, match="from_generator op cannot be redistributed"):
        plan(make(3, 0), [Saved(None), Saved(None)], 3)


@pytest.mark.parametrize("op,build", [
    ("cache", lambda ds: ds.cache()),
    ("repeat", lambda ds: ds.repeat(2)),
    ("take", lambda ds: ds.take(5)),
])
def test_ops_that_cannot_say_what_they_handed_out_are_refused_by_name(op, build):
    ds = build(Dataset.range(20).shard(3, 0)).batch(2)
    with pytest.raises(RedistributeError, match=f"the {op} op cannot be redistributed"):
        plan(ds, [Saved(None)], 3)


def test_a_shard_over_a_map_is_refused():
    def make(world, rank):
        return Dataset.range(20).map(lambda x: x * 2).shard(world, rank).batch(2)

    it = make(2, 0).iterator(root_seed=SEED, iteration=0)
    next(it)
    with pytest.raises(RedistributeError, match="shard op over map"):
        plan(make(3, 0), [Saved(it.state_dict()), Saved(None)], 3)


def test_a_pipeline_without_a_shard_per_worker_is_refused():
    with pytest.raises(RedistributeError, match=r"no shard\(3, rank\)"):
        plan(Dataset.range(10).batch(2), [Saved(None)], 3)


def test_a_state_of_another_pipeline_is_refused():
    it = Dataset.range(30).shard(2, 0).batch(2).iterator(root_seed=SEED, iteration=0)
    next(it)
    with pytest.raises(RedistributeError, match="pipeline changed"):
        plan(Dataset.range(30).shard(3, 0).batch(5), [Saved(it.state_dict()), Saved(None)], 3)
