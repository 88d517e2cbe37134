"""The input-pipeline benchmark's contenders: each returns records/s over `n_records` records after an
untimed warm-up, running the same per-record function over the same files (`pipeline.py` lists them).
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from conveyor.data import AUTOTUNE, Dataset, TFRecordDataset
from conveyor.data.records import TFRecordReader

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by file path
import harness as h  # noqa: E402
from machine import cpu_cores  # noqa: E402
from pipeline_workloads import Workload, file_pattern  # noqa: E402

CONTENDERS_SPEC = (  # round order, the same every round
    h.Contender("single_thread"),
    h.Contender("parallel_plain"),
    h.Contender("sequential", "old approach"),
    h.Contender("parallel", "new approach"),
    h.Contender("dataloader"),
    h.Contender("tfdata"),
)
CONTENDERS = tuple(c.name for c in CONTENDERS_SPEC)
SHOWN = {c.name: c.shown() for c in CONTENDERS_SPEC}

# ---------------------------------------------------------------------------------------------
# Contenders: each returns records/s over `n_records` records after an untimed warm-up.
# ---------------------------------------------------------------------------------------------


def batch_len(batch: Any) -> int:
    return int(batch[1].shape[0])


def _check_batch(batch: Any, wl: Workload, who: str) -> None:
    """The first batch of every contender: right shapes and dtypes (works for numpy, torch, tf)."""
    images, labels = batch[0], batch[1]
    n = batch_len(batch)
    shape = tuple(int(d) for d in images.shape)
    if shape != (n, 3, wl.crop, wl.crop) or "float32" not in str(images.dtype) or "int64" not in str(labels.dtype):
        raise AssertionError(f"{who}: unexpected batch {shape} {images.dtype} / {labels.dtype}")


class CpuProbe:
    """Where the CPU went during a measurement: this process tree versus everything else.

    The machines are shared and noisy; a sample taken while other processes ran is worth knowing
    about. `own_cores` is the CPU time of this process and its live children per wall second,
    `other_cores` the rest of the machine's busy time (other processes, interrupts), `steal_cores`
    the time the hypervisor gave to other guests. Children must be alive at both ends (they are:
    workers start during the warm-up and stop after the measurement).
    """

    def __init__(self) -> None:
        self._proc = psutil.Process()

    def _own(self) -> float:
        total = 0.0
        for p in (self._proc, *self._proc.children(recursive=True)):
            try:
                t = p.cpu_times()
            except psutil.Error:
                continue
            total += t.user + t.system
        return total

    @staticmethod
    def _machine() -> tuple[float, float]:
        t = psutil.cpu_times()
        busy = t.user + t.system + getattr(t, "nice", 0.0) + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
        return busy, getattr(t, "steal", 0.0)

    def __enter__(self) -> CpuProbe:
        self._t0 = time.perf_counter()
        self._own0 = self._own()
        self._busy0, self._steal0 = self._machine()
        return self

    def __exit__(self, *exc) -> None:
        wall = max(time.perf_counter() - self._t0, 1e-9)
        own = self._own() - self._own0
        busy, steal = self._machine()
        self.result = {"wall_s": wall, "own_cores": own / wall,
                       "other_cores": max(0.0, (busy - self._busy0) - own) / wall,
                       "steal_cores": (steal - self._steal0) / wall}


def _time_batches(it: Iterator, wl: Workload, n_records: int, warmup_batches: int, who: str,
                  info: dict | None = None) -> float:
    """Consume `warmup_batches` untimed, then batches until `n_records` records arrived: records/s.
    `info`, when given, receives the CPU accounting of the timed part."""
    for i in range(warmup_batches):
        batch = next(it)
        if i == 0:
            _check_batch(batch, wl, who)
    delivered = 0
    with CpuProbe() as probe:
        t0 = time.perf_counter()
        while delivered < n_records:
            batch = next(it)
            batch[0].shape  # touch  # noqa: B018
            delivered += batch_len(batch)
        seconds = time.perf_counter() - t0
    if info is not None:
        info.update(records=delivered, seconds=seconds, **probe.result)
    return delivered / seconds


def cycle_records(files: Sequence[str]) -> Iterator[bytes]:
    """The records of `files` in order, forever."""
    while True:
        for f in files:
            with TFRecordReader(f) as reader:
                yield from reader


def run_single_thread(files: Sequence[str], wl: Workload, n_records: int, warmup_batches: int = 2,
                      info: dict | None = None) -> float:
    fn = wl.fn
    records = cycle_records(files)
    for _ in range(warmup_batches * wl.batch_size):
        fn(next(records))
    with CpuProbe() as probe:
        t0 = time.perf_counter()
        for _ in range(n_records):
            image, _label = fn(next(records))
            image.shape  # noqa: B018
        seconds = time.perf_counter() - t0
    records.close()
    if info is not None:
        info.update(records=n_records, seconds=seconds, **probe.result)
    return n_records / seconds


def _plain_worker(files: Sequence[str], fn: Callable, n_records: int, warmup: int, seed: int,
                  start: Any, end: Any, conn: Any) -> None:
    try:
        np.random.seed(seed)
        records = cycle_records(files)
        for _ in range(warmup):
            fn(next(records))
        start.wait()
        t0 = time.perf_counter()
        for _ in range(n_records):
            image, _label = fn(next(records))
            image.shape  # noqa: B018
        conn.send((t0, time.perf_counter()))
    except BaseException as e:
        conn.send(f"{type(e).__name__}: {e}")
        start.abort()
        end.abort()
        raise
    end.wait()  # stay alive until the parent has read the CPU counters


def run_parallel_plain(files: Sequence[str], wl: Workload, n_records: int, warmup_batches: int = 2,
                       info: dict | None = None, processes: int | None = None) -> float:
    """Not a pipeline: `processes` (default: cores) independent forked processes, each running the
    plain single-thread loop over its share of the files, started together; no hand-over, no
    batching. What the machine really delivers on all cores at once, for comparison with the
    `cores x single_thread` limit (which assumes perfect scaling)."""
    procs = processes or cpu_cores()
    ctx = mp.get_context("fork")
    start, end = ctx.Barrier(procs + 1), ctx.Barrier(procs + 1)
    per = -(-n_records // procs)
    pipes, children = [], []
    for i in range(procs):
        recv, send = ctx.Pipe(duplex=False)
        share = list(files[i::procs]) or list(files)
        p = ctx.Process(target=_plain_worker, daemon=True,
                        args=(share, wl.fn, per, warmup_batches * wl.batch_size, 1000 + i, start, end, send))
        p.start()
        send.close()
        pipes.append(recv)
        children.append(p)
    try:
        try:
            start.wait(timeout=600)
            with CpuProbe() as probe:
                spans = [r.recv() for r in pipes]
            end.wait(timeout=60)
        except (threading.BrokenBarrierError, EOFError):
            spans = [r.recv() for r in pipes if r.poll(1)]
        failures = [x for x in spans if isinstance(x, str)]
        if failures or len(spans) < procs:
            raise RuntimeError("a plain-loop process failed: " + ("; ".join(failures) or "it exited"))
    finally:
        for p in children:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    seconds = max(t1 for _, t1 in spans) - min(t0 for t0, _ in spans)
    if info is not None:
        info.update(records=per * procs, seconds=seconds, **probe.result)
    return per * procs / seconds


def sequential_dataset(files: Sequence[str], wl: Workload) -> Dataset:
    return TFRecordDataset(list(files)).repeat().map(wl.fn).batch(wl.batch_size).prefetch(1)


def parallel_dataset(files_or_pattern: str | Sequence[str], wl: Workload, repeat: int | None = None) -> Dataset:
    """The new approach. `repeat=None` repeats forever (for fixed-size measurements)."""
    src = files_or_pattern if isinstance(files_or_pattern, str) else list(files_or_pattern)
    return (Dataset.list_files(src, shuffle=False).shard(1, 0)
            .interleave(lambda f: TFRecordDataset(f), cycle_length=4, block_length=1,
                        num_parallel_calls=AUTOTUNE)
            .repeat(repeat)
            .map(wl.fn, num_parallel_calls=AUTOTUNE)
            .batch(wl.batch_size)
            .prefetch(AUTOTUNE))


def run_sequential(files: Sequence[str], wl: Workload, n_records: int, warmup_batches: int = 2,
            info: dict | None = None) -> float:
    it = iter(sequential_dataset(files, wl))
    try:
        return _time_batches(it, wl, n_records, warmup_batches, "sequential", info)
    finally:
        it.close()


def run_parallel(files: Sequence[str], wl: Workload, n_records: int, warmup_batches: int = 2,
            info: dict | None = None, stats_out: dict | None = None) -> float:
    """`stats_out`, when given, receives conveyor's own per-stage statistics (`it.stats()`)."""
    it = iter(parallel_dataset(file_pattern(files), wl))
    try:
        rate = _time_batches(it, wl, n_records, warmup_batches, "parallel", info)
        if stats_out is not None:
            stats_out.clear()
            stats_out.update(it.stats())
        return rate
    finally:
        it.close()


class RecordFiles(IterableDataset):
    """DataLoader's way: each worker reads `files[worker_id::num_workers]` with conveyor's reader
    and yields `fn(record)`; forever when `repeat`."""

    def __init__(self, files: Sequence[str], fn: Callable, repeat: bool = True):
        self.files = list(files)
        self.fn = fn
        self.repeat = repeat

    def __iter__(self):
        info = get_worker_info()
        files = self.files if info is None else self.files[info.id::info.num_workers]
        if not files:
            return
        while True:
            for f in files:
                with TFRecordReader(f) as reader:
                    for record in reader:
                        yield self.fn(record)
            if not self.repeat:
                return


def run_dataloader(files: Sequence[str], wl: Workload, n_records: int, warmup_batches: int = 2,
                   info: dict | None = None, num_workers: int = 2) -> float:
    loader = DataLoader(RecordFiles(files, wl.fn), batch_size=wl.batch_size, num_workers=num_workers,
                        persistent_workers=False)
    it = iter(loader)
    try:
        return _time_batches(it, wl, n_records, warmup_batches, "dataloader", info)
    except BaseException:
        # After re-raising a worker's exception, torch sends its workers no shutdown word: each waits for one
        # on its index queue until its 5-second status check, and the iterator's __del__ joins them one by one.
        for worker in getattr(it, "_workers", ()):
            worker.terminate()
        raise
    finally:
        del it  # shuts the workers down (refcount -> _MultiProcessingDataLoaderIter.__del__)


def tensorflow_available() -> bool:
    return importlib.util.find_spec("tensorflow") is not None


def run_tfdata(files: Sequence[str], wl: Workload, n_records: int, warmup_batches: int = 2,
               info: dict | None = None) -> float:
    """tf.data's new approach over the same files with the same Python function (numpy_function)."""
    import tensorflow as tf

    fn = wl.fn

    def np_fn(record):
        if isinstance(record, np.ndarray):
            record = record.item()
        return fn(bytes(record))

    def tf_fn(record):
        image, label = tf.numpy_function(np_fn, [record], [tf.float32, tf.int64], stateful=True)
        image.set_shape((3, wl.crop, wl.crop))
        label.set_shape(())
        return image, label

    ds = (tf.data.Dataset.list_files(file_pattern(files), shuffle=False).shard(1, 0)
          .interleave(tf.data.TFRecordDataset, cycle_length=4, block_length=1,
                      num_parallel_calls=tf.data.AUTOTUNE)
          .repeat()
          .map(tf_fn, num_parallel_calls=tf.data.AUTOTUNE)
          .batch(wl.batch_size)
          .prefetch(tf.data.AUTOTUNE))
    return _time_batches(iter(ds), wl, n_records, warmup_batches, "tfdata", info)


