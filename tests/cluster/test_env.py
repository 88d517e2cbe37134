"""Hosts → task placement → environment dicts, compared by exact equality (STYLE habit 6)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conveyor.cluster import (
    ClusterConfigError,
    ClusterSpec,
    TaskId,
    TaskSlot,
    assign_hosts,
    discover,
    local_cluster,
    task_environment,
)

SECRET = bytes(range(16))
SECRET_HEX = "000102030405060708090a0b0c0d0e0f"
CLUSTER = '{"cluster": {"worker": ["127.0.0.1:23001", "127.0.0.1:23002"], "ps": ["127.0.0.1:23003"]}, '


def environment(spec, task, **overrides):
    kwargs = dict(secret=SECRET, data_dir=Path("/data/digits"), output_dir="/out/run1", master_addr="127.0.0.1",
                  master_port=23010, strategy="ps-async")
    kwargs.update(overrides)
    return task_environment(spec, task, **kwargs)


# -- local_cluster -----------------------------------------------------------------------------------


def test_local_cluster():
    spec = local_cluster(num_workers=2, num_ps=1, ports=[23001, 23002, 23003])
    assert spec == ClusterSpec(worker=("127.0.0.1:23001", "127.0.0.1:23002"), ps=("127.0.0.1:23003",))


def test_local_cluster_with_chief_keeps_world_size():
    spec = local_cluster(3, 2, [1, 2, 3, 4, 5], host="localhost", chief=True)
    assert spec == ClusterSpec(chief=("localhost:1",), worker=("localhost:2", "localhost:3"),
                               ps=("localhost:4", "localhost:5"))
    assert spec.world_size == 3


def test_local_cluster_ipv6():
    assert local_cluster(1, 0, [5000], host="::1") == ClusterSpec(worker=("[::1]:5000",))


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        ((2, 1, [1, 2]), r"ports has 2 entries for 2 workers \+ 1 ps; expected exactly 3"),
        ((0, 1, [1]), r"num_workers = 0; expected at least 1"),
        ((1, -1, [1]), r"num_ps = -1"),
        ((2, 0, [1, 70000]), r"ports\[1\] = 70000; expected a port number 1-65535"),
        ((2, 0, [5, 5]), r"ClusterSpec\.worker\[1\] = '127\.0\.0\.1:5' is also ClusterSpec\.worker\[0\]"),
    ],
)
def test_local_cluster_errors(args, pattern):
    with pytest.raises(ClusterConfigError, match=pattern):
        local_cluster(*args)


# -- task_environment ----------------------------------------------------------------------------------


def test_worker_environment():
    spec = local_cluster(2, 1, [23001, 23002, 23003])
    assert environment(spec, TaskId("worker", 1), local_rank=1, local_world_size=2) == {
        "TF_CONFIG": CLUSTER + '"task": {"type": "worker", "index": 1}}',
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "23010",
        "CONVEYOR_TASK_TYPE": "worker",
        "CONVEYOR_TASK_INDEX": "1",
        "CONVEYOR_STRATEGY": "ps-async",
        "CONVEYOR_DATA_DIR": "/data/digits",
        "CONVEYOR_OUTPUT_DIR": "/out/run1",
        "CONVEYOR_JOB_SECRET": SECRET_HEX,
    }


def test_ps_environment_has_no_torch_variables():
    spec = local_cluster(2, 1, [23001, 23002, 23003])
    assert environment(spec, TaskId("ps", 0)) == {
        "TF_CONFIG": CLUSTER + '"task": {"type": "ps", "index": 0}}',
        "CONVEYOR_TASK_TYPE": "ps",
        "CONVEYOR_TASK_INDEX": "0",
        "CONVEYOR_STRATEGY": "ps-async",
        "CONVEYOR_DATA_DIR": "/data/digits",
        "CONVEYOR_OUTPUT_DIR": "/out/run1",
        "CONVEYOR_JOB_SECRET": SECRET_HEX,
    }


def test_chief_is_rank_zero():
    spec = local_cluster(2, 0, [1, 2], chief=True)
    env = environment(spec, TaskId("chief", 0), strategy="allreduce")
    assert (env["RANK"], env["WORLD_SIZE"], env["CONVEYOR_TASK_TYPE"]) == ("0", "2", "chief")
    assert environment(spec, TaskId("worker", 0), strategy="allreduce")["RANK"] == "1"


def test_every_environment_discovers_back_to_its_task():
    """What the launcher writes, discovery reads back: the two halves of one contract."""
    spec = local_cluster(3, 2, [1, 2, 3, 4, 5], chief=True)
    for task in spec.tasks:
        found = discover(environment(spec, task))
        assert (found.source, found.spec, found.task) == ("conveyor", spec, task)
        assert found.rank == (spec.rank_of(task) if task.is_training else None)
        assert (found.strategy, found.data_dir, found.output_dir, found.secret) == (
            "ps-async", "/data/digits", "/out/run1", SECRET)


@pytest.mark.parametrize(
    ("task", "overrides", "pattern"),
    [
        (TaskId("worker", 2), {}, r"task\.index = 2 is out of range.*0\.\.1"),
        (TaskId("chief", 0), {}, r"task\.type = 'chief' but the cluster has no 'chief' job"),
        (TaskId("worker", 0), {"secret": b""}, r"secret must be non-empty bytes.*got empty bytes"),
        (TaskId("worker", 0), {"secret": "00ff"}, r"secret must be non-empty bytes.*got str$"),
        (TaskId("worker", 0), {"strategy": " "}, r"strategy = ' '"),
        (TaskId("worker", 0), {"master_addr": "[::1]"}, r"master_addr = '\[::1\]'; expected a bare host"),
        (TaskId("worker", 0), {"master_addr": ""}, r"master_addr = ''"),
        (TaskId("worker", 0), {"master_port": 0}, r"master_port = 0; expected a port number 1-65535"),
        (TaskId("worker", 0), {"local_world_size": 3}, r"local_world_size = 3; expected 1\.\.2"),
        (TaskId("worker", 0), {"local_rank": 1}, r"local_rank = 1; expected 0\.\.0"),
    ],
)
def test_task_environment_errors(task, overrides, pattern):
    spec = local_cluster(2, 1, [23001, 23002, 23003])
    with pytest.raises(ClusterConfigError, match=pattern):
        environment(spec, task, **overrides)


# -- assign_hosts ----------------------------------------------------------------------------------


def test_assign_hosts_fills_host_by_host():
    assert assign_hosts([("a", 2), ("b", 2), ("c", 4)], num_workers=5, num_ps=0) == {
        "a": (TaskSlot("a", TaskId("worker", 0), 0, 0, 0, 2), TaskSlot("a", TaskId("worker", 1), 0, 1, 1, 2)),
        "b": (TaskSlot("b", TaskId("worker", 2), 1, 2, 0, 2), TaskSlot("b", TaskId("worker", 3), 1, 3, 1, 2)),
        "c": (TaskSlot("c", TaskId("worker", 4), 2, 4, 0, 1),),
    }


def test_assign_hosts_ps_round_robin_without_slots_and_chief():
    assert assign_hosts([("a", 2), ("b", 1), ("c", 1)], num_workers=3, num_ps=4, chief=True) == {
        "a": (
            TaskSlot("a", TaskId("chief", 0), 0, 0, 0, 2),
            TaskSlot("a", TaskId("worker", 0), 0, 1, 1, 2),
            TaskSlot("a", TaskId("ps", 0), 0),
            TaskSlot("a", TaskId("ps", 3), 0),
        ),
        "b": (TaskSlot("b", TaskId("worker", 1), 1, 2, 0, 1), TaskSlot("b", TaskId("ps", 1), 1)),
        "c": (TaskSlot("c", TaskId("ps", 2), 2),),
    }


def test_assign_hosts_leaves_out_idle_hosts():
    assert assign_hosts([("a", 4), ("b", 4)], num_workers=2, num_ps=0) == {
        "a": (TaskSlot("a", TaskId("worker", 0), 0, 0, 0, 2), TaskSlot("a", TaskId("worker", 1), 0, 1, 1, 2)),
    }


@pytest.mark.parametrize(
    ("hosts", "workers", "pattern"),
    [
        ([("a", 2), ("b", 1)], 4, r"4 workers do not fit in 3 slots on 2 hosts"),
        ([], 1, r"hosts is empty"),
        ([("a", 0)], 1, r"hosts\[0\] \(a\) has slots = 0; expected an integer >= 1"),
        ([("a", 1), ("A", 1)], 1, r"hosts\[1\] = 'A' is listed twice"),
        ([("a b", 1)], 1, r"hosts\[0\] host = 'a b'"),
        (["a"], 1, r"hosts\[0\] = 'a'; expected a \(host, slots\) pair"),
        ([("a", 1)], 0, r"num_workers = 0"),
    ],
)
def test_assign_hosts_errors(hosts, workers, pattern):
    with pytest.raises(ClusterConfigError, match=pattern):
        assign_hosts(hosts, workers, 0)
