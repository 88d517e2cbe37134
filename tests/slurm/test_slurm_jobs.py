"""conveyor on a real Slurm cluster (two nodes on namespace hosts): `conveyor slurm --submit`, then sbatch and srun.

The digits example over two Slurm nodes ends with the parameters of a one-node `conveyor run` of the
same job (the launchers found their node ranks and the rendezvous from Slurm alone); `scancel` leaves
no process of the job; a node rank expanded by the batch shell fails the job naming the trap.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from safetensors.numpy import load_file

from conveyor.launch import RunOptions

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "digits" / "train.py"
TRAIN_ARGS = ("--epochs", "1", "--checkpoint-every", "20")
#: One thread per task everywhere: a lone task per node would otherwise get every core, and a different
#: thread count sums in a different order, so the last bits of the parameters would differ from the run
#: on one machine (two tasks, a core each).
THREADS = {"OMP_NUM_THREADS": "1"}

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(300)]


def submit(cluster, folder: Path, *options: str, train_args=TRAIN_ARGS) -> str:
    """`conveyor slurm --submit` on host0 (a login node of the cluster); the job id."""
    argv = [sys.executable, "-m", "conveyor", "slurm", "--data-dir", str(folder / "data"), "--output-dir",
            str(folder / "out"), "--run-option=--timeout=120", *options, "--submit", str(SCRIPT), *train_args]
    folder.mkdir(parents=True, exist_ok=True)
    return cluster.run(argv, cwd=folder, env=THREADS).stdout.strip()


def reference(folder: Path, *job: str) -> subprocess.Popen:
    """The same job as one `conveyor run` on this machine."""
    argv = [sys.executable, "-m", "conveyor", "run", *job, "--data-dir", str(folder / "data"), "--output-dir",
            str(folder / "out"), str(SCRIPT), *TRAIN_ARGS]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **THREADS})


def final_parameters(out: Path) -> dict:
    latest = (out / "checkpoints" / "latest").read_text().strip()
    return load_file(str(out / "checkpoints" / latest / "model.safetensors"))


def job_log(folder: Path, job: str) -> str:
    return (folder / f"slurm-{job}.out").read_text(errors="replace")


def ps_only_nodes() -> str | None:
    """Why a node of parameter servers only (`conveyor run -n 0 --ps M`) cannot run in this tree, or None."""
    try:
        RunOptions(script="train.py", data_dir="/data", output_dir="/out", workers=0, ps=1)
    except ValueError as e:
        return f"conveyor run -n 0 (a node of parameter servers only) is not supported here: {e}"
    return None


PS_SYNC = ("--ps", "1", "--strategy", "ps-sync")
#: name -> (the Slurm job's node flags, the same job on one machine)
JOBS = {
    "allreduce": (("-n", "1"), ("-n", "2")),
    "ps-sync": (("-n", "1", *PS_SYNC), ("-n", "2", *PS_SYNC)),  # node 0: a worker and the ps; node 1: a worker
    "ps-sync-own-node": (("-n", "2", "--ps-nodes", "1", *PS_SYNC), ("-n", "2", *PS_SYNC)),  # node 1: the ps alone
}


@pytest.fixture(scope="module")
def digits_runs(slurm_cluster, tmp_path_factory):
    """Every run of the comparison, started at once: the two cores are shared either way, and the runs' waits
    (start-up, rendezvous) overlap. The Slurm jobs share the two nodes (a CPU each, not whole nodes); jobs
    with the same one-machine equivalent share its run."""
    base = tmp_path_factory.mktemp("digits")
    locals_: dict[tuple[str, ...], tuple[Path, subprocess.Popen]] = {}
    started: dict[str, tuple[Path, str, Path, subprocess.Popen]] = {}
    try:
        for name, (slurm_job, local_job) in JOBS.items():
            if name.endswith("own-node") and ps_only_nodes():
                continue
            if local_job not in locals_:
                folder = base / f"local-{len(locals_)}"
                locals_[local_job] = (folder, reference(folder, *local_job))
            job = submit(slurm_cluster, base / name, "--nodes", "2", "--cpus-per-node", "1", *slurm_job)
            started[name] = (base / name, job, *locals_[local_job])
        yield started
    finally:
        for _, local in locals_.values():
            if local.poll() is None:
                local.kill()
            local.wait()


@pytest.mark.parametrize("name", list(JOBS))
def test_digits_over_two_slurm_nodes_match_one_node(slurm_cluster, digits_runs, name):
    if name not in digits_runs:
        pytest.skip(ps_only_nodes())
    folder, job, local_folder, local = digits_runs[name]
    state = slurm_cluster.wait(job, timeout=240)
    log = job_log(folder, job)
    assert state == "COMPLETED", log[-4000:]
    local_log, _ = local.communicate(timeout=240)
    assert local.returncode == 0, local_log[-3000:]

    # every launcher found its place from Slurm: node 1 is host1, the rendezvous is host0's own address
    assert f"Slurm job {job}: node 1 of 2 (host1); the rendezvous at 10.77.0.1:" in log
    assert f"Slurm job {job}: node 0 of 2 (host0)" in log
    got, want = final_parameters(folder / "out"), final_parameters(local_folder / "out")
    assert got.keys() == want.keys()
    for key in want:
        assert (got[key] == want[key]).all(), f"{key} differs from the one-node run"
    assert not list(folder.glob(".conveyor-job-*.secret"))  # the batch script removed the secret


def job_processes(job: str, folder: Path) -> list[psutil.Process]:
    """Every process of the job: Slurm's variables in its environment, or the job's folder on its command line."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if proc.environ().get("SLURM_JOB_ID") == job or str(folder) in " ".join(proc.info["cmdline"] or ()):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def training_tasks(job: str, folder: Path) -> list[psutil.Process]:
    tasks = []
    for proc in job_processes(job, folder):
        try:
            if "train.py" in " ".join(proc.cmdline()) and "conveyor" not in " ".join(proc.cmdline()):
                tasks.append(proc)
        except psutil.NoSuchProcess:
            continue
    return tasks


def test_scancel_leaves_no_process_of_the_job(slurm_cluster, tmp_path):
    job = submit(slurm_cluster, tmp_path, "--nodes", "2", "-n", "1", train_args=("--epochs", "100"))
    deadline = time.monotonic() + 120
    while len(tasks := training_tasks(job, tmp_path)) < 2:  # a training task on each node
        assert time.monotonic() < deadline, f"the job never started training: {slurm_cluster.state(job)}"
        time.sleep(0.2)
    assert {p.environ().get("SLURMD_NODENAME") for p in tasks} == {"host0", "host1"}
    slurm_cluster.run(["scancel", job])
    deadline = time.monotonic() + 60  # KillWait is 5 s: then SIGKILL for whatever ignored SIGTERM
    while left := job_processes(job, tmp_path):
        assert time.monotonic() < deadline, f"still running after scancel: {[p.info['cmdline'] for p in left]}"
        time.sleep(0.2)
    assert slurm_cluster.wait(job, timeout=30) == "CANCELLED"


def test_a_node_rank_expanded_by_the_batch_shell_fails_naming_the_trap(slurm_cluster, tmp_path):
    # The classic mistake: double quotes make the batch script's shell (on node 0) expand $SLURM_NODEID
    # once, so every node's launcher is told --node-rank 0.
    secret = tmp_path / "job.secret"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    run = (f"{sys.executable} -m conveyor run -n 1 --nnodes 2 --node-rank $SLURM_NODEID --job-secret-file {secret} "
           f"--data-dir {tmp_path / 'data'} --output-dir {tmp_path / 'out'} {SCRIPT}")
    batch = tmp_path / "job.sbatch"
    batch.write_text(f'#!/bin/bash\nsrun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c "{run}"\n')
    job = slurm_cluster.sbatch(batch, "--nodes=2", f"--chdir={tmp_path}")
    assert slurm_cluster.wait(job, timeout=120) == "FAILED"
    log = (tmp_path / f"slurm-{job}.out").read_text(errors="replace")
    assert "--node-rank 0, but Slurm says this node (host1) is node 1 (SLURM_NODEID=1)" in log, log[-3000:]
    assert "expanded once by the batch script's shell" in log
