"""The ``tf.train.Example`` family of protobuf messages, built at import time.

Why not generated ``*_pb2`` code: it ties the repository to one protoc/protobuf version pair and
adds a build step. Instead the schema of ``tensorflow/core/example/{feature,example}.proto``
(docs/tfdata-semantics.md §15) is spelled out below as a ``FileDescriptorProto`` and loaded into a *private*
descriptor pool. The file is named ``conveyor/tensorflow_example.proto`` and lives outside the
default pool, so importing TensorFlow in the same process (which registers the real
``tensorflow.Example`` in the default pool) cannot clash with it. The wire format is identical, so
bytes move freely between the two.
"""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

__all__ = [
    "BytesList",
    "Example",
    "Feature",
    "FeatureList",
    "FeatureLists",
    "Features",
    "FloatList",
    "Int64List",
    "SequenceExample",
]

_FILE_NAME = "conveyor/tensorflow_example.proto"
_PACKAGE = "tensorflow"

_F = descriptor_pb2.FieldDescriptorProto
_OPTIONAL, _REPEATED = _F.LABEL_OPTIONAL, _F.LABEL_REPEATED


def _field(
    msg,
    name: str,
    number: int,
    ftype: int,
    label: int = _OPTIONAL,
    type_name: str = "",
    packed: bool = False,
    oneof_index: int | None = None,
) -> None:
    field = msg.field.add(name=name, number=number, type=ftype, label=label)
    if type_name:
        field.type_name = f".{_PACKAGE}.{type_name}"
    if packed:
        field.options.packed = True
    if oneof_index is not None:
        field.oneof_index = oneof_index


def _map_field(msg, name: str, entry_name: str, value_type: str) -> None:
    """Declare ``map<string, value_type> name = 1`` the way protoc lowers it: a nested entry."""
    entry = msg.nested_type.add(name=entry_name)
    entry.options.map_entry = True
    _field(entry, "key", 1, _F.TYPE_STRING)
    _field(entry, "value", 2, _F.TYPE_MESSAGE, type_name=value_type)
    _field(msg, name, 1, _F.TYPE_MESSAGE, _REPEATED, type_name=f"{msg.name}.{entry_name}")


def _file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    fdp = descriptor_pb2.FileDescriptorProto(name=_FILE_NAME, package=_PACKAGE, syntax="proto3")

    m = fdp.message_type.add(name="BytesList")
    _field(m, "value", 1, _F.TYPE_BYTES, _REPEATED)
    m = fdp.message_type.add(name="FloatList")
    _field(m, "value", 1, _F.TYPE_FLOAT, _REPEATED, packed=True)
    m = fdp.message_type.add(name="Int64List")
    _field(m, "value", 1, _F.TYPE_INT64, _REPEATED, packed=True)

    m = fdp.message_type.add(name="Feature")
    m.oneof_decl.add(name="kind")
    _field(m, "bytes_list", 1, _F.TYPE_MESSAGE, type_name="BytesList", oneof_index=0)
    _field(m, "float_list", 2, _F.TYPE_MESSAGE, type_name="FloatList", oneof_index=0)
    _field(m, "int64_list", 3, _F.TYPE_MESSAGE, type_name="Int64List", oneof_index=0)

    m = fdp.message_type.add(name="Features")
    _map_field(m, "feature", "FeatureEntry", "Feature")
    m = fdp.message_type.add(name="FeatureList")
    _field(m, "feature", 1, _F.TYPE_MESSAGE, _REPEATED, type_name="Feature")
    m = fdp.message_type.add(name="FeatureLists")
    _map_field(m, "feature_list", "FeatureListEntry", "FeatureList")

    m = fdp.message_type.add(name="Example")
    _field(m, "features", 1, _F.TYPE_MESSAGE, type_name="Features")
    m = fdp.message_type.add(name="SequenceExample")
    _field(m, "context", 1, _F.TYPE_MESSAGE, type_name="Features")
    _field(m, "feature_lists", 2, _F.TYPE_MESSAGE, type_name="FeatureLists")
    return fdp


_POOL = descriptor_pool.DescriptorPool()
_POOL.Add(_file_descriptor())


def _message_class(name: str):
    descriptor = _POOL.FindMessageTypeByName(f"{_PACKAGE}.{name}")
    get_class = getattr(message_factory, "GetMessageClass", None)
    if get_class is not None:  # protobuf >= 4.21
        return get_class(descriptor)
    return message_factory.MessageFactory(_POOL).GetPrototype(descriptor)  # pragma: no cover


BytesList = _message_class("BytesList")
FloatList = _message_class("FloatList")
Int64List = _message_class("Int64List")
Feature = _message_class("Feature")
Features = _message_class("Features")
FeatureList = _message_class("FeatureList")
FeatureLists = _message_class("FeatureLists")
Example = _message_class("Example")
SequenceExample = _message_class("SequenceExample")
