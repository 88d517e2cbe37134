"""Fuzz target: the cluster flags (``--ps_hosts/--worker_hosts/--job_name/--task_index``), Slurm's host and
tasks-per-node lists, and ``discover()`` over an environment built from the same bytes (one ``NAME=value``
per line; the lines are also the argv). Oracle: bad input is only ever a ClusterConfigError, and what is
discovered is a consistent identity (rank inside the world, local rank inside the node, a real port)."""

import _common

from conveyor.cluster import (
    ClusterConfigError,
    Discovered,
    discover,
    expand_hostlist,
    expand_tasks_per_node,
    parse_cluster_flags,
)
from conveyor.cluster.spec import parse_host

EXPECTED = (ClusterConfigError,)

SEEDS = [
    b"--ps_hosts=ps0:2222,ps1:2222\n--worker_hosts=w0:2222,[::1]:2222\n--job_name=worker\n--task_index=1\n--lr=0.1",
    b"SLURM_PROCID=5\nSLURM_NTASKS=6\nSLURM_LOCALID=1\nSLURM_NODEID=2\nSLURM_JOB_NODELIST=node[01-03],gpu5\n"
    b"SLURM_TASKS_PER_NODE=2(x3)\nSLURM_JOB_ID=123456",
    b"RANK=5\nWORLD_SIZE=8\nLOCAL_RANK=1\nLOCAL_WORLD_SIZE=4\nMASTER_ADDR=10.0.0.1\nMASTER_PORT=29500",
    b'TF_CONFIG={"cluster": {"chief": ["c0:2222"], "worker": ["w0:2222"]}, "task": {"type": "worker", "index": 0}}\n'
    b"CONVEYOR_TASK_TYPE=worker\nCONVEYOR_TASK_INDEX=0\nRANK=1\nWORLD_SIZE=2\nLOCAL_RANK=0\nLOCAL_WORLD_SIZE=1\n"
    b"MASTER_ADDR=127.0.0.1\nMASTER_PORT=23999\nCONVEYOR_JOB_SECRET=abcd",
    b"RANK=\x000\x04\nWORLD_SIZE=1\nSLURM_PROCID=0\nSLURM_NTASKS=1\nSLURM_JOB_NODELIST=n[\x000\x01-1]",
]


def target(data: bytes) -> None:
    """Run every parser on ``data``; each may refuse it (ClusterConfigError), none may fail another way."""
    # decoded as os.environ and sys.argv decode undecodable bytes
    text = _common.expand_runs(data.decode("utf-8", "surrogateescape"))
    lines = text.split("\n")
    env = dict(line.partition("=")[::2] for line in lines)
    for parse in (_flags, _hostlists, _discover):
        try:
            parse(lines, env)
        except ClusterConfigError:
            pass


def _flags(argv: list[str], env: dict[str, str]) -> None:
    found = parse_cluster_flags(argv)
    if found is not None:
        spec, task, rest = found
        spec.check_task(task)
        assert len(rest) < len(argv)


def _hostlists(lines: list[str], env: dict[str, str]) -> None:
    for line in lines[:2]:
        for host in expand_hostlist(line):
            parse_host(host, "host", "")
        assert all(count >= 1 for count in expand_tasks_per_node(line))


def _discover(lines: list[str], env: dict[str, str]) -> None:
    found = discover(env)
    assert isinstance(found, Discovered)
    if found.spec is not None:
        found.spec.check_task(found.task)
    if found.master_port is not None:
        assert 1 <= found.master_port <= 65535
    if found.master_addr is not None:
        assert parse_host(found.master_addr, "MASTER_ADDR", "") == found.master_addr
    if not found.task.is_training:
        assert found.rank is None
        return
    assert 0 <= found.rank < found.world_size
    assert 0 <= found.local_rank < found.local_world_size <= found.world_size
    if found.world_size > 1:
        assert found.master_addr is not None and found.master_port is not None
