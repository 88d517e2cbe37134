"""`Dataset`: the chainable facade. Each method builds one op's recipe; the work is in `ops/`.

    files = Dataset.list_files("data/train-*.tfrecord", shuffle=False).shard(num_workers, rank)
    ds = (files.shuffle(16, seed=0)
               .interleave(TFRecordDataset, cycle_length=4, num_parallel_calls=AUTOTUNE)
               .shuffle(10_000, seed=0)
               .repeat()
               .map(parse_and_augment, num_parallel_calls=AUTOTUNE)
               .batch(128, drop_remainder=True)
               .prefetch(AUTOTUNE))
    it = iter(ds)               # resumable: it.state_dict() / it.load_state_dict(state)

Semantics, argument names and defaults follow tf.data (see docs/tfdata-semantics.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from conveyor.data.base import AUTOTUNE, DatasetIterator, Node, new_root_seed
from conveyor.data.errors import InvalidArgumentError
from conveyor.data.ops.batch import BatchNode
from conveyor.data.ops.cache import CacheNode
from conveyor.data.ops.filter import FilterNode
from conveyor.data.ops.interleave import InterleaveNode
from conveyor.data.ops.map import MapBatchNode, MapNode
from conveyor.data.ops.prefetch import PrefetchNode
from conveyor.data.ops.repeat import RepeatNode
from conveyor.data.ops.shard import ShardNode
from conveyor.data.ops.shuffle import ShuffleNode
from conveyor.data.ops.skip import SkipNode
from conveyor.data.ops.take import TakeNode
from conveyor.data.ops.unbatch import UnbatchNode
from conveyor.data.records.tfrecord import DEFAULT_MAX_RECORD_BYTES
from conveyor.data.service.client import ServiceNode
from conveyor.data.service.splits import split_files
from conveyor.data.sources.files import match_files
from conveyor.data.sources.generator import GeneratorNode
from conveyor.data.sources.range import RangeNode
from conveyor.data.sources.tensors import TensorSlicesNode
from conveyor.data.sources.tfrecord import TFRecordNode


class Dataset:
    """An immutable description of an input pipeline; `iter()` runs it.

    Each `iter()` starts an independent iterator. Random ops without a seed draw one per
    `Dataset` object; with `reshuffle_each_iteration=True` every new iterator reshuffles.
    """

    def __init__(self, node: Node):
        self._node = node
        self._root_seed = new_root_seed()
        self._iterations = 0

    def __iter__(self) -> DatasetIterator:
        return self.iterator()

    @property
    def root_seed(self) -> int:
        """The seed unseeded random ops of this dataset derive theirs from."""
        return self._root_seed

    def iterator(self, root_seed: int | None = None, iteration: int | None = None) -> DatasetIterator:
        """`iter(self)`, optionally with the root seed and the iteration number fixed, so that
        several processes (e.g. DataLoader workers) run the same stream."""
        if iteration is None:
            iteration = self._iterations
            self._iterations += 1
        seed = self._root_seed if root_seed is None else root_seed
        return DatasetIterator(_optimize(self._node), seed, iteration)

    def as_numpy_iterator(self) -> DatasetIterator:
        return iter(self)

    def __repr__(self) -> str:
        return f"<Dataset {self._node.name}>"

    # ------------------------------------------------------------------ sources

    @staticmethod
    def range(*args: int) -> Dataset:
        """`range(stop)`, `range(start, stop)` or `range(start, stop, step)`, like Python's."""
        return Dataset(RangeNode(*args))

    @staticmethod
    def from_tensor_slices(x: Any) -> Dataset:
        """One element per row of `x` (an array, a list, or a tuple/dict of equally long ones)."""
        return Dataset(TensorSlicesNode(x))

    @staticmethod
    def from_generator(fn: Callable[[], Iterable], args: tuple = ()) -> Dataset:
        """Elements of `fn(*args)`. Such a pipeline cannot be saved and resumed: the generator
        cannot be rewound."""
        return Dataset(GeneratorNode(fn, tuple(args)))

    @staticmethod
    def list_files(file_pattern: str | list[str], shuffle: bool | None = None,
                   seed: int | None = None) -> Dataset:
        """Files matching the glob pattern(s), sorted; fully shuffled unless `shuffle=False`."""
        files = match_files(file_pattern)
        ds = Dataset.from_tensor_slices(files)
        if shuffle is None or shuffle:
            ds = ds.shuffle(len(files), seed=seed)
        return ds

    # ------------------------------------------------------------------ transformations

    def shard(self, num_shards: int, index: int) -> Dataset:
        """Every element whose position modulo `num_shards` equals `index`."""
        return Dataset(ShardNode(self._node, num_shards, index))

    def shuffle(self, buffer_size: int, seed: int | None = None,
                reshuffle_each_iteration: bool | None = None) -> Dataset:
        """Sample uniformly from a buffer of `buffer_size` elements, refilled from the input."""
        reshuffle = True if reshuffle_each_iteration is None else bool(reshuffle_each_iteration)
        return Dataset(ShuffleNode(self._node, buffer_size, seed, reshuffle))

    def repeat(self, count: int | None = None) -> Dataset:
        """Repeat the input `count` times (forever when `count` is None or -1)."""
        return Dataset(RepeatNode(self._node, count))

    def interleave(self, map_func: Callable[..., Dataset], cycle_length: int | None = None,
                   block_length: int | None = None, num_parallel_calls: int | None = None,
                   deterministic: bool | None = None) -> Dataset:
        """Open `map_func(x)` for `cycle_length` input elements and take `block_length` elements from
        each in turn, opening the next input where one ends (tf.data's order, also when parallel
        unless `deterministic=False`)."""
        return Dataset(InterleaveNode(self._node, _returns_node(map_func), cycle_length,
                                      1 if block_length is None else block_length,
                                      num_parallel_calls, deterministic))

    def flat_map(self, map_func: Callable[..., Dataset]) -> Dataset:
        return self.interleave(map_func, cycle_length=1)

    def map(self, map_func: Callable, num_parallel_calls: int | None = None,
            deterministic: bool | None = None, *, use_processes: bool | None = None) -> Dataset:
        """Apply `map_func` to every element (a tuple element is unpacked into arguments).

        With `num_parallel_calls` (a number or AUTOTUNE) the calls run in parallel: in worker
        processes by default, which sidesteps the GIL for Python code (the function reaches them
        by fork, so lambdas and closures work), or in threads with `use_processes=False`, which
        suits functions that release the GIL. Output keeps the input order unless
        `deterministic=False`.
        """
        return Dataset(MapNode(self._node, map_func, num_parallel_calls, deterministic, use_processes))

    def batch(self, batch_size: int, drop_remainder: bool = False) -> Dataset:
        """Stack `batch_size` consecutive elements component-wise."""
        return Dataset(BatchNode(self._node, batch_size, drop_remainder))

    def unbatch(self) -> Dataset:
        return Dataset(UnbatchNode(self._node))

    def prefetch(self, buffer_size: int) -> Dataset:
        """Run the input ahead in the background, keeping up to `buffer_size` elements ready."""
        return Dataset(PrefetchNode(self._node, buffer_size))

    def take(self, count: int) -> Dataset:
        return Dataset(TakeNode(self._node, count))

    def skip(self, count: int) -> Dataset:
        return Dataset(SkipNode(self._node, count))

    def filter(self, predicate: Callable[..., bool]) -> Dataset:
        return Dataset(FilterNode(self._node, predicate))

    def cache(self, filename: str = "") -> Dataset:
        """Record the first complete pass (in memory, or in files with the prefix `filename`) and
        replay it afterwards."""
        return Dataset(CacheNode(self._node, filename))

    def is_endless(self) -> bool:
        """Whether iterating never ends: a `repeat()` without a count that no later `take(n)` cuts short."""
        node = self._node
        while node.inputs:
            count = node.params().get("count") if node.name in ("take", "repeat") else None
            if node.name == "take" and count >= 0:
                return False
            if node.name == "repeat" and count < 0:
                return True
            node = node.inputs[0]
        return False

    def is_sharded(self, num_shards: int) -> bool:
        """Whether the pipeline has a `shard(num_shards, ...)` step (a worker's share of the data)."""
        pending = [self._node]
        while pending:
            node = pending.pop()
            if node.name == "shard" and node.params().get("num_shards") == num_shards:
                return True
            pending.extend(node.inputs)
        return False

    def distribute(self, service: Any, processing_mode: str = "parallel_epochs", job_name: str | None = None,
                   **options: Any) -> Dataset:
        """This pipeline's elements produced by the data service's workers instead of this process
        (tf.data's `service.distribute`; docs/data-service.md). `service` is "HOST:PORT" (secret from
        CONVEYOR_JOB_SECRET_FILE) or a `conveyor.data.service.Service`; `options`: `ServiceNode`'s."""
        files = split_files(self._node)
        return Dataset(ServiceNode(self._node, files, service, processing_mode, job_name, **options))

    def apply(self, transformation_func: Callable[[Dataset], Dataset]) -> Dataset:
        out = transformation_func(self)
        if not isinstance(out, Dataset):
            raise TypeError(f"apply() expects a function returning a Dataset, got {type(out).__name__}")
        return out


def TFRecordDataset(filenames: str | list[str] | Dataset, compression_type: str | None = None,
                    buffer_size: int | None = None, num_parallel_reads: int | None = None,
                    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> Dataset:
    """Records (`bytes`) of TFRecord files, read in order, or interleaved when
    `num_parallel_reads` > 1 (or AUTOTUNE). A record header claiming more than `max_record_bytes`
    (default 2 GiB) is a `DataLossError` before anything is read or inflated for it."""
    files = filenames if isinstance(filenames, Dataset) else Dataset.from_tensor_slices(
        [filenames] if isinstance(filenames, (str, bytes)) else list(filenames))
    if num_parallel_reads is None or num_parallel_reads == 1:
        return Dataset(TFRecordNode(files._node, compression_type, buffer_size, max_record_bytes))
    if num_parallel_reads != AUTOTUNE and num_parallel_reads < 1:
        raise InvalidArgumentError(f"num_parallel_reads must be positive or AUTOTUNE, got {num_parallel_reads}")
    return files.interleave(
        lambda f: TFRecordDataset(f, compression_type, buffer_size, max_record_bytes=max_record_bytes),
        cycle_length=num_parallel_reads, block_length=1, num_parallel_calls=num_parallel_reads)


def _returns_node(map_func: Callable[..., Dataset]) -> Callable[..., Node]:
    """Adapt a user function returning a Dataset into one returning its recipe (ops know no facade)."""

    def make(*args):
        ds = map_func(*args)
        if not isinstance(ds, Dataset):
            raise TypeError(
                f"interleave's map_func must return a Dataset, {getattr(map_func, '__qualname__', map_func)} "
                f"returned {type(ds).__name__}"
            )
        return ds._node

    make.__qualname__ = getattr(map_func, "__qualname__", "map_func")
    return make


def _optimize(node: Node) -> Node:
    """Rewrite the recipe before running it: a parallel map followed by batch becomes one fused
    op, so worker processes assemble whole batches and hand them over in shared memory."""
    inputs = tuple(_optimize(n) for n in node.inputs)
    if isinstance(node, BatchNode) and isinstance(inputs[0], MapNode) and inputs[0].fusable():
        m = inputs[0]
        return MapBatchNode(m, node.batch_size, node.drop_remainder)
    if inputs != node.inputs:
        node = node.with_inputs(inputs)
    return node
