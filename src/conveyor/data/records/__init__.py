"""TFRecord files and ``tf.train.Example`` records, byte-compatible with TensorFlow.

See docs/tfdata-semantics.md §13–§16 for the formats. ``tfrecord`` handles framing, compression, verified
reading with resumable offsets and record indexes; ``example`` encodes and parses Examples into
numpy; ``crc`` holds the masked CRC-32C both sides rely on.
"""

from conveyor.data.errors import DataLossError

from ._proto import (
    BytesList,
    Example,
    Feature,
    FeatureList,
    FeatureLists,
    Features,
    FloatList,
    Int64List,
    SequenceExample,
)
from .crc import crc32c, mask, masked_crc32c, unmask
from .example import (
    FixedLenFeature,
    VarLenFeature,
    decode_example,
    encode_example,
    parse_example,
    parse_single_example,
)
from .tfrecord import (
    COMPRESSION_TYPES,
    DEFAULT_MAX_RECORD_BYTES,
    TFRecordReader,
    TFRecordWriter,
    build_index,
    count_records,
    default_index_path,
    detect_compression,
    not_regular,
    read_index,
    read_records,
    write_index,
)

__all__ = [
    "COMPRESSION_TYPES",
    "DEFAULT_MAX_RECORD_BYTES",
    "BytesList",
    "DataLossError",
    "Example",
    "Feature",
    "FeatureList",
    "FeatureLists",
    "Features",
    "FixedLenFeature",
    "FloatList",
    "Int64List",
    "SequenceExample",
    "TFRecordReader",
    "TFRecordWriter",
    "VarLenFeature",
    "build_index",
    "count_records",
    "crc32c",
    "decode_example",
    "default_index_path",
    "detect_compression",
    "encode_example",
    "mask",
    "masked_crc32c",
    "not_regular",
    "parse_example",
    "parse_single_example",
    "read_index",
    "read_records",
    "unmask",
    "write_index",
]
