"""Pipelines the data-service tests' workers build by name (``svc_pipelines:records``); files from $SVC_TEST_DIR."""

from __future__ import annotations

import os
import socket
import time

from conveyor.data import Dataset, TFRecordDataset

FILES, PER_FILE = 6, 10  # the test data: ids 0 .. FILES * PER_FILE - 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def record_id(record: bytes) -> int:
    return int(record.decode().split("-")[1])


def _files() -> Dataset:
    return Dataset.list_files(os.path.join(os.environ["SVC_TEST_DIR"], "part-*.tfrecord"), shuffle=False)


def records() -> Dataset:
    """Every record's id, in batches of 4."""
    return TFRecordDataset(_files()).map(record_id).batch(4)


def shuffled_records() -> Dataset:
    """Records shuffled without a seed: the order depends on the root seed."""
    return TFRecordDataset(_files()).shuffle(10).map(record_id).batch(4)


def records_batch8() -> Dataset:
    """The same records in batches of 8: a different pipeline."""
    return TFRecordDataset(_files()).map(record_id).batch(8)


def slow_id(record: bytes) -> int:
    time.sleep(0.05)  # a costly decode: the epoch lasts long enough to kill a worker in it
    return record_id(record)


def slow_records() -> Dataset:
    return TFRecordDataset(_files()).map(slow_id).batch(2)


def endless() -> Dataset:
    """More elements than any test reads: a producer far faster than its consumer."""
    return Dataset.range(10**9).batch(16)


def big_element(i: int):
    import numpy as np

    return np.full(BIG_ELEMENT_BYTES // 4, i, dtype=np.float32)


BIG_ELEMENT_BYTES = 4 << 20


def endless_big() -> Dataset:
    """Endless 4 MiB elements, each made in a few milliseconds: hundreds of times faster than a slow trainer."""
    return Dataset.range(10**9).map(big_element)
