"""A launcher's node identity from an srun step's environment (conveyor.launch.slurm), and `conveyor run` using it."""

from __future__ import annotations

import socket

import pytest

from conveyor.cli.main import main
from conveyor.cluster import ClusterConfigError, slurm_port
from conveyor.launch.slurm import allocation_note, slurm_node

ADDRESSES = {f"gpu{i:02d}": f"10.1.0.{i}" for i in range(1, 8)}


def resolver(name: str, port: int) -> str:
    if name not in ADDRESSES:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    return ADDRESSES[name]


def step(node_id: int, nodelist: str = "gpu[01-04,07]", count: int = 5, **more: str) -> dict[str, str]:
    """What srun puts in the environment of the launcher it starts on node ``node_id``."""
    names = ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]
    env = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_NODEID": str(node_id),
           "SLURM_STEP_NODELIST": nodelist, "SLURM_JOB_NODELIST": nodelist, "SLURM_STEP_NUM_NODES": str(count),
           "SLURM_STEP_NUM_TASKS": str(count), "SLURMD_NODENAME": names[node_id] if node_id < len(names) else "x"}
    env.update(more)
    return env


def test_every_node_derives_the_same_rendezvous_and_its_own_rank_from_the_node_list():
    nodes = [slurm_node(step(i), resolver=resolver) for i in range(5)]
    assert [n.node_rank for n in nodes] == [0, 1, 2, 3, 4]
    assert [n.name for n in nodes] == ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]  # gpu[01-04,07], in order
    assert {n.nnodes for n in nodes} == {5}
    assert {n.rdzv for n in nodes} == {f"10.1.0.1:{slurm_port('4242')}"}  # node 0's address, the job's port
    assert nodes[4].describe() == (f"Slurm job 4242: node 4 of 5 (gpu07); the rendezvous at 10.1.0.1:"
                                   f"{slurm_port('4242')} (first node: gpu01)")


def het_step(node_id: int, name: str, **more: str) -> dict[str, str]:
    """A step over both components of a heterogeneous job (`srun A : B`), as Slurm 22.05 sets it (measured on the
    test cluster): training nodes gpu07, gpu02, then data nodes cpu01, cpu03. The step's node list is sorted by
    name, but SLURM_NODEID counts component 0's nodes first."""
    return {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_NODEID": str(node_id), "SLURMD_NODENAME": name,
            "SLURM_STEP_NODELIST": "cpu[01,03],gpu[02,07]", "SLURM_STEP_NUM_NODES": "4", "SLURM_STEP_NUM_TASKS": "4",
            "SLURM_HET_SIZE": "2", "SLURM_JOB_NODELIST_HET_GROUP_0": "gpu[02,07]",
            "SLURM_JOB_NODELIST_HET_GROUP_1": "cpu[01,03]", **more}


def test_a_heterogeneous_step_numbers_the_training_nodes_first():
    order = ["gpu02", "gpu07", "cpu01", "cpu03"]
    nodes = [slurm_node(het_step(i, name), resolver=lambda n, p: ADDRESSES.get(n, "10.2.0.1")) for i, name in
             enumerate(order)]
    assert [n.name for n in nodes] == order and [n.node_rank for n in nodes] == [0, 1, 2, 3]
    assert {n.rdzv for n in nodes} == {f"10.1.0.2:{slurm_port('4242')}"}  # gpu02: the first training node
    # a step over one component only (srun --het-group=1): that component's own order
    one = het_step(1, "cpu03", SLURM_STEP_NODELIST="cpu[01,03]", SLURM_STEP_NUM_NODES="2", SLURM_STEP_NUM_TASKS="2")
    assert slurm_node(one, resolver=lambda n, p: "10.2.0.1").nodes == ("cpu01", "cpu03")


def test_master_port_and_given_flags_are_honoured():
    node = slurm_node(step(2, MASTER_PORT="29400"), resolver=resolver)
    assert node.rdzv == "10.1.0.1:29400"
    node = slurm_node(step(2), nnodes=5, node_rank=2, rdzv="192.168.0.9:1234", resolver=resolver)
    assert (node.nnodes, node.node_rank, node.rdzv) == (5, 2, "192.168.0.9:1234")


def test_outside_a_step_or_on_one_node_there_is_nothing_to_derive():
    batch = step(0)
    del batch["SLURM_STEP_ID"]  # the batch script itself: the allocation, not a step
    assert slurm_node(batch, resolver=resolver) is None
    assert slurm_node({**batch, "SLURM_STEP_ID": "batch"}, resolver=resolver) is None
    assert slurm_node({}, resolver=resolver) is None
    one = step(0, nodelist="gpu01", count=1)
    assert slurm_node(one, resolver=resolver) is None
    assert slurm_node(step(3), nnodes=1, resolver=resolver) is None  # --nnodes 1: a job of its own on each node


def test_an_unresolvable_first_node_fails_naming_it_never_localhost():
    env = step(1, nodelist="gpu[09,01]", count=2, SLURMD_NODENAME="gpu01")
    with pytest.raises(ClusterConfigError) as e:
        slurm_node(env, resolver=resolver)
    assert "Slurm node gpu09, the first of SLURM_STEP_NODELIST='gpu[09,01]'" in str(e.value)
    assert "does not resolve on gpu01 (Name or service not known)" in str(e.value)


def test_a_first_node_that_resolves_to_loopback_is_refused():
    def debian_hosts_file(name: str, port: int) -> str:  # node 0's own name on node 0: "127.0.1.1 gpu01"
        return "127.0.1.1"

    with pytest.raises(ClusterConfigError, match=r"gpu01, .* resolves to 127.0.1.1 on gpu01, a loopback address"):
        slurm_node(step(0), resolver=debian_hosts_file)


def test_a_node_rank_expanded_too_early_is_refused_on_the_nodes_it_is_wrong_for():
    # `srun bash -c "conveyor run --node-rank $SLURM_NODEID ..."`: the batch shell expands it once, to 0
    assert slurm_node(step(0), node_rank=0, resolver=resolver).node_rank == 0
    for node_id in range(1, 5):
        with pytest.raises(ClusterConfigError, match=rf"--node-rank 0, but Slurm says this node \(gpu0\d\) is node "
                                                     rf"{node_id} \(SLURM_NODEID={node_id}\); the rank was probably "
                                                     rf"expanded once by the batch script's shell"):
            slurm_node(step(node_id), node_rank=0, resolver=resolver)


def test_a_node_id_copied_from_another_node_is_refused():
    env = step(0, SLURMD_NODENAME="gpu03")  # SLURM_NODEID=0 exported from node 0 into node 3's launcher
    with pytest.raises(ClusterConfigError, match=r"SLURM_NODEID=0 names node gpu01 .*, but this is gpu03"):
        slurm_node(env, resolver=resolver)


@pytest.mark.parametrize(("change", "message"), [
    ({"SLURM_STEP_NUM_TASKS": "10"}, r"srun started 10 tasks on 5 nodes .* start exactly one per node"),
    ({"SLURM_STEP_NUM_NODES": "4"}, r"SLURM_STEP_NUM_NODES='4' but SLURM_STEP_NODELIST='gpu\[01-04,07\]' lists 5"),
    ({"SLURM_NODEID": "5"}, r"SLURM_NODEID='5' is not a node index 0..4"),
    ({"SLURM_STEP_NODELIST": "gpu[01-02,01]", "SLURM_STEP_NUM_NODES": "3"}, r"names a node twice"),
    ({"MASTER_PORT": "0"}, r"MASTER_PORT='0' is not a port number"),
    ({"SLURM_STEP_NODELIST": "gpu[01-"}, r"'\[' is never closed"),
])
def test_inconsistent_step_variables_are_refused(change, message):
    with pytest.raises(ClusterConfigError, match=message):
        slurm_node(step(1, **change), resolver=resolver)


def test_given_nnodes_must_match_the_step():
    with pytest.raises(ClusterConfigError, match=r"--nnodes 4, but this Slurm step runs on 5 nodes"):
        slurm_node(step(1), nnodes=4, resolver=resolver)


def test_a_launcher_in_a_multi_node_allocation_but_outside_srun_is_warned():
    batch = {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "3", "SLURM_NODEID": "0"}
    assert "has 3 nodes, but conveyor run was not started by srun" in allocation_note(batch)
    assert allocation_note({**batch, "SLURM_JOB_NUM_NODES": "1"}) is None
    assert allocation_note(step(1)) is None


def test_conveyor_run_in_a_step_needs_no_flags_and_fails_naming_the_node(tmp_path, monkeypatch, capsys):
    (tmp_path / "train.py").write_text("")
    monkeypatch.chdir(tmp_path)
    for key, value in step(1, nodelist="nosuchnode-conveyor-test,gpu02", count=2, SLURMD_NODENAME="gpu02").items():
        monkeypatch.setenv(key, value)
    assert main(["run", "-n", "1", "train.py"]) == 2
    err = capsys.readouterr().err
    assert "Slurm node nosuchnode-conveyor-test, the first of SLURM_STEP_NODELIST" in err
    assert "does not resolve on gpu02" in err


def test_conveyor_run_in_a_step_refuses_a_wrong_node_rank(tmp_path, monkeypatch, capsys):
    (tmp_path / "train.py").write_text("")
    monkeypatch.chdir(tmp_path)
    for key, value in step(1, nodelist="localhost,gpu02", count=2, SLURMD_NODENAME="gpu02").items():
        monkeypatch.setenv(key, value)
    assert main(["run", "-n", "1", "--node-rank", "0", "train.py"]) == 2
    assert "--node-rank 0, but Slurm says this node (gpu02) is node 1" in capsys.readouterr().err
