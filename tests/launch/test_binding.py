"""--bind: each task's CPUs from made-up topologies (pure), sysfs reading, and the plan and --dry-run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conveyor.cli.main import main
from conveyor.launch import RunOptions, describe_plan, local_plan
from conveyor.launch.binding import Cpu, CpuTopology, bind_cpus, format_cpus, parse_cpu_list


def machine(sockets: int, cores: int, threads: int, allowed: set[int] | None = None) -> CpuTopology:
    """Linux's numbering: cpu = thread * sockets * cores + socket * cores + core (siblings are far apart)."""
    cpus = [Cpu(t * sockets * cores + s * cores + c, s, s * cores + c)
            for t in range(threads) for s in range(sockets) for c in range(cores)]
    every = {cpu.id for cpu in cpus}
    return CpuTopology(tuple(cpus), frozenset(every if allowed is None else allowed))


def sets(places) -> list[str]:
    return [format_cpus(p.cpus) for p in places]


def test_core_gives_equal_disjoint_whole_cores_siblings_together():
    topo = machine(2, 8, 2)  # cpus 0-15 first threads, 16-31 their siblings
    places = bind_cpus(topo, 4, "core")
    assert sets(places) == ["0-3,16-19", "4-7,20-23", "8-11,24-27", "12-15,28-31"]
    assert [p.threads for p in places] == [4, 4, 4, 4]  # physical cores, not hyperthreads


def test_core_packs_socket_by_socket_and_leaves_the_remainder_free():
    topo = machine(2, 8, 2)
    places = bind_cpus(topo, 3, "core")  # 16 cores / 3 = 5 each; 1 core left for the launcher and system
    assert sets(places) == ["0-4,16-20", "8-12,24-28", "5-7,13-14,21-23,29-30"]  # only the pooled rest straddles
    used = [c for p in places for c in p.cpus]
    assert len(used) == len(set(used)) == 30 and {p.threads for p in places} == {5}


def test_core_with_one_socket_and_no_hyperthreads():
    places = bind_cpus(machine(1, 2, 1), 2, "core")
    assert sets(places) == ["0", "1"] and [p.threads for p in places] == [1, 1]


def test_only_the_launchers_allowed_cpus_are_handed_out():
    topo = machine(2, 4, 2, allowed={1, 2, 3, 9, 10, 11, 5})  # a cpuset; core 5 has only one thread allowed
    assert sets(bind_cpus(topo, 2, "core")) == ["1-2,9-10", "3,5,11"]
    assert [len(p.cpus) for p in bind_cpus(topo, 4, "core")] == [2, 2, 2, 1]


def test_more_tasks_than_cores_is_refused_naming_the_counts_and_the_fixes():
    with pytest.raises(ValueError) as e:
        bind_cpus(machine(1, 2, 2), 3, "core")
    text = str(e.value)
    assert "3 tasks" in text and "2 physical core(s)" in text and "cpus 0-3" in text
    assert "--bind socket" in text and "--bind none" in text


def test_socket_round_robins_tasks_over_sockets_and_splits_their_cores():
    topo = machine(2, 8, 2)
    places = bind_cpus(topo, 3, "socket")
    assert sets(places) == ["0-7,16-23", "8-15,24-31", "0-7,16-23"]
    assert [p.threads for p in places] == [4, 8, 4]  # two tasks share socket 0's 8 cores
    one = bind_cpus(machine(1, 4, 2), 2, "socket")
    assert sets(one) == ["0-7", "0-7"] and [p.threads for p in one] == [2, 2]
    many = bind_cpus(machine(1, 2, 1), 5, "socket")  # more tasks than cores: they share, one thread each
    assert {p.threads for p in many} == {1}


def test_none_binds_nothing_and_unknown_modes_are_refused():
    assert bind_cpus(machine(1, 2, 1), 2, "none") is None
    with pytest.raises(ValueError, match="none, core, socket"):
        bind_cpus(machine(1, 2, 1), 2, "numa")


def test_cpu_lists_round_trip():
    assert format_cpus([3, 0, 1, 2, 8, 10, 11]) == "0-3,8,10-11"
    assert parse_cpu_list("0-3,8,10-11\n") == (0, 1, 2, 3, 8, 10, 11)
    assert format_cpus([]) == "" and parse_cpu_list("") == ()


def test_topology_is_read_from_sysfs_with_siblings_as_one_core(tmp_path: Path):
    for cpu, (socket, siblings) in enumerate([(0, "0,2"), (1, "1,3"), (0, "0,2"), (1, "1,3")]):
        topo = tmp_path / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text(f"{socket}\n")
        (topo / "core_cpus_list").write_text(siblings + "\n")
    read = CpuTopology.read(tmp_path, allowed={0, 1, 2, 3, 7})  # cpu 7 has no sysfs entry: a core of its own
    assert read.cores() == {(0, 0): (0, 2), (0, 7): (7,), (1, 1): (1, 3)}
    assert sets(bind_cpus(read, 2, "socket")) == ["0,2,7", "1,3"]


def test_this_machines_topology_covers_the_launchers_cpus():
    read = CpuTopology.read()
    assert {c for ids in read.cores().values() for c in ids} == os.sched_getaffinity(0)


def test_the_plan_binds_every_task_sets_omp_and_dry_run_shows_the_cpus():
    opts = RunOptions(script="train.py", data_dir="/d", output_dir="/o", workers=2, ps=1, bind="core")
    plan = local_plan(opts, [1, 2, 3], master_port=4, secret=b"s" * 32, environ={}, topology=machine(1, 3, 2))
    assert [t.cpus for t in plan.tasks] == [(0, 3), (1, 4), (2, 5)]  # workers first, then the ps
    assert [t.env["OMP_NUM_THREADS"] for t in plan.tasks] == ["1", "1", "1"]
    assert all("CONVEYOR_OMP_DEFAULT" not in t.env for t in plan.tasks)  # the launcher's count, not torchrun's 1
    out = describe_plan(plan)
    assert out.count("cpus: ") == 3 and "    cpus: 2,5 (2 logical)" in out
    mine = local_plan(opts, [1, 2, 3], master_port=4, secret=b"s" * 32, environ={"OMP_NUM_THREADS": "7"},
                      topology=machine(1, 3, 2))
    assert all(t.env["OMP_NUM_THREADS"] == "7" and "OMP_NUM_THREADS" not in t.set_vars for t in mine.tasks)
    unbound = local_plan(RunOptions(script="train.py", data_dir="/d", output_dir="/o", workers=2), [1, 2],
                         master_port=4, secret=b"s" * 32, environ={})
    assert all(t.cpus == () for t in unbound.tasks) and "cpus:" not in describe_plan(unbound)


def test_bind_and_share_gpus_options_are_checked_and_passed_on():
    with pytest.raises(ValueError, match="--bind 'cores'"):
        RunOptions(script="train.py", data_dir="/d", output_dir="/o", bind="cores")
    opts = RunOptions(script="train.py", data_dir="/d", output_dir="/o", workers=2, ps=1, strategy="ps-sync",
                      share_gpus=True)
    plan = local_plan(opts, [1, 2, 3], master_port=4, secret=b"s" * 32, environ={})
    assert [t.env.get("CONVEYOR_SHARE_GPUS") for t in plan.tasks] == ["1", "1", None]  # training tasks only


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs this process may use")
def test_conveyor_run_bind_core_gives_each_task_its_own_core(tmp_path: Path):
    script = tmp_path / "show.py"
    script.write_text("import json, os, torch\nfrom conveyor.data.base import cpu_budget\n"
                      "print('PLACED', json.dumps([os.environ['RANK'], sorted(os.sched_getaffinity(0)), "
                      "torch.get_num_threads(), cpu_budget()]))\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run([sys.executable, "-m", "conveyor.cli.main", "run", "-n", "2", "--bind", "core",
                           "--max-restarts", "0", str(script)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    placed = sorted(json.loads(line.split("PLACED ", 1)[1]) for line in done.stdout.splitlines() if "PLACED" in line)
    assert [rank for rank, *_ in placed] == ["0", "1"]
    cpus = [set(c) for _, c, _, _ in placed]
    assert all(len(c) == len(cpus[0]) >= 1 for c in cpus) and not cpus[0] & cpus[1]
    assert cpus[0] | cpus[1] <= os.sched_getaffinity(0)
    cores = len(CpuTopology.read().cores()) // 2  # this machine's whole cores, halved
    assert [threads for *_, threads, _ in placed] == [cores, cores]  # OMP_NUM_THREADS from the binding
    assert [budget for *_, budget in placed] == [len(c) for c in cpus]  # the input pipeline's AUTOTUNE


def test_an_impossible_binding_is_refused_before_anything_starts(tmp_path: Path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "task.py").write_text("print('never')\n")
    too_many = len(CpuTopology.read().cores()) + 1
    assert main(["run", "-n", str(too_many), "--bind", "core", "task.py"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--bind core: {too_many} tasks" in err, err
    assert not (tmp_path / "output").exists()
    assert main(["run", "--bind", "cores", "task.py"]) == 2
    assert "invalid choice: 'cores'" in capsys.readouterr().err
