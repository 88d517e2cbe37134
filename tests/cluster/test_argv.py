"""TensorFlow 1's cluster flags on a task's own command line: what conveyor.init() makes of them (pure)."""

from __future__ import annotations

import pytest

from conveyor.cluster import ClusterConfigError, ClusterSpec, TaskId, discover
from conveyor.cluster.argv import cluster_flags_in, discover_with_flags

SPEC = ClusterSpec(worker=("h1:2222", "h2:2222"), ps=("h9:2222",))
FLAGS = ["--ps_hosts=h9:2222", "--worker_hosts", "h1:2222,h2:2222", "--job_name=worker", "--task_index", "1"]


def test_no_flags_no_cluster_and_the_environment_decides():
    assert cluster_flags_in(["--epochs", "3", "--", "--job_name=worker"]) is None
    assert discover_with_flags(["--epochs", "3"], {}) == discover({})


def test_both_spellings_give_the_task_and_its_cluster():
    assert cluster_flags_in(["--lr", "0.1", *FLAGS]) == (SPEC, TaskId("worker", 1))


def test_a_hand_launched_worker_is_a_member_of_the_job_not_a_single_process():
    found = discover_with_flags(FLAGS, {"PATH": "/bin"})
    assert (found.source, found.task, found.spec) == ("tf_flags", TaskId("worker", 1), SPEC)
    assert (found.rank, found.world_size) == (1, 2)
    assert (found.master_addr, found.master_port) == ("h1", 2222)  # rank 0's address, as with TF_CONFIG


def test_job_name_ps_is_a_parameter_server():
    found = discover_with_flags(["--ps_hosts=h9:2222", "--worker_hosts=h1:2222,h2:2222", "--job_name=ps",
                                 "--task_index=0"], {"CONVEYOR_JOB_SECRET": "ab" * 16})
    assert (found.task, found.rank, found.world_size, found.secret) == (TaskId("ps", 0), None, 2, b"\xab" * 16)


@pytest.mark.parametrize("argv, missing", [
    (["--job_name=worker", "--worker_hosts=h1:2222"], "not --task_index"),
    (["--task_index=0"], "not --worker_hosts, --job_name"),
    (["--ps_hosts=h9:2222", "--worker_hosts=h1:2222"], "not --job_name, --task_index"),
])
def test_a_partial_set_is_refused_naming_what_is_missing(argv, missing):
    with pytest.raises(ClusterConfigError, match=missing) as e:
        cluster_flags_in(argv)
    assert "--worker_hosts=h1:2222,h2:2222 --job_name=worker --task_index=1" in str(e.value)  # an example


def test_flags_and_a_launchers_environment_must_agree():
    env = {"TF_CONFIG": SPEC.to_tf_config("worker", 1)}
    assert discover_with_flags(FLAGS, env) == discover(env)
    with pytest.raises(ClusterConfigError, match=r"task worker:1 .* makes it worker:0"):
        discover_with_flags(FLAGS, {"TF_CONFIG": SPEC.to_tf_config("worker", 0)})
    with pytest.raises(ClusterConfigError, match="torchrun"):
        discover_with_flags(FLAGS, {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h1", "MASTER_PORT": "29500"})
