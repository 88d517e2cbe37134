"""Fuzz target: TF_CONFIG text → ``parse_tf_config``; oracle: bad input is only ever a ClusterConfigError,
and whatever parses is re-emitted by ``to_tf_config`` as text that parses back to the same cluster and task."""

import _common

from conveyor.cluster import ClusterConfigError, ClusterSpec, parse_tf_config

EXPECTED = (ClusterConfigError,)

SEEDS = [
    b'{"cluster": {"chief": ["c0:2222"], "worker": ["w0:2222", "w1:2222"], "ps": ["p0:2222"]}, '
    b'"task": {"type": "worker", "index": 1}}',
    b'{ "cluster": { "worker": ["host1:2222", "host2:2222"], "ps": ["[::1]:2222"] }, "task": {"type": "ps"} }',
    b'{"cluster": {"worker": ["10.0.0.5:2222"]}, "task": {"type": "evaluator", "index": "0"}, "rpc_layer": "grpc",'
    b' "environment": "cloud"}',
    b'{"cluster": {"worker": ["localhost:1", "127.0.0.1:2"]}, "task": {"type": "worker", "index": 0}}',
    b'{"cluster": {"worker": ["w:1"]}, "task": {"type": "worker", "index": 0, "x": \x00[\x01\x00]\x01}}',
    b'{"cluster": {"worker": ["w:1"]}, "task": {"type": "worker", "index": "\x000\x04"}}',
]


def target(data: bytes) -> None:
    """Parse ``data`` as TF_CONFIG (decoded as os.environ decodes it); check the round trip when it parses."""
    text = _common.expand_runs(data.decode("utf-8", "surrogateescape"))
    spec, task = parse_tf_config(text)
    emitted = spec.to_tf_config(task.type, task.index)
    assert parse_tf_config(emitted) == (spec, task), emitted
    assert ClusterSpec.from_tf_config(text) == spec
    assert spec.to_tf_config(task.type, task.index) == emitted
    if task.is_training:
        assert 0 <= spec.rank_of(task) < spec.world_size
