"""TensorFlow 1's --ps_hosts/--worker_hosts/--job_name/--task_index, taken out of argv."""

from __future__ import annotations

import pytest

from conveyor.cluster import ClusterConfigError, ClusterSpec, TaskId, parse_cluster_flags

SPEC = ClusterSpec(worker=("w0:2222", "w1:2222"), ps=("ps0:2222", "ps1:2222"))


def test_classic_command_line():
    argv = ["--ps_hosts=ps0:2222,ps1:2222", "--worker_hosts=w0:2222,w1:2222", "--job_name=worker",
            "--task_index=1", "--lr", "0.1"]
    assert parse_cluster_flags(argv) == (SPEC, TaskId("worker", 1), ["--lr", "0.1"])


def test_space_separated_values_and_order_of_the_rest_kept():
    argv = ["train.py", "--job_name", "ps", "-v", "--worker_hosts", "w0:2222,w1:2222", "--epochs=3",
            "--ps_hosts", "ps0:2222,ps1:2222", "--task_index", "0", "data"]
    assert parse_cluster_flags(argv) == (SPEC, TaskId("ps", 0), ["train.py", "-v", "--epochs=3", "data"])


def test_defaults_task_index_zero_and_no_ps():
    assert parse_cluster_flags(["--worker_hosts=w0:1", "--job_name=worker"]) == (
        ClusterSpec(worker=("w0:1",)), TaskId("worker", 0), [])


def test_no_cluster_flags_is_none():
    assert parse_cluster_flags(["--lr=0.1", "--job", "x"]) is None
    assert parse_cluster_flags([]) is None


def test_everything_after_double_dash_is_left_alone():
    argv = ["--worker_hosts=w0:1", "--job_name=worker", "--", "--task_index=7"]
    assert parse_cluster_flags(argv) == (ClusterSpec(worker=("w0:1",)), TaskId("worker", 0), ["--", "--task_index=7"])
    assert parse_cluster_flags(["--", "--job_name=worker"]) is None


@pytest.mark.parametrize(
    ("argv", "pattern"),
    [
        (["--job_name=worker"], r"^--worker_hosts is missing.*--worker_hosts=w0:2222,w1:2222"),
        (["--worker_hosts=w0:1"], r"^--job_name is missing"),
        (["--worker_hosts=w0:1", "--job_name"], r"^--job_name needs a value"),
        (["--worker_hosts", "--job_name=worker"], r"^--worker_hosts needs a value"),
        (["--worker_hosts=w0:1", "--job_name=boss"], r"^--job_name='boss' is not a job; expected one of chief, worker"),
        (["--worker_hosts=w0:1", "--job_name=ps"], r"^--job_name = 'ps' but the cluster has no 'ps' job"),
        (["--worker_hosts=w0:1", "--job_name=worker", "--task_index=1"],
         r"^--task_index = 1 is out of range: the cluster has 1 'worker' task, so the index is 0\.\.0"),
        (["--worker_hosts=w0:1", "--job_name=worker", "--task_index=x"], r"^--task_index='x' is not a whole number"),
        (["--worker_hosts=w0:1", "--job_name=worker", "--task_index=-1"], r"^--task_index='-1' is not a whole number"),
        (["--worker_hosts=w0:1,w0", "--job_name=worker"], r"^--worker_hosts\[1\] = 'w0' is not an address"),
        (["--worker_hosts=w0:1", "--ps_hosts=w0:1", "--job_name=worker"],
         r"^--ps_hosts\[0\] = 'w0:1' is also --worker_hosts\[0\]"),
        (["--worker_hosts=w0:1", "--worker_hosts=w1:1", "--job_name=worker"], r"^--worker_hosts is given twice"),
        (["--worker_hosts=", "--job_name=worker"], r"^--worker_hosts is empty"),
    ],
)
def test_bad_flags_name_the_flag(argv, pattern):
    with pytest.raises(ClusterConfigError, match=pattern):
        parse_cluster_flags(argv)
