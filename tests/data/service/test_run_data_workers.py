"""`conveyor run --data-workers K`: the launcher starts the dispatcher and K data workers as tasks of the job,
the trainers find the service in $CONVEYOR_DATA_SERVICE, a data worker's death is not the job's, and
summary.json gets the service's figures. Real jobs on 127.0.0.1."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from svc_pipelines import FILES, PER_FILE, free_port

from conveyor.cli.main import main

HERE = Path(__file__).parent
IDS = list(range(FILES * PER_FILE))

TRAIN = """\
import json, os, time
import numpy as np
import torch
from conveyor.data.service import from_env
import svc_pipelines

rank, out = int(os.environ["RANK"]), os.environ["IDS_DIR"]
pipeline = getattr(svc_pipelines, os.environ["PIPELINE"])
# each trainer its own job: the exactly-once bookkeeping is per trainer (docs/data-service.md)
ds = pipeline().distribute(from_env(), processing_mode="distributed_epoch", job_name=f"train-{rank}",
                           worker_timeout=3.0)
model = torch.nn.Linear(1, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for epoch in range(int(os.environ["EPOCHS"])):
    seen = []
    for batch in ds:
        ids = np.asarray(batch).ravel()
        x = torch.tensor(ids, dtype=torch.float32).reshape(-1, 1) / 60
        loss = ((model(x) - x) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        seen += [int(i) for i in ids]
        if len(seen) >= 10:
            open(os.path.join(out, f"started-{rank}"), "w").close()
    with open(os.path.join(out, f"ids-{rank}-{epoch}.json"), "w") as f:
        json.dump(seen, f)
"""


def launch(tmp_path: Path, record_dir: Path, pipeline: str, epochs: int) -> subprocess.Popen:
    (tmp_path / "train.py").write_text(textwrap.dedent(TRAIN))
    (tmp_path / "ids").mkdir()
    env = {**os.environ, "SVC_TEST_DIR": str(record_dir), "IDS_DIR": str(tmp_path / "ids"), "PIPELINE": pipeline,
           "EPOCHS": str(epochs), "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    with open(tmp_path / "launcher.out", "w") as out, open(tmp_path / "launcher.err", "w") as err:
        return subprocess.Popen([sys.executable, "-m", "conveyor", "run", "-n", "2", "--data-workers", "2",
                                 "--data-pipeline", f"svc_pipelines:{pipeline}", "--max-restarts", "0", "train.py"],
                                cwd=tmp_path, env=env, stdout=out, stderr=err)


def finish(proc: subprocess.Popen, tmp_path: Path, timeout: float = 90) -> str:
    try:
        assert proc.wait(timeout=timeout) == 0, (tmp_path / "launcher.err").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    return (tmp_path / "launcher.err").read_text()


def ids_of(tmp_path: Path, rank: int, epoch: int) -> list[int]:
    return json.loads((tmp_path / "ids" / f"ids-{rank}-{epoch}.json").read_text())


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_job_with_two_data_workers_trains_on_every_id_once_per_epoch(tmp_path, record_dir):
    err = finish(launch(tmp_path, record_dir, "records", epochs=2), tmp_path)
    for rank in (0, 1):
        for epoch in (0, 1):
            assert sorted(ids_of(tmp_path, rank, epoch)) == IDS  # every id once: none lost, none twice
    assert "data service:" in err
    block = json.loads((tmp_path / "output" / "summary.json").read_text())["data_service"]
    assert len(block["workers"]) == 2 and block["data_worker_exits"] == [] and block["lost_workers"] == []
    # both data workers served, and what they produced is what the 4 epochs (2 trainers x 2) consumed
    assert all(w["elements"] > 0 and w["bytes"] > 0 and w["elements_per_s"] > 0 for w in block["workers"])
    per_epoch = FILES * -(-PER_FILE // 4)  # batches of 4, per file
    assert len(block["trainers"]) == 4 and sum(t["elements"] for t in block["trainers"]) == 4 * per_epoch
    assert sum(w["elements"] for w in block["workers"]) == 4 * per_epoch
    assert sum(w["bytes"] for w in block["workers"]) == sum(t["bytes"] for t in block["trainers"])
    for t in block["trainers"]:
        assert 0 <= t["input_wait_s"] <= t["elapsed_s"] and 0 <= t["input_wait_share"] <= 1
    assert block["workers_needed"] >= 1 and isinstance(block["input_bound"], bool) and block["advice"]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_data_worker_killed_mid_epoch_is_restarted_and_no_id_is_lost_or_repeated(tmp_path, record_dir):
    proc = launch(tmp_path, record_dir, "slow_records", epochs=1)
    deadline = time.monotonic() + 60
    while not (tmp_path / "ids" / "started-0").exists():
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "launcher.err").read_text()
        time.sleep(0.05)
    pid = int(re.search(r"data_worker:0 pid (\d+)", (tmp_path / "launcher.err").read_text()).group(1))
    os.kill(pid, signal.SIGKILL)
    err = finish(proc, tmp_path)
    assert "data_worker:0 was killed by SIGKILL" in err and "starting it again" in err
    for rank in (0, 1):
        assert sorted(ids_of(tmp_path, rank, 0)) == IDS
    block = json.loads((tmp_path / "output" / "summary.json").read_text())["data_service"]
    [exit_] = block["data_worker_exits"]
    assert exit_["task"] == "data_worker:0" and exit_["status"] == "was killed by SIGKILL" and exit_["restarted"]
    # the dead one, replaced at its address by the restarted one; its splits went to others
    [lost] = block["lost_workers"]
    assert len(block["workers"]) == 3 and [w["alive"] for w in block["workers"] if w["id"] == lost["id"]] == [False]
    assert lost["address"] in [w["address"] for w in block["workers"] if w["alive"]]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_node_of_data_workers_only_serves_the_trainers_of_node_0(tmp_path, record_dir):
    """--nnodes 2: node 0 trains (and runs the dispatcher), node 1 runs data workers only (-n 0 --data-workers 2),
    the shape `conveyor slurm --data-nodes` writes."""
    (tmp_path / "train.py").write_text(textwrap.dedent(TRAIN))
    (tmp_path / "ids").mkdir()
    env = {**os.environ, "SVC_TEST_DIR": str(record_dir), "IDS_DIR": str(tmp_path / "ids"), "PIPELINE": "records",
           "EPOCHS": "1", "CONVEYOR_JOB_SECRET": os.urandom(32).hex(),
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [("-n", "1"), ("-n", "0", "--data-workers", "2", "--data-pipeline", "svc_pipelines:records")]
    procs = []
    for rank, flags in enumerate(nodes):
        with open(tmp_path / f"node{rank}.err", "w") as err:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "conveyor", "run", "--nnodes", "2", "--node-rank", str(rank), "--rdzv",
                 endpoint, "--output-dir", str(tmp_path / f"output{rank}"), "--timeout", "30", *flags, "train.py"],
                cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=err))
    try:
        codes = [p.wait(timeout=90) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = [(tmp_path / f"node{rank}.err").read_text() for rank in (0, 1)]
    assert codes == [0, 0], logs
    assert sorted(ids_of(tmp_path, 0, 0)) == IDS
    block = json.loads((tmp_path / "output0" / "summary.json").read_text())["data_service"]
    # both of node 1's workers registered; the trainer's elements all came from them (node 0 runs none), though a
    # worker that registers late on a loaded machine may find the epoch already dealt
    assert len(block["workers"]) == 2 and 4 * sum(w["elements"] for w in block["workers"]) >= len(IDS)  # batches of 4
    assert "'dispatcher': ['127.0.0.1:" in logs[1] and "'data_worker': [" in logs[1]


def test_dry_run_shows_the_dispatcher_the_data_workers_and_the_address_every_task_gets(tmp_path, capsys,
                                                                                      monkeypatch, record_dir):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(HERE))
    monkeypatch.setenv("SVC_TEST_DIR", str(record_dir))
    (tmp_path / "train.py").write_text("print('never')\n")
    assert main(["run", "--dry-run", "-n", "2", "--data-workers", "2", "--data-pipeline", "svc_pipelines:records",
                 "train.py"]) == 0
    out = capsys.readouterr().out
    address = json.loads(out.splitlines()[1].removeprefix("cluster: "))["dispatcher"][0]
    assert "[dispatcher:0]" in out and "[data_worker:1]" in out and "conveyor data serve" in out
    assert f"data worker --dispatcher {address}" in out and "--pipeline svc_pipelines:records" in out
    assert out.count(f"CONVEYOR_DATA_SERVICE={address}") == 5  # 2 trainers, the dispatcher, 2 data workers


@pytest.mark.parametrize("argv, needles", [
    (["--data-workers", "-1"], ["--data-workers -1"]),
    (["--data-workers", "1"], ["--data-workers 1 needs --data-pipeline MODULE:FUNCTION"]),
    (["--data-pipeline", "svc_pipelines:records"], ["add --data-workers K"]),
    (["--data-workers", "1", "--data-pipeline", "no_such_module:train"],
     ["--data-pipeline no_such_module:train: cannot import no_such_module", "PYTHONPATH"]),
    (["--data-workers", "1", "--data-pipeline", "svc_pipelines:no_such_function"],
     ["--data-pipeline svc_pipelines:no_such_function", "has no function 'no_such_function'", "define it there"]),
])
def test_bad_data_service_flags_are_one_line_naming_the_fix(tmp_path, capsys, monkeypatch, argv, needles):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(HERE))
    (tmp_path / "train.py").write_text("print('never')\n")
    assert main(["run", *argv, "train.py"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(n in err for n in needles), err
    assert not (tmp_path / "output").exists()
