"""Discovery from explicit environment dicts (never the real os.environ): precedence, each source, errors."""

from __future__ import annotations

import pytest

from conveyor.cluster import (
    ClusterConfigError,
    ClusterSpec,
    Discovered,
    TaskId,
    discover,
    expand_hostlist,
    expand_tasks_per_node,
    slurm_port,
)

SPEC = ClusterSpec(chief=("c0:2222",), worker=("w0:2222", "w1:2222"), ps=("p0:2222",))
TORCHRUN = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
OPEN_MPI = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_NODE_RANK": "1", "OMPI_UNIVERSE_SIZE": "4",
            "PMIX_RANK": "3"}
HYDRA = {"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1", "PMI_FD": "7"}
SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
         "SLURM_JOB_NODELIST": "node[01-03],gpu5", "SLURM_TASKS_PER_NODE": "2(x3)", "SLURM_JOB_ID": "123456"}


def conveyor_env(task: TaskId, **extra: str) -> dict[str, str]:
    env = {"TF_CONFIG": SPEC.to_tf_config(task.type, task.index), "CONVEYOR_TASK_TYPE": task.type,
           "CONVEYOR_TASK_INDEX": str(task.index), "CONVEYOR_STRATEGY": "allreduce",
           "CONVEYOR_DATA_DIR": "/data", "CONVEYOR_OUTPUT_DIR": "/out", "CONVEYOR_JOB_SECRET": "abcd"}
    if task.is_training:
        env.update(RANK=str(SPEC.rank_of(task)), WORLD_SIZE="3", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT="23999")
    env.update(extra)
    return env


# -- each source ----------------------------------------------------------------------------------


def test_nothing_is_a_single_local_worker():
    single = Discovered(None, TaskId("worker", 0), 0, 1, 0, 1, None, None, "single")
    assert discover({}) == single
    assert discover({"TF_CONFIG": "  "}) == single
    assert discover({"TF_CONFIG": "{}"}) == single  # TensorFlow reads an empty TF_CONFIG as "no cluster" too
    assert discover({}).is_chief
    assert discover({"CONVEYOR_DATA_DIR": "/d"}).data_dir == "/d"


def test_conveyor_worker():
    assert discover(conveyor_env(TaskId("worker", 1))) == Discovered(
        SPEC, TaskId("worker", 1), 2, 3, 0, 1, "127.0.0.1", 23999, "conveyor",
        strategy="allreduce", data_dir="/data", output_dir="/out", secret=b"\xab\xcd")


def test_conveyor_ps_has_no_rank():
    found = discover(conveyor_env(TaskId("ps", 0)))
    assert found == Discovered(SPEC, TaskId("ps", 0), None, 3, 0, 1, None, None, "conveyor",
                               strategy="allreduce", data_dir="/data", output_dir="/out", secret=b"\xab\xcd")
    assert not found.is_chief


def test_secret_is_kept_out_of_repr():
    assert "abcd" not in repr(discover(conveyor_env(TaskId("chief", 0))))
    assert "secret" not in repr(discover(conveyor_env(TaskId("chief", 0))))


def test_tf_config_alone_meets_at_rank_zeros_address():
    env = {"TF_CONFIG": SPEC.to_tf_config("worker", 0)}
    assert discover(env) == Discovered(SPEC, TaskId("worker", 0), 1, 3, 0, 1, "c0", 2222, "tf_config")
    no_chief = ClusterSpec(worker=("[::1]:3000", "[::1]:3001"))
    found = discover({"TF_CONFIG": no_chief.to_tf_config("worker", 1)})
    assert (found.rank, found.world_size, found.master_addr, found.master_port) == (1, 2, "::1", 3000)


def test_tf_config_with_master_and_local_variables():
    env = {"TF_CONFIG": SPEC.to_tf_config("chief", 0), "MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "29400",
           "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "RANK": "0", "WORLD_SIZE": "3"}
    assert discover(env) == Discovered(SPEC, TaskId("chief", 0), 0, 3, 0, 2, "10.1.1.1", 29400, "tf_config")


def test_tf_config_evaluator_outside_the_cluster():
    found = discover({"TF_CONFIG": SPEC.to_tf_config("evaluator", 0)})
    assert found == Discovered(SPEC, TaskId("evaluator", 0), None, 3, 0, 1, None, None, "tf_config")


def test_torchrun():
    assert discover(TORCHRUN) == Discovered(None, TaskId("worker", 5), 5, 8, 1, 4, "10.0.0.1", 29500, "torchrun")


def test_pytorchjob_sets_no_local_variables():
    env = {"RANK": "2", "WORLD_SIZE": "3", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"}
    assert discover(env) == Discovered(None, TaskId("worker", 2), 2, 3, 0, 1, "job-master-0", 23456, "torchrun")


def test_torchrun_group_of_one_needs_no_master():
    assert discover({"RANK": "0", "WORLD_SIZE": "1"}) == Discovered(
        None, TaskId("worker", 0), 0, 1, 0, 1, None, None, "torchrun")


def test_slurm():
    assert discover(SLURM) == Discovered(None, TaskId("worker", 5), 5, 6, 1, 2, "node01", 23456, "slurm")


def test_slurm_step_variables_and_master_overrides():
    env = dict(SLURM, SLURM_STEP_NUM_TASKS="3", SLURM_STEP_NODELIST="gpu[7-8]", SLURM_STEP_TASKS_PER_NODE="2,1",
               SLURM_PROCID="2", SLURM_NODEID="1", SLURM_LOCALID="0", MASTER_PORT="29501")
    assert discover(env) == Discovered(None, TaskId("worker", 2), 2, 3, 0, 1, "gpu7", 29501, "slurm")
    env["MASTER_ADDR"] = "login1"
    assert discover(env).master_addr == "login1"


def test_slurm_ntasks_per_node_and_single_task():
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "3", "SLURM_NTASKS_PER_NODE": "4",
           "SLURM_NODELIST": "n1", "SLURM_JOBID": "42"}
    assert discover(env) == Discovered(None, TaskId("worker", 3), 3, 4, 3, 4, "n1", 20042, "slurm")
    assert discover({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) == Discovered(
        None, TaskId("worker", 0), 0, 1, 0, 1, None, None, "slurm")


def test_open_mpi_without_master_leaves_the_address_to_init():
    assert discover(OPEN_MPI) == Discovered(None, TaskId("worker", 3), 3, 4, 1, 2, None, None, "mpi")


def test_open_mpi_with_master_and_conveyor_variables():
    env = {**OPEN_MPI, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "CONVEYOR_STRATEGY": "allreduce"}
    assert discover(env) == Discovered(None, TaskId("worker", 3), 3, 4, 1, 2, "10.0.0.1", 29500, "mpi",
                                       strategy="allreduce")
    assert discover({**OPEN_MPI, "MASTER_PORT": "29500"}).master_port == 29500  # the address alone is agreed


def test_hydra_mpiexec():
    assert discover(HYDRA) == Discovered(None, TaskId("worker", 2), 2, 3, 0, 1, None, None, "mpi")
    # -pmi-port mode has no PMI_RANK: refused by name rather than read as a single process
    with pytest.raises(ClusterConfigError, match=r"^PMI_RANK is empty or not set; Hydra's mpiexec sets it"):
        discover({"MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2", "PMI_PORT": "h:1", "PMI_ID": "0"})


def test_open_mpi_and_hydra_variables_that_agree():
    env = {**OPEN_MPI, "PMI_RANK": "3", "PMI_SIZE": "4"}
    assert discover(env).rank == 3


def test_mpi_without_local_variables():
    found = discover({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"})
    assert (found.rank, found.world_size, found.local_rank, found.local_world_size) == (1, 2, 0, 1)


def test_srun_pmi2_plugin_is_slurm():
    # srun --mpi=pmi2 sets PMI_RANK/PMI_SIZE but not Hydra's local pair: srun started the process
    env = {**SLURM, "PMI_RANK": "5", "PMI_SIZE": "6", "PMI_FD": "4", "PMI_JOBID": "123456.0"}
    assert discover(env) == discover(SLURM)
    assert discover({"PMI_RANK": "1", "PMI_SIZE": "2"}).source == "mpi"  # a PMI launcher without Slurm


# -- precedence ----------------------------------------------------------------------------------


def test_precedence():
    conveyor = conveyor_env(TaskId("worker", 0))
    tf_only = {"TF_CONFIG": SPEC.to_tf_config("worker", 1)}
    assert discover({**SLURM, **TORCHRUN, **conveyor}).source == "conveyor"
    assert discover({**SLURM, **tf_only}).source == "tf_config"
    assert discover({**SLURM, **TORCHRUN}).source == "torchrun"  # torchrun inside an srun allocation
    assert discover({**OPEN_MPI, **TORCHRUN}).source == "torchrun"  # mpirun -np 2 torchrun ...
    assert discover({**OPEN_MPI, **conveyor}).source == "conveyor"  # mpirun -np 2 conveyor run ...
    assert discover({**OPEN_MPI, **tf_only}).source == "tf_config"
    # mpirun inside an allocation: the SLURM_PROCID of the node's orted, not this process's rank
    assert discover({**SLURM, **OPEN_MPI}) == discover(OPEN_MPI)
    assert discover({**SLURM, **HYDRA}).source == "mpi"
    assert discover(SLURM).source == "slurm"
    assert discover({"TF_CONFIG": "{}", **TORCHRUN}).source == "torchrun"


# -- malformed values -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "pattern"),
    [
        ({"RANK": "one", "WORLD_SIZE": "2"}, r"^RANK='one' is not a whole number >= 0"),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, r"^RANK='-1' is not a whole number"),
        ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
         r"^RANK=2 but WORLD_SIZE=2: ranks are 0\.\.1"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, r"^WORLD_SIZE=0; a job has at least 1 process"),
        ({"RANK": "0"}, r"^WORLD_SIZE is empty or not set; torchrun sets RANK and WORLD_SIZE together"),
        ({"WORLD_SIZE": "2"}, r"^RANK is empty or not set"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1"}, r"^MASTER_ADDR is empty or not set; torchrun sets it"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, r"^MASTER_PORT is empty or not set"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "99999"},
         r"^MASTER_PORT='99999' is not a port number 1-65535"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1", "LOCAL_RANK": "2",
          "LOCAL_WORLD_SIZE": "2"}, r"^LOCAL_RANK=2 but LOCAL_WORLD_SIZE is 2: a local rank is 0\.\.1"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1", "LOCAL_WORLD_SIZE": "4"},
         r"^LOCAL_WORLD_SIZE is 4 but the job has only 2 training processes"),
        ({"TF_CONFIG": '{"cluster": '}, r"^TF_CONFIG is not valid JSON"),
        ({"TF_CONFIG": SPEC.to_tf_config("worker", 0), "RANK": "0"},
         r"^RANK=0, WORLD_SIZE=3 disagree with TF_CONFIG, which makes task worker:0 rank 1 of 3"),
        ({"CONVEYOR_TASK_TYPE": "worker"}, r"^CONVEYOR_TASK_TYPE is set but TF_CONFIG is not"),
        (conveyor_env(TaskId("worker", 0), CONVEYOR_TASK_INDEX="1"),
         r"^CONVEYOR_TASK_TYPE=worker, CONVEYOR_TASK_INDEX=1 disagree with TF_CONFIG's task worker:0"),
        (conveyor_env(TaskId("worker", 0), CONVEYOR_TASK_INDEX="x"), r"^CONVEYOR_TASK_INDEX='x' is not a whole"),
        (conveyor_env(TaskId("worker", 0), RANK="0"), r"^RANK=0, WORLD_SIZE=3 disagree with TF_CONFIG"),
        (conveyor_env(TaskId("worker", 0), MASTER_ADDR=""), r"^MASTER_ADDR is empty or not set; conveyor's launcher"),
        (conveyor_env(TaskId("worker", 0), CONVEYOR_JOB_SECRET="xyz"), r"^CONVEYOR_JOB_SECRET is not a non-empty hex"),
        ({"SLURM_PROCID": "0"}, r"^SLURM_NTASKS is empty or not set; srun sets it"),
        ({"SLURM_PROCID": "4", "SLURM_NTASKS": "4"}, r"^SLURM_PROCID=4 but SLURM_NTASKS=4: ranks are 0\.\.3"),
        ({**SLURM, "SLURM_LOCALID": "x"}, r"^SLURM_LOCALID='x' is not a whole number"),
        ({**SLURM, "SLURM_NODEID": "3"}, r"^SLURM_NODEID=3 but SLURM_TASKS_PER_NODE='2\(x3\)' lists 3 nodes"),
        ({**SLURM, "SLURM_LOCALID": "2"}, r"^SLURM_LOCALID=2 but tasks on this node is 2"),
        ({**SLURM, "SLURM_TASKS_PER_NODE": "2(x)"}, r"^SLURM_TASKS_PER_NODE = '2\(x\)': '2\(x\)' is not a count"),
        ({**SLURM, "SLURM_JOB_ID": "abc"}, r"^SLURM_JOB_ID = 'abc' is not a number; set MASTER_PORT"),
        ({**SLURM, "SLURM_JOB_NODELIST": "node[01-03"}, r"^SLURM_JOB_NODELIST = 'node\[01-03': '\[' is never closed"),
        ({k: v for k, v in SLURM.items() if k != "SLURM_JOB_ID"}, r"^cannot pick a rendezvous port.*set MASTER_PORT"),
        ({k: v for k, v in SLURM.items() if k != "SLURM_JOB_NODELIST"}, r"^cannot tell rank 0's host.*MASTER_ADDR"),
        ({**OPEN_MPI, "OMPI_COMM_WORLD_RANK": "x"},
         r"^OMPI_COMM_WORLD_RANK='x' is not a whole number >= 0.*Open MPI's mpirun sets it in every process"),
        ({"OMPI_COMM_WORLD_RANK": "0"}, r"^OMPI_COMM_WORLD_SIZE is empty or not set; Open MPI's mpirun sets it"),
        ({"OMPI_COMM_WORLD_LOCAL_RANK": "0"}, r"^OMPI_COMM_WORLD_RANK is empty or not set"),
        ({**OPEN_MPI, "OMPI_COMM_WORLD_RANK": "4"},
         r"^OMPI_COMM_WORLD_RANK=4 but OMPI_COMM_WORLD_SIZE=4: ranks are 0\.\.3"),
        ({**OPEN_MPI, "OMPI_COMM_WORLD_SIZE": "0"}, r"^OMPI_COMM_WORLD_SIZE=0; a job has at least 1 process"),
        ({**OPEN_MPI, "OMPI_COMM_WORLD_LOCAL_RANK": "2"},
         r"^OMPI_COMM_WORLD_LOCAL_RANK=2 but OMPI_COMM_WORLD_LOCAL_SIZE is 2: a local rank is 0\.\.1"),
        ({**OPEN_MPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "5"},
         r"^OMPI_COMM_WORLD_LOCAL_SIZE is 5 but the job has only 4 training processes"),
        ({**HYDRA, "PMI_SIZE": "-3"}, r"^PMI_SIZE='-3' is not a whole number.*Hydra's mpiexec sets it"),
        ({**HYDRA, "MPI_LOCALNRANKS": " "}, r"^MPI_LOCALNRANKS is empty or not set"),
        ({**OPEN_MPI, **HYDRA}, r"^OMPI_COMM_WORLD_RANK=3, OMPI_COMM_WORLD_SIZE=4 \(Open MPI's mpirun\) disagree with "
                                r"PMI_RANK=2, PMI_SIZE=3 \(Hydra's mpiexec\).*unset the stale ones"),
        ({**OPEN_MPI, "MASTER_PORT": "0"}, r"^MASTER_PORT='0' is not a port number 1-65535"),
        ({**OPEN_MPI, "MASTER_ADDR": "h:29500"}, r"^MASTER_ADDR = 'h:29500' is not a host.*port goes in MASTER_PORT"),
    ],
)
def test_malformed_environment_names_the_variable(env, pattern):
    with pytest.raises(ClusterConfigError, match=pattern):
        discover(env)


# -- Slurm formats ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [
        ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
        ("tux[0-5,12,20-25]", ["tux0", "tux1", "tux2", "tux3", "tux4", "tux5", "tux12", "tux20", "tux21", "tux22",
                               "tux23", "tux24", "tux25"]),  # Slurm's Hostlist man page
        ("foo[8-11]", ["foo8", "foo9", "foo10", "foo11"]),
        ("node[08-10]", ["node08", "node09", "node10"]),
        ("node[007-9]", ["node007", "node008", "node009"]),
        ("d[1-3],n[01-02]", ["d1", "d2", "d3", "n01", "n02"]),
        ("rack[01-2]-node[1-2,5]", ["rack01-node1", "rack01-node2", "rack01-node5",
                                    "rack02-node1", "rack02-node2", "rack02-node5"]),
        ("n[1-2]-ib", ["n1-ib", "n2-ib"]),
        ("[1-3]", ["1", "2", "3"]),
        ("gpu5", ["gpu5"]),
        ("b,a", ["b", "a"]),  # order kept: the first node hosts rank 0
        ("n1 n2", ["n1", "n2"]),
        ("n[3,1]", ["n3", "n1"]),
        ("", []),
    ],
)
def test_expand_hostlist(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize(
    ("hostlist", "pattern"),
    [
        ("node[1-", r"'\[' is never closed"),
        ("node]1", r"'\]' without '\['"),
        ("node[[1]]", r"brackets cannot nest"),
        ("node[3-1]", r"the range '3-1' runs backwards"),
        ("node[a]", r"\[a\] has 'a', which is not a number or a range lo-hi"),
        ("node[]", r"\[\] has '', which is not a number"),
        ("node[1-2-3]", r"'1-2-3', which is not a number"),
        ("node[0-99999999]", r"more than 100000 hosts"),
        ("a[0-999]b[0-999]", r"expands to more than 100000 hosts"),
    ],
)
def test_bad_hostlist(hostlist, pattern):
    with pytest.raises(ClusterConfigError, match=r"^SLURM_JOB_NODELIST = .*" + pattern):
        expand_hostlist(hostlist, name="SLURM_JOB_NODELIST")


def test_expand_tasks_per_node():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    for bad in ("0", "2(x0)", "x", "", "2,,1"):
        with pytest.raises(ClusterConfigError, match=r"expected e\.g\. '2\(x3\),1'"):
            expand_tasks_per_node(bad)


def test_slurm_port_is_deterministic_and_in_range():
    assert [slurm_port(j) for j in ("123456", "9999", "10000", "0")] == [23456, 29999, 20000, 20000]
