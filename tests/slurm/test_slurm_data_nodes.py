"""Data nodes in a heterogeneous Slurm job (`conveyor slurm --data-nodes`): a real job on the test cluster.

The training component is host1 (partition train) and the data component host0 (partition data), so the
step's node list as Slurm sorts it (host[0-1]) is not its node numbering (host1 is node 0): the launchers
must read the order from the components. The trainer on host1 consumes every record once, in batches that
the data worker on host0 made, and summary.json has the dispatcher's report saying so.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from conveyor.data import TFRecordWriter

FILES, PER_FILE, BATCH = 4, 12, 4
#: What the data workers run, built by name (`--data-pipeline slurm_svc_input:records`) in the job's folder.
PIPELINE = """\
import os
from conveyor.data import Dataset, TFRecordDataset

def record_id(record):
    return int(record.decode().split("-")[1])

def records():
    files = Dataset.list_files(os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "part-*.tfrecord"),
                               shuffle=False)
    return TFRecordDataset(files).map(record_id).batch({batch})
"""
#: The trainer: a linear model fitted on batches from the data service (its address in $CONVEYOR_DATA_SERVICE).
TRAIN = """\
import json, os, socket
import numpy as np
import torch
from conveyor.data.service import from_env
import slurm_svc_input

ds = slurm_svc_input.records().distribute(from_env(), processing_mode="distributed_epoch", job_name="train")
model = torch.nn.Linear(1, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
seen = []
for batch in ds:
    ids = np.asarray(batch).ravel()
    x = torch.tensor(ids, dtype=torch.float32).reshape(-1, 1) / 50
    loss = ((model(x) - 2 * x) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    seen += [int(i) for i in ids]
with open("trained.json", "w") as f:
    json.dump({"ids": seen, "host": socket.gethostname(), "loss": float(loss)}, f)
"""

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(300)]


def write_job(folder: Path) -> None:
    (folder / "data").mkdir(parents=True)
    for f in range(FILES):
        with TFRecordWriter(str(folder / "data" / f"part-{f}.tfrecord")) as w:
            for r in range(PER_FILE):
                w.write(f"id-{f * PER_FILE + r}".encode())
    (folder / "slurm_svc_input.py").write_text(PIPELINE.format(batch=BATCH))
    (folder / "train.py").write_text(textwrap.dedent(TRAIN))


def test_a_data_node_of_its_own_component_serves_the_training_node(slurm_cluster, tmp_path):
    write_job(tmp_path)
    argv = [sys.executable, "-m", "conveyor", "slurm", "--nodes", "2", "-n", "1", "--cpus-per-node", "1",
            "--partition", "train", "--data-nodes", "1", "--data-workers", "1", "--data-partition", "data",
            "--data-cpus-per-node", "1", "--data-pipeline", "slurm_svc_input:records", "--output-dir",
            str(tmp_path / "out"), "--run-option=--timeout=120", "-o", "job.sbatch", "--submit", "train.py"]
    job = slurm_cluster.run(argv, cwd=tmp_path, env={"OMP_NUM_THREADS": "1"}).stdout.strip()
    assert "#SBATCH hetjob" in (tmp_path / "job.sbatch").read_text()
    state = slurm_cluster.wait(job, timeout=240)
    log = (tmp_path / f"slurm-{job}.out").read_text(errors="replace")
    assert state == "COMPLETED", log[-4000:]
    components = [c for c in slurm_cluster.run(["scontrol", "--oneliner", "show", "job", job]).stdout.splitlines() if c]
    assert [(c.split("Partition=")[1].split()[0], c.split(" NodeList=")[1].split()[0]) for c in components] == [
        ("train", "host1"), ("data", "host0")]

    # node 0 is the training component's host1, though Slurm lists the step's nodes as host[0-1]
    assert f"Slurm job {job}: node 0 of 2 (host1); the rendezvous at 10.77.0.2:" in log
    assert f"Slurm job {job}: node 1 of 2 (host0)" in log
    trained = json.loads((tmp_path / "trained.json").read_text())
    assert trained["host"] == "host1" and sorted(trained["ids"]) == list(range(FILES * PER_FILE))  # each id once
    # the dispatcher (node 0) saw one data worker, on host0, make every batch the trainer consumed
    block = json.loads((tmp_path / "out" / "summary.json").read_text())["data_service"]
    [worker] = block["workers"]
    assert worker["address"].startswith("10.77.0.1:") and worker["alive"]
    assert worker["elements"] == FILES * -(-PER_FILE // BATCH) == sum(t["elements"] for t in block["trainers"])
    assert block["data_worker_exits"] == [] and block["advice"]
