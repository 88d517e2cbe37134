"""The launch plan: arguments + ports (+ rendezvous) → every task's command and environment, by exact equality.

Pure: no process is started and no socket is opened (except by the free_ports tests at the end).
"""

from __future__ import annotations

import socket

import pytest

from conveyor.cluster import ClusterSpec, TaskId, discover, local_cluster
from conveyor.errors import AddressInUseError
from conveyor.launch import (
    NodeInfo,
    RunOptions,
    build_plan,
    cluster_from_nodes,
    describe_plan,
    free_ports,
    local_plan,
    resolve_strategy,
)
from conveyor.launch.plan import TORCHRUN_VARS, run_id

SECRET = bytes(range(32))
SECRET_HEX = SECRET.hex()
CALLER = {"PATH": "/usr/bin:/bin", "HOME": "/home/ada", "LANG": "C.UTF-8",
          # stale variables from an outer launcher: the launcher owns these and must not pass them on
          "RANK": "7", "TF_CONFIG": '{"cluster": {}}', "CONVEYOR_TASK_TYPE": "ps", "MASTER_PORT": "1"}
INHERITED = {"PATH": "/usr/bin:/bin", "HOME": "/home/ada", "LANG": "C.UTF-8"}


def options(**overrides) -> RunOptions:
    kwargs = dict(script="train.py", script_args=("--epochs", "1"), workers=2, data_dir="/data/digits",
                  output_dir="/out/run1", python="/usr/bin/python3")
    kwargs.update(overrides)
    return RunOptions(**kwargs)


def test_two_workers_on_one_machine_exact_environment():
    plan = local_plan(options(), [23001, 23002], master_port=23009, secret=SECRET, environ=CALLER)
    assert plan.spec == ClusterSpec(worker=("127.0.0.1:23001", "127.0.0.1:23002"))
    assert plan.strategy == "allreduce"
    assert plan.log_dir == "/out/run1/logs"
    assert plan.inherited == 3
    assert [t.name for t in plan.tasks] == ["worker:0", "worker:1"]
    cluster = '{"cluster": {"worker": ["127.0.0.1:23001", "127.0.0.1:23002"]}, '
    for index, launch in enumerate(plan.tasks):
        assert launch.argv == ("/usr/bin/python3", "train.py", "--epochs", "1")
        assert launch.log_path == f"/out/run1/logs/worker-{index}.log"
        assert dict(launch.env) == {
            **INHERITED,
            "TF_CONFIG": cluster + f'"task": {{"type": "worker", "index": {index}}}}}',
            "CONVEYOR_TASK_TYPE": "worker",
            "CONVEYOR_TASK_INDEX": str(index),
            "CONVEYOR_STRATEGY": "allreduce",
            "CONVEYOR_DATA_DIR": "/data/digits",
            "CONVEYOR_OUTPUT_DIR": "/out/run1",
            "CONVEYOR_JOB_SECRET": SECRET_HEX,
            "RANK": str(index),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(index),
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "23009",
            "GROUP_RANK": "0",
            "GROUP_WORLD_SIZE": "1",
            "ROLE_NAME": "default",
            "ROLE_RANK": str(index),
            "ROLE_WORLD_SIZE": "2",
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "3",
            "TORCHELASTIC_RUN_ID": run_id(SECRET),
            "TORCHELASTIC_USE_AGENT_STORE": "False",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
            "CONVEYOR_RESTART_COUNT": "0",
            "CONVEYOR_RESUME": "1",
            "CONVEYOR_TIMEOUT": "300",
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            "CONVEYOR_OMP_DEFAULT": "1",
        }
        assert launch.set_vars == tuple(k for k in launch.env if k not in INHERITED)


def test_parameter_servers_get_no_torch_rank_even_when_the_caller_had_one():
    plan = local_plan(options(workers=1, ps=2, strategy="ps-async", resume=False, timeout=30.5),
                      [23001, 23002, 23003], master_port=23009, secret=SECRET, environ=CALLER)
    assert [t.name for t in plan.tasks] == ["worker:0", "ps:0", "ps:1"]
    ps1 = plan.tasks[2]
    assert dict(ps1.env) == {
        **INHERITED,
        "TF_CONFIG": '{"cluster": {"worker": ["127.0.0.1:23001"], "ps": ["127.0.0.1:23002", "127.0.0.1:23003"]}, '
                     '"task": {"type": "ps", "index": 1}}',
        "CONVEYOR_TASK_TYPE": "ps",
        "CONVEYOR_TASK_INDEX": "1",
        "CONVEYOR_STRATEGY": "ps-async",
        "CONVEYOR_DATA_DIR": "/data/digits",
        "CONVEYOR_OUTPUT_DIR": "/out/run1",
        "CONVEYOR_JOB_SECRET": SECRET_HEX,
        "CONVEYOR_RESTART_COUNT": "0",
        "CONVEYOR_RESUME": "0",
        "CONVEYOR_TIMEOUT": "30.5",
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "CONVEYOR_OMP_DEFAULT": "1",
    }
    assert ps1.log_path == "/out/run1/logs/ps-1.log"


def test_training_tasks_get_every_variable_torchrun_sets_with_its_meaning():
    nodes = [NodeInfo("10.0.0.1", 2, 0, (7001, 7002)), NodeInfo("10.0.0.2", 3, 1, (8001, 8002, 8003, 8004))]
    plan = build_plan(options(workers=3, ps=1, strategy="ps-sync", max_restarts=5), nodes, 1,
                      master_addr="10.0.0.1", master_port=7009, secret=SECRET,
                      environ={"TORCHELASTIC_RUN_ID": "stale", "GROUP_RANK": "9",
                               "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"})
    worker3 = plan.tasks[1].env
    assert set(TORCHRUN_VARS) <= set(worker3)
    assert {k: worker3[k] for k in TORCHRUN_VARS} == {
        "RANK": "3", "GROUP_RANK": "1", "ROLE_RANK": "3", "ROLE_NAME": "default", "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "3", "WORLD_SIZE": "5", "GROUP_WORLD_SIZE": "2", "ROLE_WORLD_SIZE": "5",
        "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "7009", "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "5", "TORCHELASTIC_RUN_ID": run_id(SECRET),
        "TORCHELASTIC_USE_AGENT_STORE": "False", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    }
    node0 = build_plan(options(workers=3, ps=1, strategy="ps-sync"), nodes, 0, master_addr="10.0.0.1",
                       master_port=7009, secret=SECRET, environ={})
    assert node0.tasks[0].env["TORCHELASTIC_RUN_ID"] == worker3["TORCHELASTIC_RUN_ID"]  # one id per job
    assert run_id(b"another secret" * 2) != run_id(SECRET) and SECRET.hex()[:16] not in run_id(SECRET)
    ps = plan.tasks[-1].env  # not in the torch group: no rank, no torchrun identity, not even a stale one
    assert not {"RANK", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID"} & set(ps)
    assert ps["OMP_NUM_THREADS"] == "1" and ps["CONVEYOR_OMP_DEFAULT"] == "1"


def test_omp_num_threads_default_only_when_tasks_share_the_machine_and_the_caller_did_not_set_it():
    alone = local_plan(options(workers=1), [23001], master_port=23009, secret=SECRET, environ={})
    assert "OMP_NUM_THREADS" not in alone.tasks[0].env and "CONVEYOR_OMP_DEFAULT" not in alone.tasks[0].env
    mine = local_plan(options(), [23001, 23002], master_port=23009, secret=SECRET,
                      environ={"OMP_NUM_THREADS": "4", "CONVEYOR_OMP_DEFAULT": "1"})
    for launch in mine.tasks:
        assert launch.env["OMP_NUM_THREADS"] == "4" and "CONVEYOR_OMP_DEFAULT" not in launch.env


def test_tf_flags_follow_the_script_for_every_task():
    plan = local_plan(options(ps=1, strategy="ps-sync", tf_flags=True), [23001, 23002, 23003], master_port=23009,
                      secret=SECRET, environ={})
    hosts = ("--ps_hosts=127.0.0.1:23003", "--worker_hosts=127.0.0.1:23001,127.0.0.1:23002")
    assert [t.argv for t in plan.tasks] == [
        ("/usr/bin/python3", "train.py", *hosts, f"--job_name={job}", f"--task_index={i}", "--epochs", "1")
        for job, i in (("worker", 0), ("worker", 1), ("ps", 0))]
    alone = local_plan(options(tf_flags=True), [23001, 23002], master_port=23009, secret=SECRET, environ={})
    assert alone.tasks[0].argv[2] == "--ps_hosts="  # TF1 scripts split it; an empty value is no ps


def test_chief_option_names_rank_0_chief():
    plan = local_plan(options(workers=3, chief=True), [23001, 23002, 23003], master_port=23009, secret=SECRET,
                      environ={})
    assert [t.name for t in plan.tasks] == ["chief:0", "worker:0", "worker:1"]
    assert [t.env["RANK"] for t in plan.tasks] == ["0", "1", "2"]
    assert plan.tasks[0].log_path == "/out/run1/logs/chief-0.log"


def test_every_task_discovers_what_the_plan_says():
    plan = local_plan(options(workers=2, ps=1, strategy="ps-sync"), [23001, 23002, 23003], master_port=23009,
                      secret=SECRET, environ=CALLER)
    for launch in plan.tasks:
        found = discover(launch.env)
        assert found.source == "conveyor"
        assert found.task == launch.task
        assert found.spec == plan.spec
        assert found.secret == SECRET
        assert found.strategy == "ps-sync"
        assert found.output_dir == "/out/run1"
        if launch.task.is_training:
            assert (found.rank, found.world_size, found.master_port) == (launch.task.index, 2, 23009)


def test_one_node_cluster_equals_local_cluster():
    for chief in (False, True):
        node = NodeInfo("127.0.0.1", 3, 2, (1, 2, 3, 4, 5))
        assert cluster_from_nodes([node], chief) == local_cluster(3, 2, [1, 2, 3, 4, 5], chief=chief)


def test_two_nodes_list_node_0_first_and_node_1_gets_the_next_ranks():
    nodes = [NodeInfo("10.0.0.1", 2, 1, (7001, 7002, 7003)), NodeInfo("10.0.0.2", 2, 1, (8001, 8002, 8003))]
    spec = ClusterSpec(worker=("10.0.0.1:7001", "10.0.0.1:7002", "10.0.0.2:8001", "10.0.0.2:8002"),
                       ps=("10.0.0.1:7003", "10.0.0.2:8003"))
    assert cluster_from_nodes(nodes) == spec
    plan = build_plan(options(ps=1, strategy="ps-sync"), nodes, 1, master_addr="10.0.0.1", master_port=7009,
                      secret=SECRET, environ={})
    assert (plan.node_rank, plan.nnodes) == (1, 2)
    assert [t.task for t in plan.tasks] == [TaskId("worker", 2), TaskId("worker", 3), TaskId("ps", 1)]
    worker3 = plan.tasks[1].env
    assert (worker3["RANK"], worker3["WORLD_SIZE"], worker3["LOCAL_RANK"], worker3["LOCAL_WORLD_SIZE"]) == \
        ("3", "4", "1", "2")
    assert (worker3["MASTER_ADDR"], worker3["MASTER_PORT"]) == ("10.0.0.1", "7009")
    assert worker3["TF_CONFIG"] == spec.to_tf_config("worker", 3)
    node0 = build_plan(options(ps=1, strategy="ps-sync"), nodes, 0, master_addr="10.0.0.1", master_port=7009,
                       secret=SECRET, environ={})
    assert [t.name for t in node0.tasks] == ["worker:0", "worker:1", "ps:0"]
    assert node0.spec == plan.spec


def test_a_node_of_parameter_servers_only_runs_just_its_ps_and_node_0_must_train():
    nodes = [NodeInfo("10.0.0.1", 1, 0, (7001,)), NodeInfo("10.0.0.2", 1, 0, (8001,)),
             NodeInfo("10.0.0.3", 0, 1, (9001,))]
    plan = build_plan(options(workers=0, ps=1, strategy="ps-sync"), nodes, 2, master_addr="10.0.0.1",
                      master_port=7009, secret=SECRET, environ={})
    assert plan.spec == ClusterSpec(worker=("10.0.0.1:7001", "10.0.0.2:8001"), ps=("10.0.0.3:9001",))
    assert [t.name for t in plan.tasks] == ["ps:0"] and "RANK" not in plan.tasks[0].env
    with pytest.raises(ValueError, match="give node 0 -n 1 or more"):
        build_plan(options(workers=0, ps=1, strategy="ps-sync"), nodes[::-1], 0, master_addr="10.0.0.3",
                   master_port=7009, secret=SECRET, environ={})


def test_describe_plan_lists_commands_and_variables_and_masks_the_secret():
    plan = local_plan(options(), [23001, 23002], master_port=23009, secret=SECRET, environ=CALLER)
    text = describe_plan(plan)
    assert SECRET_HEX not in text and SECRET_HEX[:16] not in text
    assert "CONVEYOR_JOB_SECRET=<masked: 64 hex digits>" in text
    for index in (0, 1):
        assert f"[worker:{index}] /usr/bin/python3 train.py --epochs 1" in text
        assert f"log: /out/run1/logs/worker-{index}.log" in text
        assert f"RANK={index}" in text
    assert "MASTER_PORT=23009" in text
    assert "TF_CONFIG='{\"cluster\": {\"worker\": [\"127.0.0.1:23001\", \"127.0.0.1:23002\"]}" in text
    assert "HOME=" not in text  # the caller's own environment is counted, not printed
    assert "(3 variables)" in text


@pytest.mark.parametrize("strategy, world, ps, expected", [
    (None, 1, 0, "local"), (None, 4, 0, "allreduce"), (None, 2, 1, "ps-sync"), ("pipeline", 2, 0, "pipeline"),
    ("ps-ssp:4", 2, 2, "ps-ssp:4"), ("allreduce", 1, 0, "allreduce"),
])
def test_resolve_strategy(strategy, world, ps, expected):
    assert resolve_strategy(strategy, world, ps) == expected


@pytest.mark.parametrize("strategy, world, ps, needle", [
    ("ps-async", 2, 0, "--ps M"), ("allreduce", 2, 1, "--strategy ps-sync"), ("local", 2, 0, "-n 1"),
    ("ps-ssp", 2, 1, "staleness"), ("horovod", 2, 0, "allreduce, ps-sync"),
])
def test_resolve_strategy_errors_name_the_fix(strategy, world, ps, needle):
    with pytest.raises(ValueError, match="--strategy|--ps") as info:
        resolve_strategy(strategy, world, ps)
    assert needle in str(info.value)


@pytest.mark.parametrize("overrides, needle", [
    (dict(workers=0), "-n 0 only with --ps M"), (dict(ps=-1), "--ps -1"), (dict(max_restarts=-1), "--max-restarts"),
    (dict(timeout=0), "--timeout 0"), (dict(output_dir="out"), "--output-dir 'out'"),
    (dict(strategy="ring"), "--strategy 'ring'"), (dict(script=""), "SCRIPT"),
    (dict(linger=-1), "--linger -1"), (dict(tf_flags=True, chief=True), "drop --chief"),
])
def test_run_options_validate_once_naming_the_flag(overrides, needle):
    with pytest.raises(ValueError) as info:
        options(**overrides)
    assert needle in str(info.value)


def test_ports_must_match_the_tasks():
    with pytest.raises(ValueError, match="one per task"):
        local_plan(options(), [23001], master_port=23009, secret=SECRET, environ={})


def test_free_ports_are_distinct_and_bindable():
    ports = free_ports(5)
    assert len(set(ports)) == 5
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
    assert free_ports(0) == []
    with pytest.raises(ValueError):
        free_ports(-1)


def test_free_ports_come_from_the_range_in_the_environment_walking_on(monkeypatch):
    with socket.socket() as sock:  # the range's first port is taken: it is skipped
        sock.bind(("127.0.0.1", 0))
        taken = sock.getsockname()[1]
        monkeypatch.setenv("CONVEYOR_PORT_RANGE", f"{taken}-{taken + 40}")
        first = free_ports(3)
        assert len(set(first)) == 3 and all(taken < port <= taken + 40 for port in first)
        second = free_ports(3)  # a later call walks on: no port of the first call comes back at once
        assert not set(first) & set(second) and all(taken < port <= taken + 40 for port in second)
        monkeypatch.setenv("CONVEYOR_PORT_RANGE", f"{taken}-{taken}")
        with pytest.raises(AddressInUseError, match=f"no free port on 127.0.0.1 in CONVEYOR_PORT_RANGE={taken}-"):
            free_ports(1)
    for bad in ("20000", "2-1", "0-10", "a-b", "1-70000"):
        monkeypatch.setenv("CONVEYOR_PORT_RANGE", bad)
        with pytest.raises(ValueError, match="is not a port range; expected LOW-HIGH"):
            free_ports(1)
    monkeypatch.setenv("CONVEYOR_PORT_RANGE", "")
    assert len(free_ports(2)) == 2


def test_pipeline_flags_reach_every_task_and_stale_ones_do_not():
    plan = local_plan(options(strategy="pipeline", stages=2, microbatches=8, schedule="gpipe"), [7001, 7002],
                      master_port=7000, secret=SECRET, environ=CALLER | {"CONVEYOR_PIPELINE_SPLIT": "stale"})
    for task in plan.tasks:
        assert {k: v for k, v in task.env.items() if k.startswith("CONVEYOR_PIPELINE_")} == {
            "CONVEYOR_PIPELINE_STAGES": "2", "CONVEYOR_PIPELINE_MICROBATCHES": "8",
            "CONVEYOR_PIPELINE_SCHEDULE": "gpipe"}
    plan = local_plan(options(), [7001, 7002], master_port=7000, secret=SECRET, environ=CALLER)
    assert not any(k.startswith("CONVEYOR_PIPELINE_") for task in plan.tasks for k in task.env)


@pytest.mark.parametrize("overrides, needle", [
    (dict(stages=2), "--stages belong(s) to pipeline parallelism: add --strategy pipeline"),
    (dict(strategy="pipeline"), "--strategy pipeline needs the split: --stages S"),
    (dict(strategy="pipeline", workers=3, stages=2), "-n 3 --stages 2: each pipeline replica runs all 2 stages"),
    (dict(strategy="pipeline", stages=0), "--stages 0: expected a whole number >= 1"),
    (dict(strategy="pipeline", stages=2, microbatches=0), "--microbatches 0"),
])
def test_pipeline_flags_are_checked_naming_the_fix(overrides, needle):
    with pytest.raises(ValueError) as info:
        options(**overrides)
    assert needle in str(info.value)
