"""ClusterSpec, TaskId and TF_CONFIG: TensorFlow's exact shape both ways, and every malformed case named."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.cluster import (
    ClusterConfigError,
    ClusterSpec,
    TaskId,
    join_address,
    parse_tf_config,
    split_address,
)

# The example from TensorFlow's docs for tf.distribute (run_standard_tensorflow_server, TF 1.15), verbatim.
TF_DOCS_TF_CONFIG = (
    '{ "cluster": { "worker": ["host1:2222", "host2:2222", "host3:2222"], "ps": ["host4:2222", "host5:2222"] }, '
    '"task": {"type": "worker", "index": 1} }'
)


def full_spec() -> ClusterSpec:
    return ClusterSpec(chief=("c0:2222",), worker=("w0:2222", "w1:2222"), ps=("p0:2222",))


# -- TF_CONFIG: TensorFlow's examples and exact shape --------------------------------------------------


def test_tf_docs_example_parses():
    spec, task = parse_tf_config(TF_DOCS_TF_CONFIG)
    assert spec == ClusterSpec(worker=("host1:2222", "host2:2222", "host3:2222"), ps=("host4:2222", "host5:2222"))
    assert task == TaskId("worker", 1)
    assert spec.world_size == 3 and spec.rank_of(task) == 1
    assert ClusterSpec.from_tf_config(TF_DOCS_TF_CONFIG) == spec


def test_tf_config_cluster_resolver_example_as_dict():
    # TFConfigClusterResolver's docstring builds TF_CONFIG with json.dumps of this dict.
    doc = {"cluster": {"worker": ["localhost:12345", "localhost:23456"]}, "task": {"type": "worker", "index": 0}}
    spec, task = parse_tf_config(doc)
    assert spec.as_dict() == {"worker": ["localhost:12345", "localhost:23456"]}
    assert task == TaskId("worker", 0)
    assert spec.to_tf_config("worker", 0) == json.dumps(doc)


def test_emit_is_tensorflows_exact_text():
    spec = full_spec()
    assert spec.to_tf_config("worker", 1) == (
        '{"cluster": {"chief": ["c0:2222"], "worker": ["w0:2222", "w1:2222"], "ps": ["p0:2222"]}, '
        '"task": {"type": "worker", "index": 1}}'
    )
    assert json.loads(spec.to_tf_config("ps", 0)) == {
        "cluster": {"chief": ["c0:2222"], "worker": ["w0:2222", "w1:2222"], "ps": ["p0:2222"]},
        "task": {"type": "ps", "index": 0},
    }


def test_emit_lists_only_jobs_with_tasks():
    spec = ClusterSpec(worker=("w0:1",))
    assert json.loads(spec.to_tf_config("worker", 0)) == {
        "cluster": {"worker": ["w0:1"]},
        "task": {"type": "worker", "index": 0},
    }


def test_round_trip_every_task():
    spec = full_spec()
    for task in spec.tasks:
        assert parse_tf_config(spec.to_tf_config(task.type, task.index)) == (spec, task)


def test_evaluator_may_be_absent_from_the_cluster():
    spec = full_spec()
    text = spec.to_tf_config("evaluator", 0)
    assert json.loads(text)["cluster"] == spec.as_dict()
    assert parse_tf_config(text) == (spec, TaskId("evaluator", 0))
    with pytest.raises(ClusterConfigError, match=r"TF_CONFIG\.task\.index = 1 is out of range.*0\.\.0"):
        parse_tf_config({"cluster": spec.as_dict(), "task": {"type": "evaluator", "index": 1}})


def test_evaluator_in_the_cluster_round_trips():
    spec = ClusterSpec(worker=("w0:1",), evaluator=("e0:1",))
    assert parse_tf_config(spec.to_tf_config("evaluator", 0)) == (spec, TaskId("evaluator", 0))
    assert spec.jobs == ("worker", "evaluator")


def test_extra_keys_and_string_index_are_accepted_like_tensorflow():
    doc = {
        "cluster": {"worker": ["w0:1", "w1:1"]},
        "task": {"type": "worker", "index": "1"},  # TFConfigClusterResolver calls int() on it
        "rpc_layer": "grpc",
        "environment": "cloud",
    }
    assert parse_tf_config(doc) == (ClusterSpec(worker=("w0:1", "w1:1")), TaskId("worker", 1))
    assert parse_tf_config({"cluster": {"chief": ["c:1"]}, "task": {"type": "chief"}})[1] == TaskId("chief", 0)


job_sizes = st.tuples(st.integers(0, 1), st.integers(0, 5), st.integers(0, 4), st.integers(0, 1))
hosts = st.one_of(
    st.integers(0, 999).map(lambda i: f"node{i:02d}"),
    st.sampled_from(["localhost", "Node01", "w-0.svc.cluster.local", "10.0.0.5", "::1", "fe80::1", "2001:db8::7"]),
)


@st.composite
def clusters(draw) -> ClusterSpec:
    sizes = draw(job_sizes.filter(lambda s: s[0] + s[1] > 0))
    n = sum(sizes)
    addresses = draw(
        st.lists(st.tuples(hosts, st.integers(1, 65535)), min_size=n, max_size=n,
                 unique_by=lambda hp: (hp[0].lower(), hp[1]))
    )
    addresses = [join_address(h, p) for h, p in addresses]
    jobs, start = {}, 0
    for job, size in zip(("chief", "worker", "ps", "evaluator"), sizes, strict=True):
        jobs[job] = tuple(addresses[start:start + size])
        start += size
    return ClusterSpec(**jobs)


@settings(max_examples=40, deadline=None)
@given(clusters(), st.data())
def test_random_clusters_round_trip(spec, data):
    task = data.draw(st.sampled_from(spec.tasks))
    text = spec.to_tf_config(task.type, task.index)
    doc = json.loads(text)
    assert list(doc) == ["cluster", "task"]
    assert list(doc["cluster"]) == list(spec.jobs)
    assert doc["task"] == {"type": task.type, "index": task.index}
    assert parse_tf_config(text) == (spec, task)
    assert ClusterSpec.from_tf_config(doc) == spec
    assert [spec.rank_of(t) for t in spec.training_tasks] == list(range(spec.world_size))


# -- ranks and reading ---------------------------------------------------------------------------------


def test_ranks_chief_first_then_workers():
    spec = full_spec()
    assert spec.world_size == 3
    assert spec.training_tasks == (TaskId("chief", 0), TaskId("worker", 0), TaskId("worker", 1))
    assert [spec.rank_of(t) for t in spec.training_tasks] == [0, 1, 2]
    no_chief = ClusterSpec(worker=("w0:1", "w1:1"), ps=("p0:1",))
    assert no_chief.rank_of(TaskId("worker", 0)) == 0 and no_chief.world_size == 2
    with pytest.raises(ClusterConfigError, match=r"task ps:0 has no training rank"):
        spec.rank_of(TaskId("ps", 0))


def test_reading():
    spec = full_spec()
    assert spec.jobs == ("chief", "worker", "ps")
    assert spec.as_dict() == {"chief": ["c0:2222"], "worker": ["w0:2222", "w1:2222"], "ps": ["p0:2222"]}
    assert (spec.num_tasks("worker"), spec.num_tasks("ps"), spec.num_tasks("evaluator")) == (2, 1, 0)
    assert spec.task_address("worker", 1) == "w1:2222"
    assert spec.tasks == (TaskId("chief", 0), TaskId("worker", 0), TaskId("worker", 1), TaskId("ps", 0))
    assert str(TaskId("worker", 1)) == "worker:1"
    with pytest.raises(ClusterConfigError, match=r"task\.index = 2 is out of range.*0\.\.1"):
        spec.task_address("worker", 2)
    with pytest.raises(ClusterConfigError, match=r"unknown job 'master'"):
        spec.num_tasks("master")


def test_lists_become_tuples_and_spec_is_hashable():
    spec = ClusterSpec(worker=["w0:1", "w1:1"])
    assert spec.worker == ("w0:1", "w1:1")
    assert hash(spec) == hash(ClusterSpec(worker=("w0:1", "w1:1")))


def test_from_hosts():
    spec = ClusterSpec.from_hosts(ps_hosts="p0:2222,p1:2222", worker_hosts="w0:2222, w1:2222")
    assert spec == ClusterSpec(worker=("w0:2222", "w1:2222"), ps=("p0:2222", "p1:2222"))
    assert ClusterSpec.from_hosts("", "w0:1", chief_hosts=["c:1"]) == ClusterSpec(chief=("c:1",), worker=("w0:1",))
    with pytest.raises(ClusterConfigError, match=r"worker_hosts\[1\] is empty.*stray comma"):
        ClusterSpec.from_hosts(worker_hosts="w0:1,,w2:1")
    with pytest.raises(ClusterConfigError, match=r"worker_hosts is empty"):
        ClusterSpec.from_hosts(ps_hosts="", worker_hosts="")
    with pytest.raises(ClusterConfigError, match=r"^ps_hosts\[0\] = 'p0' is not an address: the port is missing"):
        ClusterSpec.from_hosts(ps_hosts="p0", worker_hosts="w0:1")


# -- addresses ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("node01:2222", ("node01", 2222)),
        ("10.0.0.5:1", ("10.0.0.5", 1)),
        ("[::1]:2222", ("::1", 2222)),
        ("[fe80::1%eth0]:65535", ("fe80::1%eth0", 65535)),
        ("w-0.svc.cluster.local:2222", ("w-0.svc.cluster.local", 2222)),
    ],
)
def test_split_address(address, expected):
    assert split_address(address) == expected
    assert split_address(join_address(*expected)) == expected


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("host", "the port is missing"),
        (":2222", "the host is empty"),
        ("[]:2222", "the host is empty"),
        ("host:", "the port is empty"),
        ("host:http", "the port 'http' is not a number"),
        ("host:0", "port 0 is out of range 1-65535"),
        ("host:65536", "port 65536 is out of range 1-65535"),
        ("::1:2222", "an IPv6 host must be in brackets"),
        ("grpc://host:2222", "drop the scheme"),
        ("my host:2222", "character that is not allowed"),
        ("", "it is empty"),
    ],
)
def test_bad_addresses_name_the_field_and_the_shape(address, why):
    with pytest.raises(ClusterConfigError, match=r"^TF_CONFIG\.cluster\.worker\[1\] = .*") as info:
        parse_tf_config({"cluster": {"worker": ["ok:1", address]}, "task": {"type": "worker", "index": 0}})
    assert why in str(info.value)
    assert '"host:port"' in str(info.value)


# -- malformed TF_CONFIG ------------------------------------------------------------------------------


def test_bad_json_shows_position_and_example():
    text = '{"cluster": {"worker": ["w0:1" "w1:1"]}, "task": {"type": "worker", "index": 0}}'
    with pytest.raises(ClusterConfigError, match=r"not valid JSON: Expecting ',' delimiter at line 1 column 32 "
                                                 r"\(char 31\)") as info:
        parse_tf_config(text)
    lines = str(info.value).splitlines()
    assert lines[2].index("^") - 2 == lines[1][2:].index('"w1:1"')  # the caret points at the bad token
    assert '"task": {"type": "worker", "index": 0}' in lines[3]


@pytest.mark.parametrize(
    ("doc", "pattern"),
    [
        ("[1, 2]", r"TF_CONFIG is a JSON list, not an object"),
        ({"task": {"type": "worker"}}, r"TF_CONFIG\.cluster is missing"),
        ({"cluster": ["w0:1"]}, r"TF_CONFIG\.cluster = \['w0:1'\] is not an object"),
        ({"cluster": {}}, r"TF_CONFIG\.cluster has no tasks"),
        ({"cluster": {"worker": []}}, r"TF_CONFIG\.cluster has no tasks"),
        ({"cluster": {"master": ["m:1"]}}, r"TF_CONFIG\.cluster\.master: unknown job 'master' \('master' is "),
        ({"cluster": {"workers": ["w:1"]}}, r"TF_CONFIG\.cluster\.workers: unknown job 'workers'.*\"chief\", "),
        ({"cluster": {"worker": "w0:1"}}, r"TF_CONFIG\.cluster\.worker = 'w0:1' is not a list of addresses"),
        ({"cluster": {"worker": {"0": "w0:1"}}}, r"TF_CONFIG\.cluster\.worker is a mapping.*dense form"),
        ({"cluster": {"worker": ["w0:1", 2222]}}, r"TF_CONFIG\.cluster\.worker\[1\] must be a string \"host:port\""),
        ({"cluster": {"worker": ["w0:1"], "ps": ["w0:1"]}},
         r"TF_CONFIG\.cluster\.ps\[0\] = 'w0:1' is also TF_CONFIG\.cluster\.worker\[0\]"),
        ({"cluster": {"worker": ["W0:1", "w0:1"]}}, r"worker\[1\] = 'w0:1' is also TF_CONFIG\.cluster\.worker\[0\]"),
        ({"cluster": {"chief": ["c0:1", "c1:1"]}},
         r"TF_CONFIG\.cluster\.chief has 2 addresses; there is at most one chief.*\"chief\": \[\"c0:1\"\]"),
        ({"cluster": {"worker": ["w:1"], "evaluator": ["e0:1", "e1:1"]}},
         r"TF_CONFIG\.cluster\.evaluator has 2 addresses; there is at most one evaluator"),
    ],
)
def test_bad_cluster(doc, pattern):
    with pytest.raises(ClusterConfigError, match=pattern):
        ClusterSpec.from_tf_config(doc)


@pytest.mark.parametrize(
    ("task", "pattern"),
    [
        (None, r"TF_CONFIG\.task is missing.*\"task\": \{\"type\": \"worker\", \"index\": 0\}"),
        ("worker", r"TF_CONFIG\.task = 'worker'; expected an object"),
        ({"index": 0}, r"TF_CONFIG\.task\.type is missing; expected one of \"chief\", \"worker\""),
        ({"type": "master", "index": 0}, r"TF_CONFIG\.task\.type = 'master' is not a job"),
        ({"type": "chief", "index": 0}, r"TF_CONFIG\.task\.type = 'chief' but the cluster has no 'chief' job; the "
                                        r"cluster's jobs are \"worker\", \"ps\""),
        ({"type": "worker", "index": 2}, r"TF_CONFIG\.task\.index = 2 is out of range: the cluster has 2 'worker' "
                                         r"tasks, so the index is 0\.\.1"),
        ({"type": "ps", "index": 1}, r"TF_CONFIG\.task\.index = 1 is out of range: the cluster has 1 'ps' task, "
                                     r"so the index is 0\.\.0"),
        ({"type": "worker", "index": -1}, r"TF_CONFIG\.task\.index = -1; expected an integer >= 0"),
        ({"type": "worker", "index": True}, r"TF_CONFIG\.task\.index = True; expected an integer >= 0"),
        ({"type": "worker", "index": "one"}, r"TF_CONFIG\.task\.index = 'one'"),
    ],
)
def test_bad_task(task, pattern):
    doc = {"cluster": {"worker": ["w0:1", "w1:1"], "ps": ["p0:1"]}}
    if task is not None:
        doc["task"] = task
    with pytest.raises(ClusterConfigError, match=pattern):
        parse_tf_config(doc)


def test_direct_construction_is_validated_too():
    with pytest.raises(ClusterConfigError, match=r"ClusterSpec\.worker\[0\] = 'w0' is not an address"):
        ClusterSpec(worker=("w0",))
    with pytest.raises(ClusterConfigError, match=r"ClusterSpec\.worker = 'w0:1' is not a list"):
        ClusterSpec(worker="w0:1")
    with pytest.raises(ClusterConfigError, match=r"at least one task"):
        ClusterSpec()
    with pytest.raises(ClusterConfigError, match=r"TaskId\.type = 'boss' is not a job"):
        TaskId("boss", 0)
    with pytest.raises(ClusterConfigError, match=r"TaskId\.index = -1"):
        TaskId("worker", -1)


def test_error_is_a_value_error():
    assert issubclass(ClusterConfigError, ValueError)
    with pytest.raises(ValueError):
        parse_tf_config("{")
    with pytest.raises(ClusterConfigError, match=r"TF_CONFIG must be a JSON string or a dict; got int"):
        parse_tf_config(3)
