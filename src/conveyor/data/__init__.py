"""conveyor.data: tf.data's input pipeline for PyTorch users, over TFRecord files.

    from conveyor.data import AUTOTUNE, Dataset, TFRecordDataset
"""

from conveyor.data.base import AUTOTUNE, DatasetIterator, set_seed
from conveyor.data.errors import DataLossError, InvalidArgumentError, StateError, StateMismatchError
from conveyor.data.pipeline import Dataset, TFRecordDataset
from conveyor.data.records import (
    FixedLenFeature,
    TFRecordWriter,
    VarLenFeature,
    decode_example,
    encode_example,
    parse_single_example,
)
from conveyor.data.workers import WorkerDied

__all__ = [
    "AUTOTUNE",
    "DataLossError",
    "Dataset",
    "DatasetIterator",
    "FixedLenFeature",
    "InvalidArgumentError",
    "StateError",
    "StateMismatchError",
    "TFRecordDataset",
    "TFRecordWriter",
    "VarLenFeature",
    "WorkerDied",
    "decode_example",
    "encode_example",
    "parse_single_example",
    "set_seed",
]
